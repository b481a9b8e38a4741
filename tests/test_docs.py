"""The documentation site: its generated references match the code, and it builds strictly.

The configuration, CLI and gRPC references are generated from the pydantic schemas, the argument
parsers and the proto (duet/reference_pages.py); a change to any of them without regenerating
fails here, naming the page. The strict MkDocs build fails on a broken link or anchor (between
pages, or to a file of the repository such as a raw result), and on a page missing from the nav.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from duet.reference_pages import REFERENCE_DIR, grpc_page, stale_pages

REPO = Path(__file__).resolve().parent.parent


def test_generated_references_match_the_code():
    stale = stale_pages()
    assert not stale, f"stale generated pages {stale}: run `python -m duet.reference_pages` (or `make docs`)"


def test_every_rpc_and_message_field_is_documented():
    undocumented = [line for line in grpc_page().splitlines() if line.startswith("| `") and line.endswith("|  |")]
    allowed = {"ids", "prompt_tokens", "workers", "pools"}  # self-explanatory by name and type
    assert [line for line in undocumented if line.split("`")[1] not in allowed] == []


def test_site_builds_strictly(tmp_path):
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    warnings = [line for line in build.stderr.splitlines() if "WARNING" in line or "Error" in line]
    assert build.returncode == 0, "strict docs build failed:\n" + "\n".join(warnings or build.stderr.splitlines()[-20:])
    # The repository files pages link to are in the site (a raw result, the changelog).
    assert (tmp_path / "site" / "changelog" / "index.html").is_file()
    assert (tmp_path / "site" / "reference" / "configuration" / "index.html").is_file()
    assert REFERENCE_DIR.is_dir()
