"""`python -m e2e.cluster up|down|status`: the local control plane from a shell (make cluster-up).

`up` starts the components in the background, writes the admin kubeconfig to <output>/kubeconfig and
what `down` needs to <output>/cluster/state.json, then returns; `down` stops every recorded process.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

from e2e.cluster import processes
from e2e.cluster.binaries import REPO_ROOT, BuildError, ensure_control_plane_binaries
from e2e.cluster.controlplane import ClusterInfo, ControlPlane, StartupError, stop_processes


class _Layout:
    def __init__(self, output: Path) -> None:
        self.base = output / "cluster"
        self.state = self.base / "state.json"
        self.kubeconfig = output / "kubeconfig"

    def recorded(self) -> ClusterInfo | None:
        return ClusterInfo.from_json(self.state.read_text()) if self.state.exists() else None


def up(layout: _Layout) -> int:
    recorded = layout.recorded()
    if recorded is not None:
        if all(processes.is_running(p) for p in recorded.processes):
            print(
                f"already running at {recorded.server} (kubeconfig {layout.kubeconfig}); "
                "run `make cluster-down` first to start afresh"
            )
            return 0
        print("a previous cluster is partly gone; stopping what is left of it", file=sys.stderr)
        stop_processes(recorded.processes)
    shutil.rmtree(layout.base, ignore_errors=True)
    try:
        binaries = ensure_control_plane_binaries()
    except BuildError as error:
        print(f"cluster up: {error}", file=sys.stderr)
        return 1
    started = time.monotonic()
    control_plane = ControlPlane(binaries, layout.base, kubeconfig=layout.kubeconfig, die_with_parent=False)
    try:
        info = control_plane.start()
    except StartupError as error:
        print(f"cluster up: {error}", file=sys.stderr)
        return 1
    layout.state.write_text(info.to_json())
    elapsed = time.monotonic() - started
    print(
        f"Kubernetes {info.kube_version} control plane ready in {elapsed:.1f}s at {info.server}\n"
        f"  export KUBECONFIG={info.kubeconfig}\n"
        f"  kubectl: {binaries.kubectl}\n"
        f"  logs:    {layout.base / 'logs'}\n"
        f"stop it with `make cluster-down`"
    )
    return 0


def down(layout: _Layout) -> int:
    recorded = layout.recorded()
    if recorded is None:
        print(f"no cluster recorded in {layout.state}; nothing to stop")
        return 0
    stop_processes(recorded.processes)
    layout.kubeconfig.unlink(missing_ok=True)
    shutil.rmtree(layout.base, ignore_errors=True)
    print(f"stopped {', '.join(p.name for p in recorded.processes)}")
    return 0


def status(layout: _Layout) -> int:
    recorded = layout.recorded()
    if recorded is None:
        print("no cluster is running")
        return 1
    print(f"Kubernetes {recorded.kube_version} at {recorded.server} (kubeconfig {recorded.kubeconfig})")
    running = [processes.is_running(p) for p in recorded.processes]
    for record, alive in zip(recorded.processes, running, strict=True):
        state = "running" if alive else "GONE"
        print(f"  {record.name:<24} pid {record.pid:<8} {state:<8} log {record.log}")
    return 0 if all(running) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.cluster", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=("up", "down", "status"))
    parser.add_argument(
        "--output-dir",
        type=Path,
        default=REPO_ROOT / "_output",
        help="where the kubeconfig, the state file and the component logs go (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    commands = {"up": up, "down": down, "status": status}
    return commands[args.command](_Layout(args.output_dir.resolve()))


if __name__ == "__main__":
    sys.exit(main())
