"""A long-running program the end-to-end tests start, stop and start again: the driver or the harness.

Each run is a child in its own session that the kernel kills if the test process dies (see
e2e/cluster/processes.py), and every run appends to one log file, so that a failing test can show what
the program said during that test, across restarts.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from e2e.cluster import processes
from e2e.cluster.processes import ProcessRecord

_T = TypeVar("_T")
_POLL_SECONDS = 0.1
_STOP_GRACE_SECONDS = 15.0


class DaemonError(RuntimeError):
    """The program did not start, or did not stop as asked; the message ends with its log."""


def wait_until(probe: Callable[[], _T | None], *, timeout_seconds: float, waiting_for: str) -> _T:
    """Polls `probe` until it returns something true (an object, a non-empty list, True) and returns it.

    For what offers no watch: files, metrics, HTTP endpoints, lists filtered by more than a name.
    """
    deadline = time.monotonic() + timeout_seconds
    while True:
        result = probe()
        if result:
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"gave up after {timeout_seconds:.0f}s waiting for {waiting_for}")
        time.sleep(_POLL_SECONDS)


class Daemon:
    """One program, at most one run of it at a time, all runs logging to `log`."""

    def __init__(self, name: str, log: Path) -> None:
        self.name = name
        self.log = log
        self._child: subprocess.Popen[bytes] | None = None
        self._record: ProcessRecord | None = None

    @property
    def running(self) -> bool:
        return self._child is not None and self._child.poll() is None

    def log_size(self) -> int:
        """Where the log ends now: what `log_since` reads from."""
        return self.log.stat().st_size if self.log.exists() else 0

    def log_since(self, offset: int) -> str:
        if not self.log.exists():
            return ""
        with self.log.open("rb") as log:
            log.seek(offset)
            return log.read().decode(errors="replace")

    def start(self, argv: Sequence[str], ready: Callable[[int], bool], *, timeout_seconds: float) -> None:
        """Starts `argv` and returns once `ready(log offset of this run)` holds.

        Fails early, with what this run logged, if the program exits first or is not ready in time;
        it is stopped again then.
        """
        if self.running:
            raise DaemonError(f"{self.name} is already running (pid {self._child_pid()})")
        self.log.parent.mkdir(parents=True, exist_ok=True)
        offset = self.log_size()
        self._child, self._record = processes.spawn(self.name, argv, self.log, die_with_parent=True)
        deadline = time.monotonic() + timeout_seconds
        while not ready(offset):
            status = self._child.poll()
            if status is not None:
                self._child = self._record = None
                log = self._tail(offset)
                raise DaemonError(f"{self.name} exited with status {status} while starting:\n{log}")
            if time.monotonic() > deadline:
                self.stop()
                log = self._tail(offset)
                raise DaemonError(f"{self.name} was not ready after {timeout_seconds:.0f}s:\n{log}")
            time.sleep(_POLL_SECONDS)

    def stop(self) -> int | None:
        """SIGTERM (SIGKILL after a grace period); returns the exit status, None if it was not running."""
        child, record = self._child, self._record
        self._child = self._record = None
        if child is None or record is None:
            return None
        processes.stop(record, grace_seconds=_STOP_GRACE_SECONDS)
        return child.wait()

    @property
    def pid(self) -> int | None:
        """The running process's id (None when stopped): a restart changes it."""
        return self._child_pid()

    def _child_pid(self) -> int | None:
        return self._child.pid if self._child else None

    def _tail(self, offset: int, lines: int = 40) -> str:
        text = self.log_since(offset).splitlines()[-lines:]
        return "\n".join(f"  | {line}" for line in text) + f"\n(full log: {self.log})"
