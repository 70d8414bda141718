"""The heap trim after a burst: once idle, never while a claim operation runs, and on glibc for real."""

from __future__ import annotations

import asyncio

from dra_driver.memory import HeapTrimmer, _libc_malloc_trim


async def test_the_heap_is_trimmed_once_after_the_last_idle() -> None:
    calls: list[str] = []
    trimmer = HeapTrimmer(lambda: False, delay=0.05, trim=lambda: calls.append("trim"))
    for _ in range(5):  # a burst: many operations end; only the last idle counts
        trimmer.idle()
        await asyncio.sleep(0.01)
    assert calls == []
    await asyncio.sleep(0.1)
    assert calls == ["trim"]
    assert trimmer.trims == 1


async def test_no_trim_while_a_claim_operation_runs() -> None:
    calls: list[str] = []
    busy = [True]
    trimmer = HeapTrimmer(lambda: busy[0], delay=0.02, trim=lambda: calls.append("trim"))
    trimmer.idle()
    await asyncio.sleep(0.06)
    assert calls == []  # the operation that started meanwhile calls idle() again when it ends
    busy[0] = False
    trimmer.idle()
    await asyncio.sleep(0.06)
    assert calls == ["trim"]


def test_glibc_has_malloc_trim() -> None:
    trim = _libc_malloc_trim()
    assert trim is not None
    assert trim() in (0, 1)  # 1: memory was released, 0: there was none to release
