"""The daemon under test: started as the DaemonSet would start it, timed until the kubelet has it.

Start-up is measured from the moment before the process is spawned to (1) the registration socket
appearing, (2) the kubelet's registration calls having succeeded, and (3) ``/readyz`` answering 200
(registered *and* ResourceSlices published). The socket file and ``/readyz`` are polled every
``POLL_S``: the kubelet's fsnotify would see the socket sooner by at most that much.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import grpc

from bench.kubelet import BenchFailure, register
from e2e.cluster import processes
from e2e.cluster.controlplane import free_ports
from e2e.driver import DriverPaths

POLL_S = 0.002
# Where a daemon's CDI specs go: a node's /var/run/cdi is tmpfs. On this machine's ext4 the kernel's
# creation of each spec file cost 0.3 to 0.8 ms of CPU (the scan of inodes freed moments before by
# the unprepares, perf), as much as the prepare around it, and its swing moved the Go driver's
# burst CPU between 2.8 and 7.8 ms from run to run.
NODE_TMPFS = Path("/dev/shm")
START_TIMEOUT_S = 60.0
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class StartupTimes:
    """Seconds from spawn."""

    socket: float  # the registration socket exists
    registered: float  # GetInfo + NotifyRegistrationStatus answered
    ready: float | None  # /readyz answered 200 (None: the daemon has no readiness endpoint)


@dataclass(frozen=True)
class DaemonConfig:
    driver: str
    node: str
    gpus: str  # simulated node profile, e.g. dgx-h100
    kubeconfig: Path


class Daemon:
    """One running ``dra-driver kubelet-plugin`` with all its directories under ``base``."""

    def __init__(self, config: DaemonConfig, base: Path) -> None:
        self.config = config
        # The end-to-end tests' layout: a driver root holding the (empty) driver libraries the
        # daemon requires before it starts, a boot id of its own, every directory under ``base``.
        self._cdi = tempfile.TemporaryDirectory(
            prefix="dra-bench-cdi-", dir=NODE_TMPFS if NODE_TMPFS.is_dir() else base.parent
        )
        self.paths = dataclasses.replace(
            DriverPaths.under(base, registry=base / "registry"), cdi=Path(self._cdi.name)
        )
        self.paths.create()
        self.log = base / "daemon.log"
        (self.http_port,) = free_ports(1)
        self._argv = self.command()
        self._child: subprocess.Popen[bytes] | None = None
        self._record: processes.ProcessRecord | None = None

    def command(self) -> list[str]:
        """The daemon's command line."""
        config, paths = self.config, self.paths
        return [
            sys.executable, "-m", "dra_driver", "kubelet-plugin",
            f"--driver-name={config.driver}",
            f"--node-name={config.node}",
            f"--simulate={config.gpus}",
            f"--kubeconfig={config.kubeconfig}",
            f"--plugins-dir={paths.plugins}",
            f"--registry-dir={paths.registry}",
            f"--cdi-dir={paths.cdi}",
            f"--data-dir={paths.data}",
            f"--driver-root={paths.driver_root}",
            f"--boot-id-file={paths.boot_id_file}",
            f"--http-address=127.0.0.1:{self.http_port}",
            "--log-format=json",
        ]  # fmt: skip

    @property
    def registration_socket(self) -> Path:
        return self.paths.registry / f"{self.config.driver}-reg.sock"

    @property
    def pid(self) -> int:
        if self._record is None:
            raise RuntimeError("the daemon is not running")
        return self._record.pid

    async def start(self) -> tuple[StartupTimes, Path]:
        """Spawn, register as the kubelet would and wait for readiness; returns the times and DRA socket."""
        started = time.perf_counter()
        self._child, self._record = processes.spawn("dra-driver", self._argv, self.log, die_with_parent=True)
        await self._until(self.registration_socket.exists)
        socket_at = time.perf_counter() - started
        endpoint = await self._register()
        registered_at = time.perf_counter() - started
        ready_at = None
        if self.has_readyz:
            async with aiohttp.ClientSession() as session:
                await self._until_async(
                    lambda: _answers_ok(session, f"http://127.0.0.1:{self.http_port}/readyz")
                )
            ready_at = time.perf_counter() - started
        return StartupTimes(socket=socket_at, registered=registered_at, ready=ready_at), endpoint

    async def _register(self) -> Path:
        """Register as the plugin watcher does, retrying while the socket exists but does not listen yet.

        A server binds the socket file before it listens (Go's net.Listen does both, a moment
        apart), and the kubelet retries a registration that was refused.
        """
        deadline = time.perf_counter() + START_TIMEOUT_S
        while True:
            try:
                return await register(self.registration_socket, self.config.driver)
            except grpc.aio.AioRpcError as error:
                if error.code() != grpc.StatusCode.UNAVAILABLE or time.perf_counter() > deadline:
                    raise BenchFailure(f"registration failed: {error.details()}\n{self._tail()}") from None
                await asyncio.sleep(POLL_S)

    @property
    def has_readyz(self) -> bool:
        """Whether the daemon answers /readyz on ``http_port`` (registered and slices published)."""
        return True

    def stop(self) -> None:
        if self._record is not None and self._child is not None:
            processes.stop(self._record, grace_seconds=10.0)
            self._child.wait()
        self._record = self._child = None
        self._cdi.cleanup()

    def rss_mib(self) -> tuple[float, float]:
        """Resident memory now and its peak (VmRSS, VmHWM), in MiB."""
        fields = dict(
            line.split(":", 1) for line in Path(f"/proc/{self.pid}/status").read_text().splitlines()
        )
        return _kib_to_mib(fields["VmRSS"]), _kib_to_mib(fields["VmHWM"])

    def cpu_seconds(self) -> float:
        """User + system CPU time the daemon (all its threads) has used so far."""
        after_name = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        utime, stime = int(after_name[11]), int(after_name[12])  # fields 14 and 15 of proc(5)
        return (utime + stime) / _CLOCK_TICKS

    async def _until(self, condition: Callable[[], bool]) -> None:
        async def check() -> bool:
            return condition()

        await self._until_async(check)

    async def _until_async(self, condition: Callable[[], Awaitable[bool]]) -> None:
        deadline = time.perf_counter() + START_TIMEOUT_S
        while not await condition():
            if self._child is not None and self._child.poll() is not None:
                raise BenchFailure(f"the daemon exited with status {self._child.returncode}:\n{self._tail()}")
            if time.perf_counter() > deadline:
                raise BenchFailure(f"the daemon did not start within {START_TIMEOUT_S:.0f}s:\n{self._tail()}")
            await asyncio.sleep(POLL_S)

    def _tail(self, lines: int = 20) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:]) + f"\n(full log: {self.log})"


async def _answers_ok(session: aiohttp.ClientSession, url: str) -> bool:
    try:
        async with session.get(url) as response:
            return response.status == 200
    except aiohttp.ClientError:
        return False


def _kib_to_mib(field: str) -> float:
    return int(field.split()[0]) / 1024


# What the daemon imports, as the benchmark runs it (with an HTTP address): the sockets' part
# (dra_driver.gpu_plugin.launch), then the rest behind them.
DAEMON_MODULES = "dra_driver.gpu_plugin.launch, dra_driver.gpu_plugin.app, dra_driver.gpu_plugin.http"


def python_seconds(code: str) -> float:
    """Wall time of a fresh interpreter running ``code``: the floor under the daemon's start-up."""
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True)
    return time.perf_counter() - started


def imported_rss_mib() -> float:
    """Resident memory of an interpreter that has only imported the daemon's modules."""
    code = (
        f"import {DAEMON_MODULES}, pathlib; "
        "print(next(l for l in pathlib.Path('/proc/self/status').read_text().splitlines() "
        "if l.startswith('VmRSS')).split()[1])"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return int(out) / 1024
