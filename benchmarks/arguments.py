"""Command-line value types the benchmarks share."""

from __future__ import annotations

import argparse
from typing import Callable


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
