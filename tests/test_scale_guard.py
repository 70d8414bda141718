"""bench/scale.py's memory guard stops the run however the run was started."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

# A guard whose threshold is always crossed trips at its first look (within a second).
_RUN = """
import time
from bench import scale
scale.interruptible()
try:
    with scale.MemoryGuard(low_mib=float("inf")):
        for _ in range(100):  # the main thread's work: short waits, as the run's are
            time.sleep(0.1)
    print("ran on", flush=True)
except KeyboardInterrupt:
    print("stopped", flush=True)
"""


def _as_in_the_background() -> None:
    """A non-interactive shell's `make bench &` starts the run with SIGINT ignored."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def test_the_memory_guard_stops_a_run_started_in_the_background() -> None:
    run = subprocess.run(
        [sys.executable, "-c", _RUN],
        cwd=REPO_ROOT,
        preexec_fn=_as_in_the_background,
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert run.stdout.strip() == "stopped", run.stderr
