"""NVML's health events on the mock libnvidia-ml.so.1: Xids, a lost GPU, a GPU NVML cannot identify."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pynvml
import pytest
from structlog.testing import capture_logs

from dra_driver.devices.backends import open_health_source
from dra_driver.devices.health import Fault, FaultKind, NodeFaults, NvmlHealthSource
from dra_driver.devices.nvml import NvmlBackend
from dra_driver.devices.types import Placement
from tests.mock_nvml import MockNvml, install_driver_root, install_procfs

GUARD_S = 30  # against a hang only
T0 = 1_800_000_000
POLL_S = 0.05


@pytest.fixture(scope="session")
def mock() -> MockNvml:
    return MockNvml()


@pytest.fixture
def backend(tmp_path: Path, mock: MockNvml) -> Iterator[NvmlBackend]:
    root = install_driver_root(tmp_path / "driver-root")
    procfs = install_procfs(tmp_path / "proc")
    mock.configure("dgxh100:2", proc_root=procfs)
    backend = NvmlBackend(procfs_root=procfs, dev_root=root, driver_root=root, state_dir=tmp_path / "state")
    backend.inventory()
    yield backend
    backend.close()


async def next_report(updates: AsyncIterator[NodeFaults]) -> NodeFaults:
    return await asyncio.wait_for(anext(updates), GUARD_S)


def watch(backend: NvmlBackend) -> AsyncIterator[NodeFaults]:
    return open_health_source(backend, poll_seconds=POLL_S, clock=lambda: T0).watch()


def uuids(backend: NvmlBackend) -> list[str]:
    return [uuid for _, uuid in sorted(backend.known_gpus().items())]


async def test_an_xid_event_is_reported_and_an_application_xid_is_not(
    backend: NvmlBackend, mock: MockNvml
) -> None:
    updates = watch(backend)
    assert await next_report(updates) == {}
    mock.control("xid 1 13")  # an application's fault: ignored
    mock.control("xid 1 48 3 0")
    second = uuids(backend)[1]
    assert await next_report(updates) == {
        second: (Fault(FaultKind.XID, T0, xid=48, detail="GPU instance 3"),)
    }
    await updates.aclose()  # type: ignore[attr-defined]


def xid(number: int, detail: str = "") -> Fault:
    return Fault(FaultKind.XID, T0, xid=number, detail=detail)


async def test_a_lost_gpu_is_reported_and_recovers_with_all_its_faults_once_it_is_reset(
    backend: NvmlBackend, mock: MockNvml
) -> None:
    updates = watch(backend)
    assert await next_report(updates) == {}
    first = uuids(backend)[0]
    mock.control("xid 0 79")
    assert await next_report(updates) == {first: (xid(79),)}
    mock.control("lose 0")
    assert await next_report(updates) == {first: (xid(79), Fault(FaultKind.GPU_LOST, T0))}
    mock.control("reset 0")  # by an administrator: the Xid ends with it
    assert await next_report(updates) == {}
    await updates.aclose()  # type: ignore[attr-defined]


async def test_an_xid_on_a_gpu_that_was_never_lost_lasts(backend: NvmlBackend, mock: MockNvml) -> None:
    updates = watch(backend)
    assert await next_report(updates) == {}
    first, second = uuids(backend)
    mock.control("xid 1 48")
    assert await next_report(updates) == {second: (xid(48),)}
    mock.control("lose 0")  # another GPU changes, so a report follows
    assert await next_report(updates) == {second: (xid(48),), first: (Fault(FaultKind.GPU_LOST, T0),)}
    await updates.aclose()  # type: ignore[attr-defined]


async def test_a_gpu_without_xid_events_is_reported_unmonitored(backend: NvmlBackend, mock: MockNvml) -> None:
    mock.control("events 1 no-xid")  # its supported event types leave Xids out
    updates = watch(backend)
    first, second = uuids(backend)
    unmonitored = Fault(FaultKind.UNMONITORED, T0, detail="NVML offers no Xid events for this GPU")
    assert await next_report(updates) == {second: (unmonitored,)}
    mock.control("xid 1 79")  # not registered for: never seen
    mock.control("xid 0 79")
    assert await next_report(updates) == {first: (xid(79),), second: (unmonitored,)}
    await updates.aclose()  # type: ignore[attr-defined]


async def test_a_burst_of_events_is_reported_and_logged_once_per_fault(
    backend: NvmlBackend, mock: MockNvml
) -> None:
    updates = watch(backend)
    assert await next_report(updates) == {}
    first = uuids(backend)[0]
    with capture_logs() as logs:
        for _ in range(1000):
            mock.control("xid 0 94")
        mock.control("xid 0 95")
        report = await next_report(updates)
        while len(report.get(first, ())) < 2:
            report = await next_report(updates)
    assert report == {first: (xid(94), xid(95))}
    assert [entry["xid"] for entry in logs if entry["event"] == "critical Xid on a GPU"] == [94, 95]
    await updates.aclose()  # type: ignore[attr-defined]


async def test_an_xid_event_whose_gpu_nvml_cannot_name_is_logged_and_ignored(
    backend: NvmlBackend, mock: MockNvml
) -> None:
    updates = watch(backend)
    assert await next_report(updates) == {}
    second = uuids(backend)[1]
    mock.control("fail nvmlDeviceGetUUID 999 gpu=0 count=1")  # the event's device, asked its uuid
    with capture_logs() as logs:
        mock.control("xid 0 79")
        mock.control("xid 1 48")  # a known one after it, to know the first was handled
        assert await next_report(updates) == {second: (xid(48),)}
    (warning,) = [e for e in logs if e["event"].startswith("an Xid event names a GPU NVML cannot identify")]
    assert warning["xid"] == 79
    await updates.aclose()  # type: ignore[attr-defined]


async def test_stopping_frees_the_event_set_only_after_the_wait_returned(
    backend: NvmlBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    in_wait = 0
    waiting = threading.Event()
    freed_while_waiting: list[bool] = []
    wait, free = pynvml.nvmlEventSetWait, pynvml.nvmlEventSetFree

    def traced_wait(*args: Any) -> Any:
        nonlocal in_wait
        in_wait += 1
        waiting.set()
        try:
            return wait(*args)
        finally:
            in_wait -= 1

    def traced_free(event_set: Any) -> None:
        freed_while_waiting.append(in_wait > 0)
        free(event_set)

    monkeypatch.setattr(pynvml, "nvmlEventSetWait", traced_wait)
    monkeypatch.setattr(pynvml, "nvmlEventSetFree", traced_free)
    updates = open_health_source(backend, poll_seconds=0.5, clock=lambda: T0).watch()

    async def consume() -> None:
        async for _ in updates:
            pass

    task = asyncio.create_task(consume())
    assert await asyncio.to_thread(waiting.wait, GUARD_S)  # the worker thread now blocks in the wait
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert freed_while_waiting == [False]  # freed once, after NVML's wait had returned


async def test_a_lost_gpu_costs_one_wait_per_period_not_a_busy_loop(
    backend: NvmlBackend, mock: MockNvml, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = 0
    wait = pynvml.nvmlEventSetWait

    def counted(*args: Any) -> Any:
        nonlocal calls
        calls += 1
        return wait(*args)

    monkeypatch.setattr(pynvml, "nvmlEventSetWait", counted)
    updates = watch(backend)
    await next_report(updates)
    mock.control("lose 1")
    await next_report(updates)  # the GPU is reported lost; the watch goes on waiting
    calls = 0
    pending = asyncio.ensure_future(anext(updates))
    await asyncio.sleep(20 * POLL_S)  # about 20 periods
    pending.cancel()
    await asyncio.gather(pending, return_exceptions=True)
    # NVML answers GPU_IS_LOST at once: without waiting out the period this was thousands of calls.
    assert 1 <= calls <= 60
    await updates.aclose()  # type: ignore[attr-defined]


async def test_a_gpu_nvml_cannot_identify_is_unmonitored_until_it_can(
    backend: NvmlBackend, mock: MockNvml
) -> None:
    second = uuids(backend)[1]
    mock.control("fail nvmlDeviceGetUUID 999 gpu=1 count=1")
    updates = watch(backend)
    (only,) = (await next_report(updates))[second]
    assert only.kind is FaultKind.UNMONITORED
    assert "does not identify it" in only.detail
    assert await next_report(updates) == {}  # identified on the next period, and watched from then on
    mock.control("xid 1 79")
    assert await next_report(updates) == {second: (Fault(FaultKind.XID, T0, xid=79),)}
    await updates.aclose()  # type: ignore[attr-defined]


def test_the_nvml_backend_gets_the_nvml_health_source(backend: NvmlBackend) -> None:
    assert isinstance(open_health_source(backend), NvmlHealthSource)


async def test_xids_still_arrive_after_a_mig_mode_switch_reset_the_gpu(
    backend: NvmlBackend, mock: MockNvml
) -> None:
    mock.control("renumber on")  # the switch resets the GPU: its event registrations are gone
    updates = watch(backend)
    assert await next_report(updates) == {}
    first = uuids(backend)[0]
    with capture_logs() as logs:
        await asyncio.to_thread(backend.create_mig_device, first, 0, Placement(0, 1))
        pending = asyncio.ensure_future(anext(updates))
        for _ in range(int(GUARD_S / POLL_S)):  # the watch registers again in its next period
            if any("registered again" in entry["event"] for entry in logs):
                break
            await asyncio.sleep(POLL_S)
        else:
            pytest.fail("the health watch never registered the GPUs' events again")
    mock.control("xid 0 48")  # lost if the watch had kept the registrations the reset ended
    assert await asyncio.wait_for(pending, GUARD_S) == {first: (Fault(FaultKind.XID, T0, xid=48),)}
    await updates.aclose()  # type: ignore[attr-defined]


def bounded_watch(backend: NvmlBackend, call_timeout: float) -> AsyncIterator[NodeFaults]:
    return NvmlHealthSource(
        poll_seconds=POLL_S, clock=lambda: T0, known_gpus=backend.known_gpus(), call_timeout=call_timeout
    ).watch()


async def test_a_hanging_health_check_reports_every_gpu_unmonitored_until_nvml_answers(
    backend: NvmlBackend, mock: MockNvml
) -> None:
    updates = bounded_watch(backend, call_timeout=0.2)
    assert await next_report(updates) == {}
    with capture_logs() as logs:
        mock.control("hang nvmlDeviceGetMemoryInfo 1500 count=1")  # the lost-GPU check's call
        hung = await next_report(updates)
    assert sorted(hung) == uuids(backend)
    for faults in hung.values():
        (only,) = faults
        assert only.kind is FaultKind.UNMONITORED
        assert "checking which GPUs NVML reaches: NVML did not answer within 0.2s" in only.detail
    assert any(e["event"] == "nvml_call_timed_out" for e in logs)
    assert await next_report(updates) == {}  # the call returned: watched again
    mock.control("xid 0 79")
    assert await next_report(updates) == {uuids(backend)[0]: (Fault(FaultKind.XID, T0, xid=79),)}
    await updates.aclose()  # type: ignore[attr-defined]


async def test_a_registration_that_hangs_at_start_does_not_hold_up_the_watch(
    backend: NvmlBackend, mock: MockNvml
) -> None:
    mock.control("hang nvmlEventSetCreate 1500 count=1")
    updates = bounded_watch(backend, call_timeout=0.2)
    first = await next_report(updates)
    assert sorted(first) == uuids(backend)
    assert all(f.kind is FaultKind.UNMONITORED for faults in first.values() for f in faults)
    assert await next_report(updates) == {}  # registered once NVML answered
    await updates.aclose()  # type: ignore[attr-defined]


async def test_stopping_the_watch_during_a_hung_call_does_not_wait_for_it(
    backend: NvmlBackend, mock: MockNvml
) -> None:
    updates = bounded_watch(backend, call_timeout=0.2)
    assert await next_report(updates) == {}
    mock.control("hang nvmlDeviceGetMemoryInfo 60000 count=1")
    await next_report(updates)  # reported hung
    with capture_logs() as logs:  # the guard is half the minute the call hangs
        await asyncio.wait_for(updates.aclose(), GUARD_S)  # type: ignore[attr-defined]
    assert any("never returned" in e["event"] for e in logs)
    mock.control("clear-faults")


async def test_a_cancelled_watch_stops_even_when_the_cancel_meets_an_answer(
    backend: NvmlBackend, mock: MockNvml
) -> None:
    # Periods of a millisecond make an NVML answer and the cancellation arrive together often:
    # asyncio.wait_for on 3.11 swallowed such a cancellation and the watch ran on for good.
    for attempt in range(40):
        updates = open_health_source(backend, poll_seconds=0.001, clock=lambda: T0).watch()
        assert await next_report(updates) == {}
        pending = asyncio.ensure_future(anext(updates))
        await asyncio.sleep(0.001 * (attempt % 9))
        pending.cancel()
        done, _ = await asyncio.wait({pending}, timeout=5)
        assert done, f"the watch went on after it was cancelled (attempt {attempt + 1})"
        await updates.aclose()  # type: ignore[attr-defined]
