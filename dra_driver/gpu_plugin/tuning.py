"""The daemon's start-up and memory policy, in one place: each knob, what it buys, and where it acts.

CPython's defaults suit a short script; a node daemon imports some 700 modules once, then serves
small bursts of claims for months. Each knob below was measured with ``make bench`` (the figures:
docs/performance.md, "Start-up" and "Latency and CPU per claim"):

1. **The cyclic collector is off while ``dra-driver`` imports**: ``gc.disable()`` is the first
   statement of ``dra_driver.__main__`` (before this module, which imports asyncio, could be
   imported). Start-up frees almost nothing, and walking its new objects cost 15 to 20 % of the
   import CPU. Every command but the daemon turns it on again at once (``dra_driver.cli``); the
   daemon, when it serves (:func:`settle_after_start`).
2. **What the kubelet's sockets do not need is imported in a worker thread**
   (:func:`import_off_the_loop`, in :mod:`.launch`). An import holds the event loop for as long as
   it runs, and the kubelet gives GetInfo 1 s; under load an import on the loop timed it out.
3. **Start-up's objects are frozen once the daemon serves** (:func:`settle_collector`,
   ``GC_SETTLE_DELAY_S`` after it is ready, off the path of the kubelet's first calls). Some
   70 000 long-lived objects (grpc, the Kubernetes client, pydantic) leave every later collection,
   which walked them in 24 ms inside whichever prepare tripped it, and the young generation is
   collected every ``GEN0_THRESHOLD`` allocations instead of 700, so fewer of a claim's
   short-lived objects are promoted and walked again.
4. **The heap goes back to the kernel after a burst** (:class:`HeapTrimmer`). glibc keeps freed
   pages mapped, so resident memory stayed at a burst's high-water mark; ``malloc_trim(0)`` returns
   every whole free page (``madvise(MADV_DONTNEED)``) once the node has been idle for
   ``IDLE_DELAY_S``, never while a claim operation runs. Only glibc has it; elsewhere (musl) this
   does nothing.

Two more choices live with the code they shape, since they are how that code works rather than a
setting of the process: at most 16 connections to the API server
(:data:`dra_driver.apiserver.connect.API_CONNECTIONS`), and the store's commit and the CDI spec
writes on the event loop (cheaper than a thread hop: :mod:`dra_driver.node.store`).
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import importlib
from collections.abc import Callable

IDLE_DELAY_S = 1.0  # after the last claim operation of a burst
GC_SETTLE_DELAY_S = 1.0  # after the daemon is ready
GEN0_THRESHOLD = 10_000  # allocations between young collections (Python's default: 700)


async def import_off_the_loop(module: str) -> None:
    """Knob 2: import ``module`` in a worker thread, so the event loop goes on answering meanwhile."""
    await asyncio.to_thread(importlib.import_module, module)


def settle_after_start(trimmer: HeapTrimmer) -> None:
    """The daemon serves: the collector on again (knob 1), and a moment later, off the path of the
    kubelet's first calls, start-up's objects frozen (knob 3) and what it freed trimmed (knob 4)."""
    gc.enable()

    def settle() -> None:
        settle_collector()
        trimmer.idle()

    asyncio.get_running_loop().call_later(GC_SETTLE_DELAY_S, settle)


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
