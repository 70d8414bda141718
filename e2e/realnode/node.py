"""A real Kubernetes node on this machine: a kubelet, containerd and runc, registered with the local
control plane (e2e/cluster, started with real_nodes=True) as the Node `127.0.0.1`.

Everything runs inside one private mount namespace owned by holder.py, so nothing the kubelet,
containerd or the CNI plugins mount or write under /var/lib, /var/log and /run reaches the host;
the only host state is the node's cgroup subtree (cgroups are not namespaced), which stop()
removes. stop() also runs from another process (`make cluster-down`), from what state() records.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client

from e2e.cluster import credentials, features, processes
from e2e.cluster.binaries import REPO_ROOT, build_outputs
from e2e.cluster.controlplane import ClusterInfo, free_ports
from e2e.cluster.processes import ProcessRecord
from e2e.realnode import config
from e2e.realnode.config import NodeLayout
from e2e.realnode.driver_root import make_driver_root, vfio_device_nodes
from e2e.realnode.holder import cgroup_pids
from e2e.realnode.images import IMAGES, ImageArchive, image_archives

# The kubelet and containerd need these v1 controllers; the kubelet fails later and less clearly
# without them.
REQUIRED_CGROUP_CONTROLLERS = ("cpu", "cpuacct", "cpuset", "memory", "pids", "devices", "freezer")
NODE_LABELS: Mapping[str, str] = {"nvidia.com/gpu.present": "true"}
DEFAULT_PROFILE = "dgx-h100"
_STOP_GRACE_SECONDS = 60.0
NEEDS_ROOT = "a real node needs root (mount namespaces, cgroups, mknod, containers); run as root"


class RealNodeError(RuntimeError):
    """The node cannot start here; the message says why in one line (and where the log is)."""


@dataclass(frozen=True)
class RealNodeBinaries:
    kubelet: Path
    containerd_dir: Path  # containerd, containerd-shim-runc-v2, ctr
    runc: Path
    cni_loopback_dir: Path

    @property
    def ctr(self) -> Path:
        return self.containerd_dir / "ctr"


def _which(name: str, *extra: str) -> Path | None:
    found = shutil.which(name, path=os.pathsep.join([os.environ.get("PATH", ""), *extra]))
    return Path(found) if found else None


def ensure_real_node_binaries() -> RealNodeBinaries:
    """The kubelet and containerd (built when missing) and Debian's runc and CNI plugins."""
    check = subprocess.run([str(REPO_ROOT / "hack" / "install-deps.sh")], capture_output=True, text=True)
    if check.returncode != 0:
        raise RealNodeError(
            check.stderr.strip().splitlines()[-1] if check.stderr.strip() else "hack/install-deps.sh failed"
        )
    outputs = build_outputs("kubelet", "containerd")
    runc = _which("runc", "/usr/sbin", "/usr/bin")
    if runc is None:
        raise RealNodeError("runc is not installed; run hack/install-deps.sh (as root)")
    loopback = Path("/usr/lib/cni/loopback")
    if not loopback.exists():
        raise RealNodeError(f"the CNI loopback plugin is not at {loopback}; run hack/install-deps.sh")
    return RealNodeBinaries(
        kubelet=Path(outputs["KUBE_BIN_DIR"]) / "kubelet",
        containerd_dir=Path(outputs["CONTAINERD_BIN_DIR"]),
        runc=runc,
        cni_loopback_dir=loopback.parent,
    )


def preflight(
    base: Path, *, filesystems: Path = Path("/proc/filesystems"), cgroups: Path = Path("/sys/fs/cgroup")
) -> None:
    """One clear line for each thing that would make the node fail later and obscurely."""
    if os.geteuid() != 0:
        raise RealNodeError(NEEDS_ROOT)
    if "overlay" not in filesystems.read_text().split():
        raise RealNodeError(f"the kernel has no overlayfs (not in {filesystems}); containerd needs it")
    missing = [c for c in REQUIRED_CGROUP_CONTROLLERS if not (cgroups / c / "cgroup.procs").exists()]
    if missing:
        raise RealNodeError(
            f"cgroup v1 controllers not mounted under {cgroups}: {', '.join(missing)} "
            "(this real node supports cgroup v1 hierarchies only)"
        )
    for tool in ("unshare", "mount", "ip"):
        if _which(tool, "/usr/sbin", "/sbin") is None:
            raise RealNodeError(f"'{tool}' is not installed (util-linux, iproute2); run hack/install-deps.sh")
    if base.exists() and any(base.iterdir()):
        raise RealNodeError(
            f"the node directory {base} is in use (not empty); stop that node or pick another"
        )


@dataclass(frozen=True)
class RealNodeState:
    """What stop() needs, also in a later process: recorded by `cluster up` in its state file."""

    holder: ProcessRecord
    api_proxy: ProcessRecord
    mount_namespace: str  # e.g. mnt:[4026532401], to find stragglers if the holder was killed
    cgroup_root: str
    base: Path

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["holder"]["log"] = str(self.holder.log)
        data["api_proxy"]["log"] = str(self.api_proxy.log)
        data["base"] = str(self.base)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RealNodeState:
        holder, proxy = dict(data["holder"]), dict(data["api_proxy"])
        return cls(
            holder=ProcessRecord(holder["name"], holder["pid"], holder["start_time"], Path(holder["log"])),
            api_proxy=ProcessRecord(proxy["name"], proxy["pid"], proxy["start_time"], Path(proxy["log"])),
            mount_namespace=data["mount_namespace"],
            cgroup_root=data["cgroup_root"],
            base=Path(data["base"]),
        )


class RealNode:
    """One kubelet + containerd node. start() returns once the Node is Ready; stop() is idempotent."""

    def __init__(
        self,
        cluster: ClusterInfo,
        binaries: RealNodeBinaries,
        base: Path,
        *,
        images: Mapping[str, ImageArchive] | None = None,
        profile: str = DEFAULT_PROFILE,
        die_with_parent: bool = True,
        kubelet_port: int | None = None,
    ) -> None:
        self._kubelet_port = kubelet_port
        if cluster.node_token is None or cluster.kubelet_client_ca_file is None:
            raise RealNodeError(
                "the control plane was not started for real nodes (ControlPlane(real_nodes=True))"
            )
        self.cluster = cluster
        self.binaries = binaries
        self.base = base
        self.profile = profile
        self.images = dict(images) if images is not None else image_archives()
        self._die_with_parent = die_with_parent
        self._holder: subprocess.Popen[bytes] | None = None
        self._proxy: subprocess.Popen[bytes] | None = None
        self._proxy_record: ProcessRecord | None = None
        self.state: RealNodeState | None = None
        self.layout: NodeLayout | None = None

    # --- start ---------------------------------------------------------------------------------

    def start(self, timeout_seconds: float = 180.0) -> NodeLayout:
        preflight(self.base)
        for archive in self.images.values():
            archive.check()
        try:
            return self._start(time.monotonic() + timeout_seconds)
        except BaseException:
            self.stop()
            raise

    def _start(self, deadline: float) -> NodeLayout:
        kubelet_port, healthz_port = free_ports(2)
        kubelet_port = self._kubelet_port or kubelet_port
        service_ip, service_port = _kubernetes_service(self.cluster)
        settable = features.settable_gates(self.binaries.kubelet)
        layout = NodeLayout(
            base=self.base,
            cgroup_root=f"/dra-real-node-{uuid.uuid4().hex[:8]}",
            kubelet_port=kubelet_port,
            kubelet_healthz_port=healthz_port,
            runc=self.binaries.runc,
            cni_plugin_dirs=(self.base / "cni-bin", self.binaries.cni_loopback_dir),
            sandbox_image=self.images["pause"].reference,
            feature_gates={gate: True for gate in features.WANTED_GATES if gate in settable},
            service_ip=service_ip,
            service_port=service_port,
        )
        self.layout = layout
        for directory in (layout.logs, layout.etc / "cni", layout.scratch, self.base / "cni-bin"):
            directory.mkdir(parents=True, exist_ok=True)
        _make_cgroup_root(layout.cgroup_root)
        make_driver_root(layout.driver_root, self.profile)
        spec = self._write_files(layout)
        # The API proxy lives in the host's network namespace, the one way in and out of the node's.
        proxy_argv = [sys.executable, "-m", "e2e.realnode.api_proxy", str(layout.api_proxy_socket)]
        self._proxy, proxy_record = processes.spawn(
            "api-proxy",
            # With the control plane's egress socket: also the API server's way to the pods.
            [*proxy_argv, str(self.cluster.ports.apiserver), *_egress_socket(self.cluster)],
            layout.logs / "api-proxy.log",
            die_with_parent=self._die_with_parent,
        )
        self._proxy_record = proxy_record
        proxy_deadline = time.monotonic() + 20
        while not layout.api_proxy_socket.exists():
            if self._proxy.poll() is not None or time.monotonic() > proxy_deadline:
                raise RealNodeError(f"the node's API proxy did not start (log: {proxy_record.log})")
            time.sleep(0.05)
        holder = [sys.executable, "-m", "e2e.realnode.holder", str(spec)]
        argv = ["unshare", "--mount", "--net", "--propagation", "private", "--", *holder]
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
        with (layout.logs / "holder.log").open("ab") as log:
            self._holder = subprocess.Popen(
                argv,
                cwd=REPO_ROOT,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=processes._die_with_parent() if self._die_with_parent else None,
            )
        start_time = processes.process_start_time(self._holder.pid)
        assert start_time is not None
        record = ProcessRecord("real-node", self._holder.pid, start_time, layout.logs / "holder.log")
        namespace = _wait_for_namespace(self._holder.pid)
        self.state = RealNodeState(record, proxy_record, namespace, layout.cgroup_root, self.base)
        ready = self.base / "ready"
        while not ready.exists():
            if self._holder.poll() is not None:
                raise RealNodeError(f"the real node stopped while starting:\n{self.failure_summary()}")
            if time.monotonic() > deadline:
                raise RealNodeError(f"the real node did not start in time:\n{self.failure_summary()}")
            time.sleep(0.2)
        self._wait_node_ready(deadline)
        return layout

    def _write_files(self, layout: NodeLayout) -> Path:
        etc = layout.etc
        containerd_toml = etc / "containerd.toml"
        containerd_toml.write_text(config.containerd_config(layout))
        (etc / "cni" / "10-dra-node.conflist").write_text(config.cni_config_json(layout))
        plugin = self.base / "cni-bin" / config.CNI_PLUGIN
        plugin.write_text(
            f'#!/bin/sh\nexec {sys.executable} {Path(__file__).with_name("cni_plugin.py")} "$@"\n'
        )
        plugin.chmod(0o755)
        kubelet_yaml = etc / "kubelet.yaml"
        kubelet_yaml.write_text(
            yaml.safe_dump(config.kubelet_config(layout, self.cluster.kubelet_client_ca_file or Path()))
        )
        kubeconfig = etc / "kubelet.kubeconfig"
        credentials.write_kubeconfig(
            kubeconfig,
            server=self.cluster.server,
            ca_certificate=self.cluster.ca_file.read_bytes(),
            user=f"system:node:{config.NODE_NAME}",
            token=self.cluster.node_token or "",
        )
        sysctls = etc / "sysctl"
        sysctls.mkdir(exist_ok=True)
        file_binds = []
        for name, value in config.KUBELET_SYSCTLS.items():
            path = sysctls / name.replace("/", ".")
            path.write_text(value + "\n")
            file_binds.append((f"/proc/sys/{name}", str(path)))
        binds = [(top, str(layout.host_path(top))) for top in ("/var/lib", "/var/log", "/run")]
        ctr = [str(self.binaries.ctr), "--address", config.CONTAINERD_SOCKET, "--namespace", "k8s.io"]
        steps: list[dict[str, Any]] = [
            {
                "kind": "daemon",
                "name": "containerd",
                "argv": [str(self.binaries.containerd_dir / "containerd"), "--config", str(containerd_toml)],
                # The shim is found on PATH.
                "env": {"PATH": f"{self.binaries.containerd_dir}:{_path()}"},
                "wait_for_path": config.CONTAINERD_SOCKET,  # the holder looks inside the namespace
            },
        ]
        for archive in self.images.values():
            steps.append(
                {"kind": "command", "name": f"import {archive.name}", "argv": [*ctr, *archive.import_args()]}
            )
        steps.append(
            {
                "kind": "daemon",
                "name": "kubelet",
                "argv": [
                    str(self.binaries.kubelet),
                    *config.kubelet_args(layout, kubelet_yaml, kubeconfig, NODE_LABELS),
                ],
                "env": {"PATH": _path()},
            }
        )
        dev_layer = self.base / "dev-layer"  # the mount point of /dev's upper layer (holder.py)
        dev_layer.mkdir(exist_ok=True)
        spec = {
            "binds": binds,
            "file_binds": file_binds,
            "device_nodes": vfio_device_nodes(self.profile),
            "dev_layer": str(dev_layer),
            "logs": str(layout.logs),
            "ready_file": str(self.base / "ready"),
            "cgroup_root": layout.cgroup_root,
            "api_proxy_socket": str(layout.api_proxy_socket),
            "apiserver_port": self.cluster.ports.apiserver,
            "kubelet_port": layout.kubelet_port,
            "steps": steps,
        }
        path = etc / "holder.json"
        path.write_text(json.dumps(spec, indent=2))
        return path

    def _wait_node_ready(self, deadline: float) -> None:
        with self.cluster.api_client() as api:
            core = client.CoreV1Api(api)
            while True:
                if self._holder is not None and self._holder.poll() is not None:
                    raise RealNodeError(f"the real node stopped while registering:\n{self.failure_summary()}")
                try:
                    node = core.read_node(config.NODE_NAME)
                    conditions = {c.type: c.status for c in (node.status.conditions or [])}
                    if conditions.get("Ready") == "True":
                        return
                except client.ApiException as err:
                    if err.status != 404:
                        raise
                if time.monotonic() > deadline:
                    raise RealNodeError(
                        f"the kubelet's Node did not become Ready in time:\n{self.failure_summary()}"
                    )
                time.sleep(0.5)

    def failure_summary(self) -> str:
        logs = self.base / "logs"
        parts = []
        for name in ("holder", "containerd", "kubelet"):
            log = logs / f"{name}.log"
            if log.exists():
                lines = log.read_text(errors="replace").splitlines()
                interesting = [line for line in lines if " E" in line[:6] or "error" in line.lower()][
                    -5:
                ] or lines[-5:]
                parts.append(
                    f"  {name} ({log}):\n" + "\n".join(f"    | {line[:300]}" for line in interesting)
                )
        return "\n".join(parts)

    # --- use -----------------------------------------------------------------------------------

    def ctr(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """`ctr` in the node's namespace and containerd's k8s.io namespace."""
        if self.state is None:
            raise RuntimeError("the node is not running")
        argv = [
            "nsenter",
            f"--target={self.state.holder.pid}",
            "--mount",
            "--",
            str(self.binaries.ctr),
            "--address",
            config.CONTAINERD_SOCKET,
            "--namespace",
            "k8s.io",
            *args,
        ]
        return subprocess.run(argv, capture_output=True, text=True, check=check)

    # --- stop ----------------------------------------------------------------------------------

    def stop(self) -> None:
        state, self.state = self.state, None
        holder, self._holder = self._holder, None
        proxy, self._proxy = self._proxy, None
        if state is not None:
            stop_node(state)
        else:
            if holder is not None:
                holder.kill()
            if self._proxy_record is not None:
                processes.stop(self._proxy_record, grace_seconds=5)
            if self.layout is not None:
                _remove_cgroup_root(self.layout.cgroup_root)
        for child in (holder, proxy):
            if child is not None:
                child.wait()


def stop_node(state: RealNodeState) -> None:
    """Stops a node started by this or another process; leaves no process, mount or cgroup."""
    processes.stop(state.holder, grace_seconds=_STOP_GRACE_SECONDS)
    # The holder kills all it knows; a holder that was itself killed leaves shims and containers.
    for _ in range(50):
        stragglers = _processes_in_namespace(state.mount_namespace) | cgroup_pids(state.cgroup_root)
        stragglers.discard(os.getpid())
        if not stragglers:
            break
        for pid in stragglers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)
    processes.stop(state.api_proxy, grace_seconds=5)
    _remove_cgroup_root(state.cgroup_root)
    # No mount is left (the namespace went with its last process): the scratch tree is plain files.
    shutil.rmtree(state.base / "root", ignore_errors=True)
    (state.base / "ready").unlink(missing_ok=True)


def _path() -> str:
    return f"{os.environ.get('PATH', '/usr/bin:/bin')}:/usr/sbin:/sbin"


def _egress_socket(cluster: ClusterInfo) -> list[str]:
    return [str(cluster.cluster_egress_socket)] if cluster.cluster_egress_socket else []


def _kubernetes_service(cluster: ClusterInfo) -> tuple[str, int]:
    with cluster.api_client() as api:
        deadline = time.monotonic() + 30
        while True:
            try:
                service = client.CoreV1Api(api).read_namespaced_service("kubernetes", "default")
                return service.spec.cluster_ip, service.spec.ports[0].port
            except client.ApiException as err:
                if err.status != 404 or time.monotonic() > deadline:
                    raise
            time.sleep(0.2)


def _wait_for_namespace(pid: int) -> str:
    """The holder's mount namespace, once unshare has made it (it differs from ours)."""
    ours = os.readlink("/proc/self/ns/mnt")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            theirs = os.readlink(f"/proc/{pid}/ns/mnt")
        except OSError as err:
            raise RealNodeError(f"the real node's holder exited at once ({err})") from None
        if theirs != ours:
            return theirs
        time.sleep(0.02)
    raise RealNodeError("unshare made no mount namespace in time")


def _processes_in_namespace(namespace: str) -> set[int]:
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.readlink(entry / "ns" / "mnt") == namespace:
                    found.add(int(entry.name))
            except OSError:
                continue
    return found


def _hierarchies() -> list[Path]:
    return [h for h in Path("/sys/fs/cgroup").iterdir() if (h / "cgroup.procs").exists()]


def _make_cgroup_root(cgroup_root: str) -> None:
    for hierarchy in _hierarchies():
        (hierarchy / cgroup_root.lstrip("/")).mkdir(exist_ok=True)


def _remove_cgroup_root(cgroup_root: str) -> None:
    """rmdir of the node's cgroups, deepest first, in every hierarchy (they are empty by now)."""
    for hierarchy in _hierarchies():
        top = hierarchy / cgroup_root.lstrip("/")
        if not top.exists():
            continue
        for directory in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
            _rmdir(directory)
        _rmdir(top)


def _rmdir(directory: Path) -> None:
    for _ in range(20):
        try:
            directory.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.1)  # the last task of a cgroup leaves it a moment after it dies
    raise RealNodeError(f"cgroup {directory} could not be removed (processes still in it?)")


__all__ = [
    "IMAGES",
    "RealNode",
    "RealNodeBinaries",
    "RealNodeError",
    "RealNodeState",
    "ensure_real_node_binaries",
    "preflight",
    "stop_node",
]
