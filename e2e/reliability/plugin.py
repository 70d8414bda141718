"""One node's driver daemon for the fault suite, with the kubelet's side of its sockets.

Unlike :class:`e2e.driver.DriverProcess` it can be SIGKILLed at any moment, started with a test
crash point armed (:mod:`dra_driver.crashpoint`), and run as a second instance beside the first
(``--pod-uid``, as in a rolling update). The kubelet's part is played by this process: it
registers the plugin as the plugin watcher does and calls NodePrepareResources /
NodeUnprepareResources itself, so that a run controls exactly when each call happens.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from bench.kubelet import register
from dra_driver.cdi.store import SpecStore
from dra_driver.crashpoint import ENV as CRASH_POINT_ENV
from dra_driver.devices.pci import NVIDIA, PciBus
from dra_driver.devices.types import ComputePolicy, MigDevice
from dra_driver.kubelet.pb.dra.v1 import dra_pb2, dra_pb2_grpc
from dra_driver.node.records import ClaimRecord, DeviceRecord
from dra_driver.node.store import STORE_FILE, open_read_only
from dra_driver.node.types import ClaimRef
from dra_driver.settings import DEFAULT_DRIVER_NAME
from dra_driver.simulated.gpus import SimulatedBackend
from e2e.cluster import processes
from e2e.cluster.controlplane import free_ports
from e2e.driver import DriverPaths

DRIVER = DEFAULT_DRIVER_NAME
PROFILE = "dgx-h100"
STORE_FILE_NAME = STORE_FILE  # the node's store (sqlite3), in the data directory
CALL_TIMEOUT_S = 45.0  # the kubelet's deadline for one prepare or unprepare call
START_TIMEOUT_S = 60.0


class PluginDied(Exception):
    """The daemon exited (or was killed) while the suite waited for it."""


@dataclass
class CallResult:
    """One NodePrepareResources / NodeUnprepareResources call: per claim uid, None or the error."""

    errors: dict[str, str | None] = field(default_factory=dict)
    transport_error: str | None = None  # the call itself failed (daemon gone, deadline)

    def ok(self, uid: str) -> bool:
        return self.transport_error is None and uid in self.errors and self.errors[uid] is None


class Plugin:
    """``dra-driver kubelet-plugin`` on a simulated DGX H100 with every path under ``paths``."""

    def __init__(
        self,
        *,
        kubeconfig: Path,
        node: str,
        paths: DriverPaths,
        log: Path,
        pod_uid: str = "",
        extra_args: Sequence[str] = (),
        profile: str = PROFILE,
    ) -> None:
        self.node = node
        self.profile = profile
        self.paths = paths
        self.log = log
        self.pod_uid = pod_uid
        self._kubeconfig = kubeconfig
        self._extra_args = tuple(extra_args)
        self._child: subprocess.Popen[bytes] | None = None
        self._record: processes.ProcessRecord | None = None
        self._channel: grpc.aio.Channel | None = None
        self._stub: dra_pb2_grpc.DRAPluginStub | None = None
        self.http_port = 0
        self.endpoint: Path | None = None  # the DRA socket, as the registration names it
        self.crash_point: str | None = None  # the one the running daemon was started with

    @property
    def registration_socket(self) -> Path:
        name = f"{DRIVER}-{self.pod_uid}-reg.sock" if self.pod_uid else f"{DRIVER}-reg.sock"
        return self.paths.registry / name

    @property
    def pid(self) -> int | None:
        return self._child.pid if self._child is not None else None

    @property
    def running(self) -> bool:
        return self._child is not None and self._child.poll() is None

    async def start(self, crash_point: str | None = None) -> None:
        """Spawn, register as the kubelet would, and wait for /readyz (slices published).

        Raises :class:`PluginDied` when the process exits first (a crash point reached at start-up).
        """
        await self.close_channel()
        self.paths.create()
        self.registration_socket.unlink(missing_ok=True)  # a SIGKILLed run leaves its socket behind
        (self.http_port,) = free_ports(1)
        env = dict(os.environ)
        env.pop(CRASH_POINT_ENV, None)
        if crash_point:
            env[CRASH_POINT_ENV] = crash_point
        self.crash_point = crash_point
        self._child, self._record = processes.spawn(
            "dra-driver", self._argv(), self.log, env=env, die_with_parent=True
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        await self._until(self.registration_socket.exists, deadline)
        try:
            self.endpoint = await register(self.registration_socket, DRIVER)
        except grpc.aio.AioRpcError:
            self._check_alive(deadline)  # the daemon registers early: a crash point may end it here
            raise
        self._channel = grpc.aio.insecure_channel(f"unix:{self.endpoint}")
        self._stub = dra_pb2_grpc.DRAPluginStub(self._channel)
        await self._until_ready(deadline)

    def kill(self) -> None:
        """SIGKILL, as a node's OOM killer or `kill -9` would; returns once it is gone."""
        if self._child is not None and self._child.poll() is None:
            os.kill(self._child.pid, signal.SIGKILL)
        self.reap()

    def reap(self) -> int | None:
        """Wait for a daemon that is exiting by itself (a crash point); its status."""
        status = self._child.wait() if self._child is not None else None
        self._child = self._record = None
        return status

    async def stop(self) -> None:
        """SIGTERM (a clean shutdown)."""
        await self.close_channel()
        if self._record is not None and self._child is not None:
            await asyncio.to_thread(processes.stop, self._record, grace_seconds=20.0)
            self._child.wait()
        self._child = self._record = None

    async def close_channel(self) -> None:
        if self._channel is not None:
            await self._channel.close(grace=None)
        self._channel = self._stub = None

    async def prepare(self, claims: Sequence[ClaimRef], deadline: float = CALL_TIMEOUT_S) -> CallResult:
        request = dra_pb2.NodePrepareResourcesRequest(claims=[_claim(ref) for ref in claims])
        return await self._call("NodePrepareResources", request, deadline)

    async def unprepare(self, claims: Sequence[ClaimRef], deadline: float = CALL_TIMEOUT_S) -> CallResult:
        request = dra_pb2.NodeUnprepareResourcesRequest(claims=[_claim(ref) for ref in claims])
        return await self._call("NodeUnprepareResources", request, deadline)

    async def raw_call(self, method: str, request: object, deadline: float = CALL_TIMEOUT_S) -> object:
        """Any request message, answered or raising grpc.aio.AioRpcError (for the fuzzer)."""
        if self._stub is None:
            raise PluginDied("the plugin is not started")
        return await getattr(self._stub, method)(request, timeout=deadline)

    async def _call(self, method: str, request: object, deadline: float) -> CallResult:
        try:
            response = await self.raw_call(method, request, deadline)
        except grpc.aio.AioRpcError as error:
            return CallResult(transport_error=f"{error.code().name}: {error.details()}")
        except PluginDied as error:
            return CallResult(transport_error=str(error))
        answers = response.claims  # type: ignore[attr-defined]
        return CallResult(errors={uid: (answer.error or None) for uid, answer in answers.items()})

    def tail(self, lines: int = 30) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:]) + f"\n(full log: {self.log})"

    async def _until(self, condition: object, deadline: float) -> None:
        while not condition():  # type: ignore[operator]
            self._check_alive(deadline)
            await asyncio.sleep(0.01)

    def _check_alive(self, deadline: float) -> None:
        """Raise when the daemon exited (PluginDied) or the start took too long."""
        if not self.running:
            status = self.reap()
            raise PluginDied(f"the daemon exited with status {status} while starting")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the daemon did not start within {START_TIMEOUT_S:.0f} s:\n{self.tail()}")

    async def _until_ready(self, deadline: float) -> None:
        import urllib.request

        def ready() -> bool:
            try:
                url = f"http://127.0.0.1:{self.http_port}/readyz"
                with urllib.request.urlopen(url, timeout=2) as response:
                    return bool(response.status == 200)
            except OSError:
                return False

        # The sockets open before the state is ready, so a crash point can end the daemon here.
        while not await asyncio.to_thread(ready):
            self._check_alive(deadline)
            await asyncio.sleep(0.02)

    def _argv(self) -> list[str]:
        paths = self.paths
        pod_uid = [f"--pod-uid={self.pod_uid}"] if self.pod_uid else []
        return [
            sys.executable, "-m", "dra_driver", "kubelet-plugin",
            f"--node-name={self.node}",
            f"--simulate={self.profile}",
            "--mig-partitions=all",
            f"--kubeconfig={self._kubeconfig}",
            f"--plugins-dir={paths.plugins}",
            f"--registry-dir={paths.registry}",
            f"--cdi-dir={paths.cdi}",
            f"--data-dir={paths.data}",
            f"--driver-root={paths.driver_root}",
            f"--boot-id-file={paths.boot_id_file}",
            f"--http-address=127.0.0.1:{self.http_port}",
            "--log-format=console",
            *pod_uid,
            *self._extra_args,
        ]  # fmt: skip


def _claim(ref: ClaimRef) -> dra_pb2.Claim:
    return dra_pb2.Claim(namespace=ref.namespace, name=ref.name, uid=ref.uid)


def read_records(path: Path) -> dict[str, ClaimRecord]:
    """The claims the node's store holds, read-only (the daemon may be running): none without a store."""
    if not path.exists():
        return {}
    store = open_read_only(path)
    try:
        return store.snapshot().claims
    finally:
        store.close()


MPS_DIR = "mps"  # the simulated node's MPS daemons (stand-in processes), under the data directory
SYSFS_DIR = "sysfs"  # the simulated GPUs' sysfs tree (driver bindings), under the data directory
_SLICES = 8  # memory slices of an H100: a full GPU occupies all of them


@dataclass(frozen=True)
class NodeState:
    """What is on the node's disk and GPUs, read from outside the daemon."""

    specs: frozenset[str]  # claim uids with a CDI spec
    records: dict[str, ClaimRecord]  # the store's claims
    mig_devices: tuple[MigDevice, ...]  # alive on the simulated GPUs
    temp_files: tuple[str, ...]  # the driver's leftover .tmp files in the data and CDI directories
    mps_daemons: frozenset[str] = frozenset()  # MPS control daemons running or left (their ids)
    mps_pids: tuple[int, ...] = ()  # the processes of those that run, with a directory or without
    changed_gpus: tuple[str, ...] = ()  # GPUs (device names) not at the default compute mode and time slice
    # GPUs (PCI addresses) that the sysfs tree shows bound elsewhere than nvidia: their driver, or None
    off_nvidia: dict[str, str | None] = field(default_factory=dict)

    @classmethod
    def read(cls, paths: DriverPaths, node: str) -> NodeState:
        specs = frozenset(SpecStore(paths.cdi, DRIVER).claim_uids())
        records = read_records(paths.data / STORE_FILE)
        backend = SimulatedBackend(PROFILE, node, paths.data)
        try:
            gpus = backend.inventory().gpus
            migs = tuple(m for gpu in gpus for m in gpu.mig_devices)
            changed = tuple(
                f"gpu-{gpu.index}" for gpu in gpus if backend.compute_policy(gpu.uuid) != ComputePolicy()
            )
        finally:
            backend.close()
        mps = paths.data / MPS_DIR  # a daemon's directory lives as long as its process
        directories = {entry.name for entry in mps.iterdir() if entry.is_dir()} if mps.exists() else set()
        processes = mps_processes(mps)
        bus = PciBus(sysfs_root(paths))  # read only: the tree's links, as the kernel keeps them
        drivers = {address: bus.driver(address) for address in bus.nvidia_gpus()}
        # The driver's own temporary files are hidden (the CDI specs'); the
        # simulator's state file stands in for hardware and is not counted.
        temps = tuple(
            str(p)
            for d in (paths.data, paths.cdi)
            if d.exists()
            for p in d.iterdir()
            if p.name.startswith(".") and p.name.endswith(".tmp")
        )
        return cls(
            specs=specs,
            records=dict(records),
            mig_devices=migs,
            temp_files=temps,
            mps_daemons=frozenset(directories | set(processes.values())),
            mps_pids=tuple(processes),
            changed_gpus=changed,
            off_nvidia={address: driver for address, driver in drivers.items() if driver != NVIDIA},
        )

    def passthrough_holders(self) -> dict[str, set[str]]:
        """By PCI address, the claims whose records pass that GPU through (to vfio-pci)."""
        holders: dict[str, set[str]] = {}
        for uid, record in self.records.items():
            for device in record.devices:
                if device.passthrough is not None:
                    holders.setdefault(device.passthrough.pci_bus_id, set()).add(uid)
        return holders

    def double_allocations(self) -> list[str]:
        """Hardware that two claims' records hold exclusively at once: a memory slice of a GPU (a full
        GPU occupies all of its slices, and so does its passthrough device, a MIG device those of its
        placement), one MIG device (by its uuid), or a GPU both shared (consumable capacity) and held
        whole or in part (or passed through). Admin access occupies nothing; shares of one GPU may be
        many; a claim's own results never conflict."""
        holders: dict[tuple[str, int | str], set[str]] = {}  # (GPU, memory slice) or (MIG uuid, "") -> claims
        shared: dict[str, set[str]] = {}  # GPU -> claims holding a share of it
        for uid, record in self.records.items():
            for device in record.devices:
                if device.admin_access:
                    continue
                if device.share_id is not None:
                    shared.setdefault(device.device, set()).add(uid)
                    continue
                for unit in _units(device):
                    holders.setdefault(unit, set()).add(uid)
                if device.mig is not None and device.mig.uuid:
                    holders.setdefault((device.mig.uuid, ""), set()).add(uid)
        found = {_held_twice(unit, uids) for unit, uids in holders.items() if len(uids) > 1}
        for gpu, sharing in shared.items():
            whole = set().union(*(holders.get((gpu, index), set()) for index in range(_SLICES))) - sharing
            if whole:
                found.add(f"{gpu} shared by {sorted(sharing)} and held by {sorted(whole)}")
        return sorted(found)


def sysfs_root(paths: DriverPaths) -> Path:
    """Where the simulated node's sysfs tree is: the daemon runs without --sysfs-root."""
    return paths.data / SYSFS_DIR


def mps_processes(root: Path) -> dict[int, str]:
    """The stand-in MPS daemons running under ``root``, by pid: their daemon ids. Read from /proc, as
    a process whose directory is gone, or whose pid no file names, is as alive as any other."""
    found: dict[int, str] = {}
    prefix = f"{root}{os.sep}"
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue  # exited meanwhile
        for arg in argv:
            if arg.startswith(prefix):
                found[int(entry.name)] = arg[len(prefix) :].partition(os.sep)[0]
                break
    return found


def _held_twice(unit: tuple[str, int | str], uids: set[str]) -> str:
    name, index = unit
    return f"{name} slice {index}: {sorted(uids)}" if index != "" else f"{name}: {sorted(uids)}"


def _units(device: DeviceRecord) -> list[tuple[str, int | str]]:
    """The memory slices a device occupies: a full GPU all of its own, and so does a passthrough
    device (``gpu-vfio-<index>``) those of the GPU its record names; a MIG device those of its
    placement, as its record tells (dynamic MIG) or its name does (``gpu-0-mig-3g40gb-9-0``: an H100
    profile's size in memory slices, then its start); a device of another name itself."""
    if device.passthrough is not None:
        return [(device.passthrough.parent_device, index) for index in range(_SLICES)]
    gpu, _, mig = device.device.partition("-mig-")
    if not mig:
        return [(gpu, index) for index in range(_SLICES)]
    if device.mig is not None:
        placed = device.mig
        return [(placed.parent_device, placed.placement_start + i) for i in range(placed.placement_size)]
    profile, _, start = mig.rpartition("-")
    size = _MIG_SLICES.get(profile.rpartition("-")[0])
    if size is None or not start.isdigit():
        return [(device.device, "")]
    return [(gpu, int(start) + offset) for offset in range(size)]


_MIG_SLICES = {"1g10gb": 1, "1g20gb": 2, "2g20gb": 2, "3g40gb": 4, "4g40gb": 4, "7g80gb": 8}
