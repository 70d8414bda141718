"""Child processes that can be found and stopped again, by this process or by a later one.

Every component runs in its own session (so a Ctrl-C at the terminal reaches only the test runner,
which then stops the components in order) and is remembered by pid *and* start time, so that a
`cluster down` run long after `cluster up` never signals an unrelated process that reused the pid.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class ProcessRecord:
    """Identifies one started component across processes (it is what the state file stores)."""

    name: str
    pid: int
    start_time: int  # clock ticks since boot (field 22 of /proc/<pid>/stat)
    log: Path


def _stat_after_name(pid: int) -> list[str] | None:
    """Fields 3.. of /proc/<pid>/stat (state, ppid, ...), or None when no such process exists."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # The command name (field 2) is parenthesised and may contain spaces; fields after it are plain.
    return stat.rsplit(")", 1)[1].split()


def process_start_time(pid: int) -> int | None:
    """The start time of `pid`, or None when no such process exists."""
    fields = _stat_after_name(pid)
    return int(fields[19]) if fields else None


def is_running(record: ProcessRecord) -> bool:
    """Whether the recorded process still exists (and is not a zombie awaiting its parent)."""
    fields = _stat_after_name(record.pid)
    return fields is not None and int(fields[19]) == record.start_time and fields[0] != "Z"


def _die_with_parent() -> Callable[[], None]:
    """A preexec_fn that makes the kernel SIGKILL the child when the thread that started it exits.

    This is what keeps a test run that is itself killed (SIGKILL, an OOM kill, a CI timeout) from
    leaving an etcd and an API server behind: no handler in the dying process is needed.
    """
    parent = os.getpid()
    libc = ctypes.CDLL(None, use_errno=True)

    def preexec() -> None:
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
            os._exit(127)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(127)

    return preexec


def spawn(
    name: str,
    argv: Sequence[str],
    log: Path,
    *,
    die_with_parent: bool,
    env: Mapping[str, str] | None = None,
) -> tuple[subprocess.Popen[bytes], ProcessRecord]:
    """Starts `argv` in a new session with stdout and stderr appended to `log` (`env`: its environment)."""
    with log.open("ab") as log_file:
        child = subprocess.Popen(
            argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_parent() if die_with_parent else None,
        )
    # Until it is reaped, our child keeps its /proc entry even if it has already exited.
    start_time = process_start_time(child.pid)
    if start_time is None:
        raise RuntimeError(f"{name} (pid {child.pid}) has no /proc entry right after it started")
    return child, ProcessRecord(name=name, pid=child.pid, start_time=start_time, log=log)


def stop(record: ProcessRecord, *, grace_seconds: float) -> None:
    """Stops the process and its process group: SIGTERM, then SIGKILL after `grace_seconds`.

    Returns once the process has exited. A process that is already gone (or whose pid now belongs to
    someone else) is left alone.
    """
    try:
        pidfd = os.pidfd_open(record.pid)
    except ProcessLookupError:
        return
    try:
        # The pidfd pins the pid, so once the start time matches, every signal below reaches our process.
        if process_start_time(record.pid) != record.start_time:
            return
        for sig, wait_seconds in ((signal.SIGTERM, grace_seconds), (signal.SIGKILL, 10.0)):
            _signal_group(record.pid, sig)
            if _wait_readable(pidfd, wait_seconds):
                return
        raise RuntimeError(f"{record.name} (pid {record.pid}) survived SIGKILL")
    finally:
        os.close(pidfd)


def wait_for_exit(record: ProcessRecord, timeout_seconds: float) -> bool:
    """Whether the recorded process exits within `timeout_seconds` (True at once when it is gone)."""
    try:
        pidfd = os.pidfd_open(record.pid)
    except ProcessLookupError:
        return True
    try:
        if process_start_time(record.pid) != record.start_time:
            return True
        return _wait_readable(pidfd, timeout_seconds)
    finally:
        os.close(pidfd)


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, sig)  # spawn() made each child a session (and group) leader: pgid == pid


def _wait_readable(fd: int, timeout: float) -> bool:
    readable, _, _ = select.select([fd], [], [], timeout)
    return bool(readable)
