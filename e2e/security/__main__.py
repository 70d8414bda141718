"""``python -m e2e.security`` (``make security``): the attack suite on a control plane of its own.

Starts the real control plane (as ``make e2e`` does; KUBE_VERSION picks the release), runs
:func:`e2e.security.suite.run`, prints the table and writes ``_output/security.json``; exits 1 when
a goal is missed (an attack succeeded, a control failed, ...).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from e2e.cluster import ClusterInfo, ControlPlane, ensure_control_plane_binaries
from e2e.security import suite

OUTPUT = Path("_output/security.json")
RUNNING = Path("_output/cluster/state.json")


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.security", description=__doc__)
    parser.add_argument("--output", type=Path, default=OUTPUT)
    parser.add_argument(
        "--running",
        action="store_true",
        help=f"attack the control plane `make cluster-up` started ({RUNNING}) instead of a new one",
    )
    args = parser.parse_args()
    if args.running:
        report = suite.run(ClusterInfo.from_json(RUNNING.read_text()))
    else:
        binaries = ensure_control_plane_binaries()
        with (
            tempfile.TemporaryDirectory(prefix="dra-security-") as scratch,
            ControlPlane(binaries, Path(scratch) / "cluster", die_with_parent=True) as control_plane,
        ):
            report = suite.run(control_plane.info)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(suite.dumps(report))
    print(f"attack suite, Kubernetes {report['kubernetes']} ({report['duration_s']} s)")
    print(suite.table(report))
    print(f"\nwritten: {args.output}")
    return 1 if report["missed_goals"] else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
