"""Running a daemon's ``run()`` coroutine in the background of a test."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

_CANCEL_GUARD_S = 60.0  # against a hang only: a loop that ignores cancellation fails the test


@contextlib.asynccontextmanager
async def running(run: Callable[[], Coroutine[Any, Any, None]]) -> AsyncIterator[None]:
    """Runs ``run()`` for the duration of the block; it must still be running (not crashed) at the end."""
    task = asyncio.create_task(run())
    try:
        yield
    finally:
        assert not task.done(), task
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            async with asyncio.timeout(_CANCEL_GUARD_S):
                await task
