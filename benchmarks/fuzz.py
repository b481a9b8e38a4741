"""The long fuzzing run: the suite's property-based fuzz tests with many more, unseeded inputs.

The properties live in one place, the test suite (tests/test_fuzz_files.py: every file duet
reads; tests/test_fuzz_api.py: gRPC Generate, GetStatus and Admin, hostile values and raw bytes;
tests/test_fuzz_http.py: the OpenAI HTTP API), where a seeded pass of 40-150 inputs per property
keeps CI fast. ``duet bench fuzz --examples N`` runs the same properties with N fresh inputs
each (DUET_FUZZ_EXAMPLES), against a real deployment for the API surfaces, and reports how many
inputs each property tried and how many failed, from Hypothesis' own statistics. It needs a
checkout (the tests folder), as ``make test`` does.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results" / "fuzz.json"
SURFACES = {"files": "tests/test_fuzz_files.py", "grpc": "tests/test_fuzz_api.py", "http": "tests/test_fuzz_http.py"}
_TEST = re.compile(r"^(tests/\S+::\S+):$")
_COUNTS = re.compile(r"(\d+) passing, (\d+) failing, and (\d+) invalid")


def parse_statistics(output: str) -> dict[str, dict[str, int]]:
    """Per property, the inputs Hypothesis tried (passing + failing) and how many failed,
    summed over its phases (explicit examples, generation, shrinking)."""
    properties: dict[str, dict[str, int]] = {}
    current = None
    for line in output.splitlines():
        if match := _TEST.match(line.strip()):
            current = properties.setdefault(match.group(1), {"inputs": 0, "failing": 0})
        elif current is not None and (match := _COUNTS.search(line)):
            passing, failing = int(match.group(1)), int(match.group(2))
            current["inputs"] += passing + failing
            current["failing"] += failing
    return properties


def run_fuzz(examples: int, surfaces: list[str]) -> dict[str, Any]:
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--hypothesis-show-statistics",
               *(SURFACES[surface] for surface in surfaces)]
    started = time.monotonic()
    run = subprocess.run(command, cwd=REPO, env={**os.environ, "DUET_FUZZ_EXAMPLES": str(examples)},
                         capture_output=True, text=True)
    properties = parse_statistics(run.stdout)
    failed_tests = [line.split(" ", 1)[1].split(" - ")[0] for line in run.stdout.splitlines() if line.startswith("FAILED ")]
    return {
        "examples_per_property": examples, "surfaces": surfaces, "seconds": round(time.monotonic() - started),
        "inputs": sum(p["inputs"] for p in properties.values()), "properties": properties,
        "failed_tests": failed_tests, "pytest_exit": run.returncode,
        "output": run.stdout,
    }


def format_report(result: dict[str, Any]) -> str:
    lines = [f"{'property':<80}{'inputs':>9}{'failing':>9}"]
    for name, row in result["properties"].items():
        lines.append(f"{name:<80}{row['inputs']:>9}{row['failing']:>9}")
    lines.append(f"{result['inputs']} inputs in {result['seconds']} s; failed tests: {result['failed_tests'] or 'none'}")
    return "\n".join(lines)


def _command(args: argparse.Namespace) -> int:
    unknown = sorted(set(args.surfaces) - set(SURFACES))
    if unknown:
        print(f"duet bench fuzz: --surfaces: unknown {', '.join(unknown)} (known: {', '.join(SURFACES)})", file=sys.stderr)
        return 2
    if not (REPO / "tests").is_dir():
        print("duet bench fuzz: the properties are in the checkout's tests/ folder, which this install lacks", file=sys.stderr)
        return 2
    result = run_fuzz(args.examples, args.surfaces)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    output = result.pop("output")
    log = args.out.with_suffix(".log")
    log.write_text(output)  # the falsifying examples, when a property failed
    args.out.write_text(json.dumps(result, indent=2))
    print(format_report(result))
    print(f"results: {args.out}; pytest's output: {log}", file=sys.stderr)
    return 0 if result["pytest_exit"] == 0 else 1


def register_command(benches: argparse._SubParsersAction) -> None:
    parser = benches.add_parser("fuzz", help="the fuzz properties with N fresh inputs each (files, gRPC, HTTP; real vLLM)")
    parser.add_argument("--examples", type=int, default=3000, help="inputs per property (the suite uses 40-150, seeded)")
    parser.add_argument("--surfaces", type=lambda text: text.split(","), default=list(SURFACES),
                        help=f"comma-separated, from {', '.join(SURFACES)}")
    parser.add_argument("--out", type=Path, default=RESULTS, help="JSON result")
    parser.set_defaults(handler=_command)
