"""MkDocs hooks: the site links into the repository itself (raw results, run notes, configs).

A page links to a file outside docs/ by its relative path in the repository, as it would on a
code host (``../../benchmarks/results/serve_peers_code/README.md``). These hooks copy every such
file into the site under ``repo/`` (following links from copied Markdown files too, so a run's
README can link to its JSON) and rewrite the links to the copies; the repository's CHANGELOG.md
becomes the page ``changelog.md``. A link to a file that does not exist is left as written, so
the strict build fails on it like on any broken link.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File, Files

_LINK = re.compile(r"(\]\()([^)\s#]+)(#[^)\s]*)?(\))")
_REPO_PREFIX = "repo/"
# Site path -> the file it was made from, relative to the repository root.
_sources: dict[str, str] = {}


def _repo_root(config) -> Path:
    return Path(config.config_file_path).resolve().parent


def _docs_prefix(config) -> str:
    return Path(config.docs_dir).resolve().relative_to(_repo_root(config)).as_posix() + "/"


def _external(target: str) -> bool:
    return "://" in target or target.startswith(("mailto:", "/"))


def _site_path(repo_path: str, docs_prefix: str) -> str:
    """Where a repository file is in the site: docs pages at their place, the rest under repo/."""
    if repo_path == "CHANGELOG.md":
        return "changelog.md"
    if repo_path.startswith(docs_prefix):
        return repo_path[len(docs_prefix):]
    return _REPO_PREFIX + repo_path


def _targets(text: str, source: str) -> list[str]:
    """Repository paths of the relative links in ``text`` of the file at ``source``."""
    found = []
    for match in _LINK.finditer(text):
        target = match.group(2)
        if not _external(target):
            found.append(posixpath.normpath(posixpath.join(posixpath.dirname(source), target)))
    return found


def on_files(files: Files, config) -> Files:
    root, docs_prefix = _repo_root(config), _docs_prefix(config)
    _sources.clear()
    for file in files.documentation_pages():
        _sources[file.src_uri] = docs_prefix + file.src_uri
    if (root / "CHANGELOG.md").is_file():
        files.append(File.generated(config, "changelog.md", abs_src_path=str(root / "CHANGELOG.md")))
        _sources["changelog.md"] = "CHANGELOG.md"
    queue = list(_sources.values())
    while queue:
        source = queue.pop()
        for target in _targets((root / source).read_text(), source):
            site = _site_path(target, docs_prefix)
            if target.startswith(("..", docs_prefix)) or files.get_file_from_path(site) or not (root / target).is_file():
                continue  # outside the repository, a docs file (mkdocs checks those), copied, or missing
            files.append(File.generated(config, site, abs_src_path=str(root / target)))
            _sources[site] = target
            if target.endswith(".md"):
                queue.append(target)
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    docs_prefix = _docs_prefix(config)
    source = _sources.get(page.file.src_uri, docs_prefix + page.file.src_uri)
    here = posixpath.dirname(page.file.src_uri)

    def rewrite(match: re.Match) -> str:
        target = match.group(2)
        if _external(target):
            return match.group(0)
        repo_path = posixpath.normpath(posixpath.join(posixpath.dirname(source), target))
        site = _site_path(repo_path, docs_prefix)
        if not repo_path.startswith(docs_prefix) and site not in _sources:
            return match.group(0)  # missing: left as written, so the build reports it
        relative = posixpath.relpath(site, here or ".")
        return f"{match.group(1)}{relative}{match.group(3) or ''}{match.group(4)}"

    return _LINK.sub(rewrite, markdown)
