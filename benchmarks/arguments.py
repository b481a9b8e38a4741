"""Command-line value types and result files the benchmarks share."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable


def positive_list(kind: Callable[[str], float]) -> Callable[[str], list]:
    """An argparse ``type``: comma-separated positive numbers (``1,2``; ``100,400``), refused
    with argparse's own message naming the option otherwise."""

    def parse(text: str) -> list:
        try:
            values = [kind(value) for value in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"a comma-separated list of numbers, e.g. 1,2 (got {text!r})") from None
        if min(values) <= 0:
            raise argparse.ArgumentTypeError(f"every value must be positive (got {text!r})")
        return values

    return parse


def positive_float(text: str) -> float:
    """An argparse ``type``: one positive number, refused with argparse's own message otherwise."""
    values = positive_list(float)(text)
    if len(values) != 1:
        raise argparse.ArgumentTypeError(f"one number, e.g. 10 (got {text!r})")
    return values[0]


def write_results(results: Any, out: str | None, default: Path) -> int:
    """Write ``results`` as JSON to ``out`` (``--out``), else ``default``; says where on stderr.
    Returns the command's exit status (0)."""
    path = Path(out) if out else default
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2))
    print(f"results: {path}", file=sys.stderr)
    return 0
