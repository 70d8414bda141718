"""``python -m e2e.reliability [--ci] [--only kill9,fuzz,...] [--seed N]``: the fault suite.

``--kinds`` and ``--crash-points`` narrow the kill -9 runs to some claim kinds (each run's first
claim; the others are drawn as always) and crash points, and ``--kill9-runs`` sets their number:
``--only kill9 --kinds passthrough --kill9-runs 300`` hammers passthrough alone.

Starts the real control plane (as ``make e2e`` does), runs the scenarios, prints a table, writes
``_output/reliability.json``; exits 1 when a goal is missed, 2 when the suite itself failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from e2e.reliability import kill9, suite
from e2e.reliability.env import environment

OUTPUT = Path("_output/reliability.json")


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.reliability", description=__doc__)
    parser.add_argument("--ci", action="store_true", help="the CI-sized subset")
    parser.add_argument("--only", default=",".join(suite.SCENARIOS), help="scenarios, comma-separated")
    parser.add_argument("--seed", type=int, default=None, help="default: random (printed)")
    parser.add_argument("--output", type=Path, default=OUTPUT)
    parser.add_argument("--kinds", default="", help="kill9: first claim kinds (a,b,...; default all)")
    parser.add_argument("--crash-points", default="", help="kill9: crash points (a,b,...; default all)")
    parser.add_argument("--kill9-runs", type=int, default=None, help="kill9: runs (default: the size's)")
    args = parser.parse_args()
    only = tuple(s for s in args.only.split(",") if s)
    unknown = set(only) - set(suite.SCENARIOS)
    if unknown:
        parser.error(f"unknown scenarios {sorted(unknown)}; known: {', '.join(suite.SCENARIOS)}")
    seed = args.seed if args.seed is not None else random.randrange(2**31)
    size = suite.CI if args.ci else suite.FULL
    if args.kill9_runs is not None:
        size = dataclasses.replace(size, kill9_runs=args.kill9_runs)
    try:
        focus = kill9.Focus(
            kinds=tuple(k for k in args.kinds.split(",") if k) or kill9.KINDS,
            points=tuple(p for p in args.crash_points.split(",") if p) or kill9.POINTS,
        )
    except ValueError as error:
        parser.error(str(error))
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="dra-reliability-") as scratch, environment(Path(scratch)) as env:
        figures = suite.run(env, size, seed, only, focus)
    figures["duration_s"] = round(time.monotonic() - started, 1)
    figures["size"] = "ci" if args.ci else "full"
    figures["machine"] = {
        "cpus": os.cpu_count(),
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
    }
    missed = suite.missed_goals(figures)
    figures["missed_goals"] = missed
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(figures, indent=2) + "\n")
    print(table(figures))
    print(f"\nwritten: {args.output}")
    return 1 if missed else 0


def table(figures: dict[str, Any]) -> str:
    """Every scalar figure, one per line, grouped by scenario; then the problems and missed goals."""
    lines = [f"fault suite ({figures.get('size')}, seed {figures['seed']}, {figures.get('duration_s')} s)"]
    goals = set(suite.ZERO_GOALS)
    for key, value in figures.items():
        if "." not in key or key.endswith(".problems"):
            continue
        shown = json.dumps(value) if isinstance(value, dict | list) else str(value)
        mark = ("  ok" if not value else "  MISSED") if key in goals else ""
        lines.append(f"  {key:<42} {shown}{mark}")
    lines.append("  seconds per scenario: " + ", ".join(f"{k} {v}" for k, v in figures["seconds"].items()))
    for key, value in figures.items():
        if key.endswith(".problems") and value:
            lines.append(f"{key} (first {len(value)}):")
            lines.extend(f"    {problem}" for problem in value)
    for missed in figures.get("missed_goals", []):
        lines.append(f"MISSED: {missed}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
