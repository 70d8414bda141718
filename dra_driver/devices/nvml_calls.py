"""Every NVML call of the process, bounded in time, on one executor.

NVML is a C library: a call cannot be interrupted, and one can block in the kernel driver for good
(a GPU that stopped answering). So each call runs on a worker thread of one small pool, and its
caller stops waiting after the caller's timeout with one error (:class:`NvmlHungError`) that says
what to do. The NVML backend's methods and the health watch both call through here.

The pool is bounded (:data:`WORKERS` threads, started as needed), so a hung driver costs at most
that many threads, not one per call; a call that finds every worker busy waits its turn inside its
own timeout, and one whose caller gave up before a worker took it never runs. The workers are
daemon threads, not a :class:`concurrent.futures.ThreadPoolExecutor`'s (the interpreter joins
those at exit), so a hung call holds up neither its caller nor the process's exit.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import structlog

from dra_driver.devices.backend import DeviceError

log = structlog.get_logger(__name__)

# Enough for the health watch (one call at a time, most of it waiting for events) beside the
# claims prepared at once; NVML itself is thread-safe.
WORKERS = 8

T = TypeVar("T")


class NvmlHungError(DeviceError):
    """An NVML call did not answer in time (or an earlier one still has not)."""


class _Workers:
    """Daemon threads, at most ``size``, started when a job finds none idle, fed from one queue."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._started = 0
        self._idle = 0

    def submit(self, job: Callable[[], None]) -> None:
        with self._lock:
            if self._idle == 0 and self._started < self._size:
                self._started += 1
                threading.Thread(target=self._work, name=f"nvml-{self._started}", daemon=True).start()
            else:
                self._idle = max(0, self._idle - 1)  # that idle worker takes this job
        self._jobs.put(job)

    def _work(self) -> None:
        while True:
            self._jobs.get()()
            with self._lock:
                self._idle += 1


_WORKERS = _Workers(WORKERS)


@dataclass
class _Call(Generic[T]):
    """One call on its way: its outcome, and whether its caller still waits for it."""

    action: str
    future: concurrent.futures.Future[T] = field(default_factory=concurrent.futures.Future)
    lock: threading.Lock = field(default_factory=threading.Lock)
    gave_up: bool = False


class NvmlCalls:
    """One user's NVML calls (a backend, a health watch): each bounded by ``timeout`` seconds.

    ``one_at_a_time``: while a call has not answered, the next one fails at once instead of
    taking another worker -- for a watch that calls every period, so that a hung driver costs it
    one thread, not one per period.
    """

    def __init__(self, timeout: float, *, one_at_a_time: bool = False) -> None:
        self._timeout = timeout
        self._one_at_a_time = one_at_a_time
        self._last: _Call[Any] | None = None

    @property
    def timeout(self) -> float:
        """How long a call may take before it counts as hung, in seconds."""
        return self._timeout

    def run(self, action: str, call: Callable[[], T], *, abandoned: Callable[[T], None] | None = None) -> T:
        """``call()``'s result, waited for in this thread at most ``timeout`` seconds.

        A call that returns after its caller gave up hands its result to ``abandoned`` (a MIG
        device made for a claim that has already failed is destroyed again).
        """
        job = self._start(action, call, abandoned)
        try:
            return job.future.result(timeout=self._timeout)
        except concurrent.futures.TimeoutError:
            self._give_up(job)
            return job.future.result(timeout=0)  # it came in as the wait ended; else raises

    async def run_async(self, action: str, call: Callable[[], T], *, extra_seconds: float = 0.0) -> T:
        """``call()``'s result, awaited at most ``timeout`` (plus ``extra_seconds``, for a call that
        waits on purpose, as for events) seconds; the event loop runs on meanwhile."""
        job = self._start(action, call, None)
        try:
            # asyncio.timeout, not wait_for: on 3.11 wait_for swallows a cancellation that arrives as
            # the call answers, and a cancelled watch then never stops.
            async with asyncio.timeout(self._timeout + extra_seconds):
                return await asyncio.shield(asyncio.wrap_future(job.future))
        except TimeoutError:
            self._give_up(job)
            return job.future.result(timeout=0)

    async def settled(self, seconds: float) -> bool:
        """Whether no call is running, after waiting up to ``seconds`` for the last one."""
        last = self._last
        if last is None or last.future.done():
            return True
        with contextlib.suppress(Exception):  # its outcome is no longer anyone's business
            async with asyncio.timeout(seconds):
                await asyncio.shield(asyncio.wrap_future(last.future))
        return last.future.done()

    def _start(self, action: str, call: Callable[[], T], abandoned: Callable[[T], None] | None) -> _Call[T]:
        last = self._last
        if self._one_at_a_time and last is not None and not last.future.done():
            raise NvmlHungError(
                f"{action}: NVML has not answered {last.action} for over {self._timeout:g}s; "
                "the GPU or its driver is hung (check dmesg for Xid errors)"
            )
        job: _Call[T] = _Call(action)

        def run() -> None:
            if not job.future.set_running_or_notify_cancel():
                return  # its caller gave up before a worker was free: nobody wants it done
            try:
                value = call()
            except BaseException as error:  # handed to the waiting caller
                job.future.set_exception(error)
                return
            with job.lock:
                late = job.gave_up
                job.future.set_result(value)
            if late and abandoned is not None:
                abandoned(value)

        self._last = job
        _WORKERS.submit(run)
        return job

    def _give_up(self, job: _Call[Any]) -> None:
        """Stop waiting for ``job``, unless its outcome came in meanwhile (then the caller takes it)."""
        with job.lock:
            if job.future.done():
                return
            job.gave_up = True
            job.future.cancel()  # succeeds only while no worker has taken it: then it never runs
        log.error("nvml_call_timed_out", action=job.action, timeout_seconds=self._timeout)
        raise NvmlHungError(
            f"{job.action}: NVML did not answer within {self._timeout:g}s; the GPU or its driver is hung "
            "(check dmesg for Xid errors; a GPU reset or a node reboot clears it)"
        )
