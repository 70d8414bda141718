"""NVML's health events on the mock libnvidia-ml.so.1: Xids, a lost GPU, a GPU NVML cannot identify."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pynvml
import pytest
from structlog.testing import capture_logs

from dra_driver.devices.health import Fault, FaultKind, NodeFaults, NvmlHealthSource, open_health_source
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


async def test_a_lost_gpu_is_reported_until_it_is_reset(backend: NvmlBackend, mock: MockNvml) -> None:
    updates = watch(backend)
    assert await next_report(updates) == {}
    mock.control("lose 0")
    first = uuids(backend)[0]
    assert await next_report(updates) == {first: (Fault(FaultKind.GPU_LOST, T0),)}
    mock.control("reset 0")
    assert await next_report(updates) == {}
    await updates.aclose()  # type: ignore[attr-defined]


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
