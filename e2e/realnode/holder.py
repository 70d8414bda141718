"""The process that owns a real node's private mount and network namespaces and all that runs there.

Run as `unshare --mount --net --propagation private -- python -m e2e.realnode.holder SPEC.json`. It

1. brings the node's own `lo` up and hands the node's API proxy (api_proxy.py, in the host's
   namespace) a socket listening on the API server's address in the node's namespace, and the
   namespace itself, so that the kubelet reaches the API server and the API server the kubelet
   (logs, exec) over loopback, while pods get addresses on a bridge inside this namespace;
2. binds the node's scratch directories over /var/lib, /var/log and /run -- containerd, the CNI
   plugins and the kubelet write to fixed paths there whatever their flags say -- and files holding
   the values the kubelet wants over three /proc/sys files, so its protectKernelDefaults check
   passes without any host setting being written; and gives /dev the device nodes of a GPU host
   that this machine lacks (the VFIO nodes of passed-through GPUs) on an overlay of its own;
3. becomes a child subreaper, so the shims containerd double-forks stay its children and are
   reaped (this machine's PID 1 reaps nobody);
4. starts the programs of SPEC in order (containerd, image imports, the kubelet), each waiting for
   what it needs, and writes SPEC's ready file;
5. on SIGTERM or SIGINT stops the kubelet, then containerd, then kills every process left in the
   node's cgroups and every child left over, reaps them all and exits.

Every mount it or its children make lives in this namespace only and disappears with its last
process; the cgroups, which are not namespaced, the launcher removes after it exits (node.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

_PR_SET_CHILD_SUBREAPER = 36
_PR_SET_PDEATHSIG = 1


def _mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True, capture_output=True, text=True)


def _private_mounts(spec: dict[str, Any]) -> None:
    _mount("--make-rprivate", "/")
    for inside, outside in spec["binds"]:
        Path(outside).mkdir(parents=True, exist_ok=True)
        _mount("--bind", outside, inside)
    for inside, outside in spec["file_binds"]:
        _mount("--bind", outside, inside)
    _private_dev(spec.get("device_nodes", []), Path(spec.get("dev_layer", "")))
    # Shared again, but among this namespace's mounts only: every peer group is new, so nothing
    # propagates to the host, while the kubelet's HostToContainer and Bidirectional volumes (the
    # chart's driver root) get the shared mounts they require.
    _mount("--make-rshared", "/")


def _private_dev(nodes: list[tuple[str, int, int, int]], layer: Path) -> None:
    """The host's /dev with ``nodes`` (path, major, minor, mode) added, for this namespace alone.

    A GPU host has device nodes this machine lacks: ``/dev/vfio/<group>`` of a GPU on vfio-pci and
    ``/dev/vfio/vfio`` (no IOMMU here, and no module may be loaded), which a container runtime
    reads when a CDI spec names a node by its path alone. They cannot be made in the host's /dev,
    which every process shares; so /dev here is an overlay whose lower layer is the host's /dev
    and whose upper layer, a tmpfs mounted at ``layer`` in this namespace, holds the new nodes.
    The host's /dev never changes, and the overlay goes with the namespace. The mounts below the
    host's /dev (pts, shm, ...) are not part of its lower layer, so they are bound back on top.
    """
    if not nodes:
        return
    _mount("-t", "tmpfs", "-o", "mode=0700", "dev-layer", str(layer))
    host, upper, work = layer / "host", layer / "upper", layer / "work"
    for directory in (host, upper, work):
        directory.mkdir()
    submounts = _mounts_below(Path("/dev"))
    _mount("--rbind", "/dev", str(host))
    _mount("-t", "overlay", "-o", f"lowerdir={host},upperdir={upper},workdir={work}", "dev-overlay", "/dev")
    for submount in submounts:
        _mount("--rbind", str(host / submount.relative_to("/dev")), str(submount))
    for path, major, minor, mode in nodes:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        os.mknod(path, mode | stat.S_IFCHR, os.makedev(major, minor))


def _mounts_below(top: Path) -> list[Path]:
    """The outermost mount points strictly below ``top`` (their own submounts come with an rbind)."""
    points = sorted(Path(line.split()[4]) for line in Path("/proc/self/mountinfo").read_text().splitlines())
    below = [p for p in points if top in p.parents]
    return sorted({p for p in below if not any(q in p.parents for q in below)})


def _connect_api_proxy(spec: dict[str, Any]) -> None:
    """lo up; then the API listener and this network namespace, to the proxy (see api_proxy.py)."""
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True, capture_output=True, text=True)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", spec["apiserver_port"]))
    listener.listen(128)
    netns = os.open("/proc/self/ns/net", os.O_RDONLY)
    message = {"op": "node", "id": "node", "kubeletPort": spec["kubelet_port"]}
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as control:
            control.settimeout(10)
            control.connect(spec["api_proxy_socket"])
            socket.send_fds(control, [json.dumps(message).encode()], [listener.fileno(), netns])
            control.shutdown(socket.SHUT_WR)
            answer = control.recv(4096).decode().strip()
    finally:
        listener.close()
        os.close(netns)
    if answer != "ok":
        raise OSError(f"the API proxy refused the node: {answer}")


def _children_of(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(entry.name))
    return found


def cgroup_pids(cgroup_root: str) -> set[int]:
    """Every process in any cgroup at or below `cgroup_root`, in every v1 hierarchy."""
    pids: set[int] = set()
    for hierarchy in Path("/sys/fs/cgroup").iterdir():
        top = hierarchy / cgroup_root.lstrip("/")
        if not top.is_dir():
            continue
        for procs in top.rglob("cgroup.procs"):
            try:
                pids.update(int(line) for line in procs.read_text().split())
            except OSError:
                continue
    return pids


class Holder:
    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.running: dict[str, subprocess.Popen[bytes]] = {}
        self.stopping = False

    def log(self, message: str) -> None:
        print(f"holder: {message}", file=sys.stderr, flush=True)

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        log = Path(self.spec["logs"]) / f"{name}.log"
        with log.open("ab") as out:
            child = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
                preexec_fn=_die_with_parent,
            )
        self.running[name] = child
        self.log(f"started {name} (pid {child.pid})")
        return child

    def run(self) -> int:
        for step in self.spec["steps"]:
            if self.stopping:
                break
            kind = step["kind"]
            if kind == "daemon":
                child = self.start(step["name"], step["argv"], step.get("env"))
                wait_for = step.get("wait_for_path")
                if wait_for and not self._wait_for(Path(wait_for), child, step["name"]):
                    return self.shutdown(1)
            elif kind == "command":
                self.log(f"running {step['name']}: {' '.join(step['argv'])}")
                result = subprocess.run(step["argv"], capture_output=True, text=True, check=False)
                if result.returncode != 0:
                    self.log(f"{step['name']} failed (exit {result.returncode}): {result.stderr.strip()}")
                    return self.shutdown(1)
        Path(self.spec["ready_file"]).write_text("ready\n")
        while not self.stopping:
            self._reap()
            for name, child in self.running.items():
                if child.returncode is not None:
                    self.log(f"{name} exited with status {child.returncode}; stopping the node")
                    return self.shutdown(1)
            time.sleep(0.2)
        return self.shutdown(0)

    def _wait_for(self, path: Path, child: subprocess.Popen[bytes], name: str) -> bool:
        deadline = time.monotonic() + 60
        while not path.exists():
            if child.poll() is not None:
                self.log(f"{name} exited with status {child.returncode} before {path} appeared")
                return False
            if self.stopping or time.monotonic() > deadline:
                self.log(f"{name}: {path} did not appear in time")
                return False
            time.sleep(0.1)
        return True

    def _reap(self) -> None:
        # Our own Popen children are polled (keeps their returncode); orphans adopted as
        # subreaper are reaped here.
        for child in self.running.values():
            child.poll()
        own = {child.pid for child in self.running.values()}
        for pid in _children_of(os.getpid()):
            if pid in own:
                continue
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)

    def shutdown(self, status: int) -> int:
        self.stopping = True
        for name in ("kubelet", "containerd"):
            child = self.running.get(name)
            if child is None or child.poll() is not None:
                continue
            child.terminate()
            try:
                child.wait(timeout=15)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
            self.log(f"stopped {name}")
        # Containers (in the node's cgroups) and shims (adopted by us) are all that can be left.
        for _ in range(50):
            leftover = cgroup_pids(self.spec["cgroup_root"]) | set(_children_of(os.getpid()))
            leftover.discard(os.getpid())
            if not leftover:
                break
            for pid in leftover:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.1)
            self._reap()
        for child in self.running.values():
            if child.poll() is None:
                child.kill()
                child.wait()
        self.log("every process of the node is gone")
        return status


def _die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def main(argv: list[str]) -> int:
    spec: dict[str, Any] = json.loads(Path(argv[0]).read_text())
    try:
        _private_mounts(spec)
    except subprocess.CalledProcessError as err:
        print(f"holder: mount {' '.join(err.cmd[1:])} failed: {err.stderr.strip()}", file=sys.stderr)
        return 1
    try:
        _connect_api_proxy(spec)
    except (OSError, subprocess.CalledProcessError) as err:
        print(f"holder: cannot connect the node's network to the API proxy: {err}", file=sys.stderr)
        return 1
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1) != 0:
        print("holder: cannot become a child subreaper", file=sys.stderr)
        return 1
    holder = Holder(spec)

    def stop(signum: int, frame: object) -> None:
        holder.stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    return holder.run()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
