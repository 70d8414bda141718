"""Handing the heap memory a burst of claims freed back to the operating system.

A burst of claim operations (200 concurrent prepares: their gRPC calls, API requests and
JSON) allocates tens of MiB that are freed when it ends, but glibc's allocator keeps freed
pages of its heaps mapped, so the plugin's resident memory stayed at its high-water mark for
good. ``malloc_trim(0)`` returns every whole free page inside the heaps to the kernel
(``madvise(MADV_DONTNEED)``); it changes no live allocation. The daemon calls it once the
node has been idle for a moment after claim operations, never while one is running.

Only glibc has ``malloc_trim``; elsewhere (musl) this does nothing.

The cyclic garbage collector gets the same care (:func:`settle_collector`). Start-up leaves
tens of thousands of long-lived objects (the modules of grpc, the Kubernetes client, pydantic), and
every full collection walked all of them, in the middle of whichever prepare tripped it, which
made the worst prepares several times the median (docs/performance.md has the figures).
Frozen after start-up, they are no collection's business any more; and a larger first
generation collects the short-lived objects of a claim operation (gRPC messages, JSON, log
events) less often, so fewer of them live long enough to be promoted and walked again.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
from collections.abc import Callable

IDLE_DELAY_S = 1.0  # after the last claim operation of a burst
GEN0_THRESHOLD = 10_000  # allocations between young collections (Python's default: 700)


def settle_collector() -> None:
    """Collect once, then keep every object alive now out of later collections; call after start-up."""
    gc.collect()
    gc.freeze()
    young, older, oldest = gc.get_threshold()
    gc.set_threshold(max(GEN0_THRESHOLD, young), older, oldest)


def _libc_malloc_trim() -> Callable[[], object] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return lambda: trim(0)


class HeapTrimmer:
    """Trims the heap ``delay`` seconds after the last :meth:`idle`, unless ``busy()`` says otherwise."""

    def __init__(
        self,
        busy: Callable[[], bool],
        *,
        delay: float = IDLE_DELAY_S,
        trim: Callable[[], object] | None = None,
    ) -> None:
        self._busy = busy
        self._delay = delay
        self._trim = trim if trim is not None else _libc_malloc_trim()
        self._pending: asyncio.TimerHandle | None = None
        self.trims = 0  # how often the heap was trimmed

    def idle(self) -> None:
        """No claim operation is running now: trim after ``delay``, unless another one comes first."""
        if self._trim is None:
            return
        if self._pending is not None:
            self._pending.cancel()
        self._pending = asyncio.get_running_loop().call_later(self._delay, self._fire)

    def _fire(self) -> None:
        self._pending = None
        if self._trim is None or self._busy():  # a new operation started: it calls idle() again
            return
        self._trim()
        self.trims += 1
