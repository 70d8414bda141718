"""The heap trim after a burst: once idle, never while a claim operation runs, and on glibc for real;
and the garbage collector settled after start-up."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap

from dra_driver.gpu_plugin.tuning import GEN0_THRESHOLD, HeapTrimmer, _libc_malloc_trim


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


def test_after_start_up_a_full_collection_walks_none_of_its_objects() -> None:
    # In a child process: freezing is for the life of a process, and this one runs other tests.
    probe = textwrap.dedent(
        """
        import gc, json
        import dra_driver.gpu_plugin.app
        from dra_driver.gpu_plugin.tuning import settle_collector
        before = len(gc.get_objects())
        settle_collector()
        print(json.dumps([before, len(gc.get_objects()), gc.get_freeze_count(), gc.get_threshold()[0]]))
        """
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    before, collectable, frozen, young_threshold = json.loads(result.stdout)
    assert before > 10_000  # the modules of grpc, kubernetes and pydantic
    assert collectable < before / 100  # what a full collection still walks
    assert frozen >= before * 0.9
    assert young_threshold == GEN0_THRESHOLD
