"""A rate-limited work queue of object keys, with client-go's semantics, on asyncio.

* A key is queued at most once however often it is added (changes coalesce).
* A key being processed is never handed to a second worker; added meanwhile, it is queued again
  once :meth:`done` is called, so no change is lost.
* :meth:`add_rate_limited` retries a failing key with per-key exponential backoff (``base`` doubling
  up to ``cap``); :meth:`forget` resets it after a success.
"""

from __future__ import annotations

import asyncio
import contextlib


class WorkQueue:
    def __init__(self, base_delay: float = 0.05, max_delay: float = 60.0) -> None:
        self._base = base_delay
        self._cap = max_delay
        self._queue: asyncio.Queue[str] = asyncio.Queue()
        self._queued: set[str] = set()
        self._processing: set[str] = set()
        self._dirty: set[str] = set()  # added while processing
        self._failures: dict[str, int] = {}
        self._timers: set[asyncio.TimerHandle] = set()

    def add(self, key: str) -> None:
        if key in self._processing:
            self._dirty.add(key)
            return
        if key in self._queued:
            return
        self._queued.add(key)
        self._queue.put_nowait(key)

    def add_after(self, key: str, delay: float) -> None:
        loop = asyncio.get_running_loop()
        handle: asyncio.TimerHandle

        def fire() -> None:
            self._timers.discard(handle)
            self.add(key)

        handle = loop.call_later(max(delay, 0.0), fire)
        self._timers.add(handle)

    def add_rate_limited(self, key: str) -> float:
        """Queue ``key`` again after its backoff; returns the delay."""
        failures = self._failures.get(key, 0)
        self._failures[key] = failures + 1
        delay: float = min(self._base * 2.0**failures, self._cap)
        self.add_after(key, delay)
        return delay

    def forget(self, key: str) -> None:
        self._failures.pop(key, None)

    def failures(self, key: str) -> int:
        return self._failures.get(key, 0)

    async def get(self) -> str:
        key = await self._queue.get()
        self._queued.discard(key)
        self._processing.add(key)
        return key

    def done(self, key: str) -> None:
        self._processing.discard(key)
        if key in self._dirty:
            self._dirty.discard(key)
            self.add(key)

    def __len__(self) -> int:
        return len(self._queued)

    def close(self) -> None:
        for handle in self._timers:
            handle.cancel()
        self._timers.clear()
        with contextlib.suppress(asyncio.QueueEmpty):
            while True:
                self._queue.get_nowait()
