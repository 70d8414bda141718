"""Test-only crash points: the fault suite (``e2e/reliability``) kills the daemon at a chosen step.

``kill -9`` from outside lands wherever the process happens to be; to prove that a crash at
*every* step of prepare and unprepare loses nothing, the suite also needs to kill it exactly
before and after each transaction of the node's store, CDI spec write and MIG create or destroy. Those steps
call :func:`reached` with their name. With the environment variable ``TEST_DRA_CRASH_POINT``
unset -- always, outside the suite -- :func:`reached` is a function that returns at once.

``TEST_DRA_CRASH_POINT=<name>[@<n>]`` makes the process SIGKILL itself the ``n``-th time (default
the first) it reaches ``name``; ``*`` names every point. A line on stderr says where it died.
Nothing else reads the variable, and it is no setting of the driver: never set it on a real node.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable

ENV = "TEST_DRA_CRASH_POINT"

POINTS = (
    # Every transaction of the node's store (a claim's record, the table of MIG devices; at start-up
    # the recovery's too): its changes made, not yet committed (the crash rolls them back) ...
    "store.before_commit",
    "store.after_commit",  # ... and committed, before the caller hears of it
    "cdi.before_rename",
    "cdi.after_write",
    "cdi.before_remove",
    "cdi.after_remove",
    "mig.before_create",
    "mig.after_create",  # the MIG device exists; the store does not name it yet
    "mig.before_destroy",
    "mig.after_destroy",
    "vfio.before_bind",  # a passthrough GPU checked idle, still on nvidia
    "vfio.after_bind",  # the GPU is on vfio-pci; the spec does not exist yet
    "vfio.before_unbind",
    "vfio.after_unbind",  # the GPU is back on nvidia; its claim's spec and record remain
)


def _parse(value: str) -> tuple[str, int]:
    name, _, count = value.partition("@")
    if name != "*" and name not in POINTS:
        raise SystemExit(f"{ENV}={value!r}: unknown crash point {name!r} (known: {', '.join(POINTS)}, *)")
    try:
        nth = int(count) if count else 1
    except ValueError:
        raise SystemExit(f"{ENV}={value!r}: the count after '@' must be a number") from None
    return name, nth


def _never(name: str) -> None:
    """No crash point is armed: the cost is one call."""


def _armed(target: str, nth: int) -> Callable[[str], None]:
    hits = 0
    lock = threading.Lock()  # points are reached from worker threads too

    def reached(name: str) -> None:
        nonlocal hits
        if target not in ("*", name):
            return
        with lock:
            hits += 1
            if hits != nth:
                return
        sys.stderr.write(f"{ENV}: crashing at {name} (hit {nth})\n")
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    return reached


_value = os.environ.get(ENV, "")
reached: Callable[[str], None] = _armed(*_parse(_value)) if _value else _never
