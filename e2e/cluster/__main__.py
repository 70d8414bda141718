"""`python -m e2e.cluster up|down|status`: the local control plane from a shell (make cluster-up).

`up` starts the components in the background, writes the admin kubeconfig to <output>/kubeconfig and
what `down` needs to <output>/cluster/state.json, then returns; `down` stops every recorded process.
`up --node real` also starts a real node (e2e/realnode: kubelet + containerd + runc, needs root) and
records it in <output>/cluster/real-node.json; `down` stops it first.
"""

from __future__ import annotations

import argparse
import json
import os
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
        self.real_node_state = self.base / "real-node.json"
        self.real_node_dir = output / "real-node"

    def recorded(self) -> ClusterInfo | None:
        return ClusterInfo.from_json(self.state.read_text()) if self.state.exists() else None


def up(layout: _Layout, node: str = "none") -> int:
    if node == "real" and os.geteuid() != 0:
        from e2e.realnode.node import NEEDS_ROOT

        print(f"cluster up: {NEEDS_ROOT}", file=sys.stderr)
        return 1
    recorded = layout.recorded()
    if recorded is not None:
        if all(processes.is_running(p) for p in recorded.processes):
            print(
                f"already running at {recorded.server} (kubeconfig {layout.kubeconfig}); "
                "run `make cluster-down` first to start afresh"
            )
            return 0
        print("a previous cluster is partly gone; stopping what is left of it", file=sys.stderr)
        _stop_real_node(layout)
        stop_processes(recorded.processes)
    shutil.rmtree(layout.base, ignore_errors=True)
    try:
        binaries = ensure_control_plane_binaries()
    except BuildError as error:
        print(f"cluster up: {error}", file=sys.stderr)
        return 1
    started = time.monotonic()
    real_node_binaries = None
    if node == "real":
        from e2e.realnode.node import RealNodeError, ensure_real_node_binaries, preflight

        try:
            shutil.rmtree(layout.real_node_dir, ignore_errors=True)
            preflight(layout.real_node_dir)
            real_node_binaries = ensure_real_node_binaries()
        except (RealNodeError, BuildError) as error:
            print(f"cluster up: {error}", file=sys.stderr)
            return 1
    control_plane = ControlPlane(
        binaries, layout.base, kubeconfig=layout.kubeconfig, die_with_parent=False, real_nodes=node == "real"
    )
    try:
        info = control_plane.start()
    except StartupError as error:
        print(f"cluster up: {error}", file=sys.stderr)
        return 1
    layout.state.write_text(info.to_json())
    node_line = ""
    if real_node_binaries is not None:
        from e2e.realnode.node import RealNode, RealNodeError

        real_node = RealNode(info, real_node_binaries, layout.real_node_dir, die_with_parent=False)
        try:
            real_node.start()  # stops what it started if it fails or is interrupted
        except (RealNodeError, KeyboardInterrupt) as error:
            print(f"cluster up: {error or 'interrupted'}", file=sys.stderr)
            stop_processes(info.processes)
            layout.state.unlink()
            layout.kubeconfig.unlink(missing_ok=True)
            return 1
        assert real_node.state is not None
        layout.real_node_state.write_text(json.dumps(real_node.state.to_dict(), indent=2))
        node_line = f"  node:    127.0.0.1 (kubelet + containerd; logs in {layout.real_node_dir / 'logs'})\n"
    elapsed = time.monotonic() - started
    print(
        f"Kubernetes {info.kube_version} control plane ready in {elapsed:.1f}s at {info.server}\n"
        f"  export KUBECONFIG={info.kubeconfig}\n"
        f"  kubectl: {binaries.kubectl}\n"
        f"  logs:    {layout.base / 'logs'}\n"
        f"{node_line}"
        f"stop it with `make cluster-down`"
    )
    return 0


def _stop_real_node(layout: _Layout) -> None:
    if not layout.real_node_state.exists():
        return
    from e2e.realnode.node import RealNodeState, stop_node

    stop_node(RealNodeState.from_dict(json.loads(layout.real_node_state.read_text())))
    layout.real_node_state.unlink()


def down(layout: _Layout) -> int:
    recorded = layout.recorded()
    if recorded is None:
        print(f"no cluster recorded in {layout.state}; nothing to stop")
        return 0
    _stop_real_node(layout)
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
        "--node",
        choices=("none", "real"),
        default="none",
        help="up: also start a real node (kubelet + containerd + runc; needs root and `make image`)",
    )
    parser.add_argument(
        "--output-dir",
        type=Path,
        default=REPO_ROOT / "_output",
        help="where the kubeconfig, the state file and the component logs go (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    layout = _Layout(args.output_dir.resolve())
    if args.command == "up":
        return up(layout, args.node)
    commands = {"down": down, "status": status}
    return commands[args.command](layout)


if __name__ == "__main__":
    sys.exit(main())
