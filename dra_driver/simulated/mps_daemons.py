"""MPS control daemons as local processes: the simulated node's stand-in for NVIDIA's daemon pods.

A simulated node has no GPU and, in the end-to-end tests, no kubelet that runs pods, so a daemon
Deployment would never start. Instead each daemon is a process on the plugin's machine,
``python -m dra_driver.simulated.mps_control`` (see there for what it does), with the real
daemon's lifecycle: its directories under ``<root>/<id>``, a start that is idempotent, readiness
when ``startup.log`` appears in its log directory, failure when the process exits first (its
``control.log`` says why), and a stop that ends it and removes the directories.

The process runs in a session of its own and outlives a restart of the plugin, as a daemon pod
outlives the plugin pod; its pid is kept in ``<root>/<id>/pid`` so that a restarted plugin finds
it. Only a process whose command line names the daemon's directory is ever signalled, so a pid
reused by another process is left alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import structlog

from dra_driver.node.sharing.mps import (
    DEFAULT_READY_TIMEOUT_S,
    READY_FILE,
    MpsDaemonError,
    MpsDaemonSpec,
    MpsPaths,
    control_commands,
)
from dra_driver.simulated.gpus import STATE_FILE_NAME

log = structlog.get_logger(__name__)

STANDIN_MODULE = "dra_driver.simulated.mps_control"
_POLL_S = 0.05
_STOP_GRACE_S = 5.0


class LocalMpsDaemons:
    """Stand-in MPS daemons under ``root``; ``gpu_state`` is the simulated GPUs' state file they check."""

    def __init__(self, root: Path, gpu_state: Path | None = None) -> None:
        self._root = root
        self._gpu_state = gpu_state
        self._children: dict[str, subprocess.Popen[bytes]] = {}  # started by this process: reaped here

    @classmethod
    def of_node(cls, data_dir: Path) -> LocalMpsDaemons:
        """The daemons of the simulated node whose plugin keeps its state in ``data_dir``."""
        return cls(data_dir / "mps", data_dir / STATE_FILE_NAME)

    def paths(self, daemon_id: str) -> MpsPaths:
        return MpsPaths(self._root / daemon_id)

    async def start(self, spec: MpsDaemonSpec) -> MpsPaths:
        return await asyncio.to_thread(self._start, spec)

    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[None]:
        """Held while a daemon is started or stopped. Two plugin instances share the node's daemons
        (a rolling update runs both): without it, each could find no daemon and start one, and the
        stop that follows ends only the one its pid file names (the kill -9 suite saw the other
        left running). A daemon pod has no such window: it is created and deleted by name."""
        self._root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self._root / ".lock", os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _start(self, spec: MpsDaemonSpec) -> MpsPaths:
        with self._exclusive():
            return self._start_locked(spec)

    def _start_locked(self, spec: MpsDaemonSpec) -> MpsPaths:
        paths = self.paths(spec.id)
        if self._alive(spec.id):
            pid_file = paths.root / "pid"
            if not pid_file.exists():  # its plugin was killed before writing it: adopt the process
                pid_file.write_text(f"{self._pid(spec.id)}\n")
            return paths
        for directory in (paths.pipe, paths.log, paths.shm):
            directory.mkdir(parents=True, exist_ok=True)
        (paths.log / READY_FILE).unlink(missing_ok=True)
        command = [
            sys.executable,
            "-m",
            STANDIN_MODULE,
            "--root",
            str(paths.root),
            "--devices",
            spec.visible_devices,
        ]
        if self._gpu_state is not None:
            command += ["--gpu-state", str(self._gpu_state)]
        for line in control_commands(spec):
            command += ["--control", line]
        with open(paths.log / "control.log", "ab") as output:
            child = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=output,
                start_new_session=True,  # outlives the plugin, as a daemon pod does
                env={**os.environ, "CUDA_VISIBLE_DEVICES": spec.visible_devices},
            )
        self._children[spec.id] = child
        (paths.root / "pid").write_text(f"{child.pid}\n")
        log.info("mps_daemon_started", daemon=spec.id, pid=child.pid, devices=spec.visible_devices)
        return paths

    async def wait_ready(self, spec: MpsDaemonSpec, timeout_s: float = DEFAULT_READY_TIMEOUT_S) -> None:
        paths = self.paths(spec.id)
        deadline = time.monotonic() + timeout_s
        while True:
            if await asyncio.to_thread((paths.log / READY_FILE).exists):
                return
            if not self._alive(spec.id):
                raise MpsDaemonError(
                    f"MPS control daemon {spec.id} exited before it was ready: {self._last_words(paths)}"
                )
            if time.monotonic() >= deadline:
                raise MpsDaemonError(
                    f"MPS control daemon {spec.id} was not ready within {timeout_s:g}s: "
                    f"{self._last_words(paths)}"
                )
            await asyncio.sleep(_POLL_S)

    async def stop(self, daemon_id: str) -> None:
        await asyncio.to_thread(self._stop, daemon_id)

    def _stop(self, daemon_id: str) -> None:
        with self._exclusive():
            self._stop_locked(daemon_id)

    def _stop_locked(self, daemon_id: str) -> None:
        paths = self.paths(daemon_id)
        pid = self._pid(daemon_id)
        if pid is not None and self._alive(daemon_id):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + _STOP_GRACE_S
            while self._alive(daemon_id) and time.monotonic() < deadline:
                time.sleep(_POLL_S)
            if self._alive(daemon_id):
                log.warning("mps_daemon_killed", daemon=daemon_id, pid=pid, waited_seconds=_STOP_GRACE_S)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                while self._alive(daemon_id):
                    time.sleep(_POLL_S)
        self._children.pop(daemon_id, None)
        try:
            shutil.rmtree(paths.root)
        except FileNotFoundError:
            return
        except OSError as e:
            raise MpsDaemonError(
                f"cannot remove the directory {paths.root} of MPS daemon {daemon_id}: {e}"
            ) from e
        log.info("mps_daemon_stopped", daemon=daemon_id)

    async def running(self) -> set[str]:
        return await asyncio.to_thread(self._daemon_ids)

    def stop_all(self) -> None:
        """End every daemon under the root: the clean-up of a test or a scratch node."""
        for daemon_id in sorted(self._daemon_ids()):
            self._stop(daemon_id)

    def _daemon_ids(self) -> set[str]:
        try:
            return {entry.name for entry in self._root.iterdir() if entry.is_dir()}
        except FileNotFoundError:
            return set()

    def pid(self, daemon_id: str) -> int | None:
        """The daemon's process id while it runs (for tests and the `simulate` view)."""
        return self._pid(daemon_id) if self._alive(daemon_id) else None

    def _pid(self, daemon_id: str) -> int | None:
        try:
            return int((self.paths(daemon_id).root / "pid").read_text())
        except (FileNotFoundError, ValueError):
            return self._unrecorded_pid(daemon_id)

    def _unrecorded_pid(self, daemon_id: str) -> int | None:
        """The daemon's process when no file names it: a plugin killed between starting the process
        and writing its pid leaves one, and a restarted plugin must adopt or stop it, not start a
        second beside it. Found by its ``--root``, the daemon's directory, among /proc's command lines."""
        root = str(self.paths(daemon_id).root).encode()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue  # exited meanwhile
            if STANDIN_MODULE.encode() in argv and root in argv:
                return int(entry.name)
        return None

    def _alive(self, daemon_id: str) -> bool:
        child = self._children.get(daemon_id)
        if child is not None:
            return child.poll() is None  # reaps it once it exited: no zombie is left
        pid = self._pid(daemon_id)
        if pid is None:
            return False
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            status = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        # Ours only if it names this daemon's directory; a zombie (state Z) has stopped.
        return (
            str(self.paths(daemon_id).root).encode() in cmdline
            and status.rpartition(")")[2].split()[0] != "Z"
        )

    @staticmethod
    def _last_words(paths: MpsPaths) -> str:
        try:
            lines = (paths.log / "control.log").read_text(errors="replace").strip().splitlines()
        except OSError:
            return "it left no log"
        return lines[-1] if lines else "it left no log"
