"""The device-health stream, and the board the app keeps health on."""

from __future__ import annotations

import asyncio
from types import ModuleType
from typing import Any

import grpc
import pytest

from dra_driver.devices.types import HealthState
from dra_driver.kubelet.health import DeviceHealthReport, HealthBoard
from dra_driver.kubelet.pb.health.v1 import health_pb2 as v1
from dra_driver.kubelet.pb.health.v1 import health_pb2_grpc as v1_grpc
from dra_driver.kubelet.pb.health.v1alpha1 import health_pb2 as v1alpha1
from dra_driver.kubelet.pb.health.v1alpha1 import health_pb2_grpc as v1alpha1_grpc

from .conftest import channel_to

API_VERSIONS = [
    pytest.param((v1alpha1, v1alpha1_grpc), id="v1alpha1"),
    pytest.param((v1, v1_grpc), id="v1"),
]
NEVER = 3600.0  # a resend interval no test lives to see


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _board(clock: Clock | None = None) -> HealthBoard:
    board = HealthBoard(timeout_seconds=45, clock=clock or Clock(1_700_000_000.5))
    board.set_devices("node-1", ["gpu-1", "gpu-0"])
    return board


def _summary(response: Any, pb: ModuleType) -> list[tuple[str, str, str, str]]:
    return [
        (d.device.pool_name, d.device.device_name, pb.HealthStatus.Name(d.health), d.message)
        for d in response.devices
    ]


def _watch(channel: grpc.aio.Channel, api: tuple[ModuleType, ModuleType]) -> Any:
    pb, pb_grpc = api
    return pb_grpc.DRAResourceHealthStub(channel).NodeWatchResources(pb.NodeWatchResourcesRequest())


# -- the board -------------------------------------------------------------------------------


def test_declared_devices_start_healthy_in_a_stable_order() -> None:
    snapshot = _board().snapshot()
    assert snapshot.devices == (
        DeviceHealthReport("node-1", "gpu-0", HealthState.HEALTHY, 1_700_000_000, timeout_seconds=45),
        DeviceHealthReport("node-1", "gpu-1", HealthState.HEALTHY, 1_700_000_000, timeout_seconds=45),
    )


def test_mark_records_state_message_and_time_and_moves_the_version() -> None:
    clock = Clock(1_700_000_000)
    board = _board(clock)
    before = board.snapshot().version
    clock.now = 1_700_000_060

    board.mark("node-1", "gpu-1", HealthState.UNHEALTHY, "XID 79: GPU has fallen off the bus")

    snapshot = board.snapshot()
    assert snapshot.version != before
    assert snapshot.devices[1] == DeviceHealthReport(
        "node-1", "gpu-1", HealthState.UNHEALTHY, 1_700_000_060, "XID 79: GPU has fallen off the bus", 45
    )
    assert snapshot.devices[0].last_updated == 1_700_000_000


def test_marking_the_same_state_again_is_no_change() -> None:
    board = _board()
    board.mark("node-1", "gpu-0", HealthState.UNHEALTHY, "XID 48")
    before = board.snapshot()
    board.mark("node-1", "gpu-0", HealthState.UNHEALTHY, "XID 48")
    assert board.snapshot() == before


def test_redeclaring_devices_keeps_known_states_adds_new_and_drops_gone() -> None:
    board = _board()
    board.mark("node-1", "gpu-1", HealthState.UNHEALTHY, "XID 79")

    board.set_devices("node-1", ["gpu-1", "gpu-1-mig-1g.10gb-0"], initial=HealthState.UNKNOWN)

    assert [(d.device, d.state) for d in board.snapshot().devices] == [
        ("gpu-1", HealthState.UNHEALTHY),
        ("gpu-1-mig-1g.10gb-0", HealthState.UNKNOWN),
    ]


def test_marking_an_undeclared_device_is_an_error() -> None:
    with pytest.raises(KeyError, match="node-1/gpu-7 is not on the health board"):
        _board().mark("node-1", "gpu-7", HealthState.UNHEALTHY)


async def test_wait_changed_returns_at_once_for_an_old_version_and_otherwise_on_the_next_change() -> None:
    board = _board()
    old = board.snapshot().version
    board.mark("node-1", "gpu-0", HealthState.UNHEALTHY)
    await board.wait_changed(old)  # already changed: must not block

    waiter = asyncio.create_task(board.wait_changed(board.snapshot().version))
    await asyncio.sleep(0)  # let the waiter start waiting
    assert not waiter.done()
    board.mark("node-1", "gpu-0", HealthState.HEALTHY)
    await waiter


# -- the stream ------------------------------------------------------------------------------


@pytest.mark.parametrize("api", API_VERSIONS)
async def test_the_first_message_is_the_complete_list(make_plugin: Any, api: Any) -> None:
    pb = api[0]
    board = _board()
    board.mark("node-1", "gpu-1", HealthState.UNHEALTHY, "x" * 2000)
    async with (
        make_plugin(health_feed=board, health_resend_interval=NEVER) as plugin,
        channel_to(plugin.dra_socket) as channel,
    ):
        call = _watch(channel, api)
        first = await call.read()
        call.cancel()

    gpu0, gpu1 = first.devices
    assert (gpu0.device.pool_name, gpu0.device.device_name, gpu0.health) == ("node-1", "gpu-0", pb.HEALTHY)
    assert (gpu1.device.device_name, gpu1.health) == ("gpu-1", pb.UNHEALTHY)
    assert gpu1.last_updated_time == 1_700_000_000
    assert gpu1.health_check_timeout_seconds == 45
    assert gpu1.message == "x" * 1024  # the kubelet's limit


@pytest.mark.parametrize("api", API_VERSIONS)
async def test_a_change_pushes_the_complete_list_again(make_plugin: Any, api: Any) -> None:
    pb = api[0]
    board = _board()
    async with (
        make_plugin(health_feed=board, health_resend_interval=NEVER) as plugin,
        channel_to(plugin.dra_socket) as channel,
    ):
        call = _watch(channel, api)
        first = await call.read()
        board.mark("node-1", "gpu-0", HealthState.UNHEALTHY, "XID 79")
        second = await call.read()
        call.cancel()

    assert _summary(first, pb) == [("node-1", "gpu-0", "HEALTHY", ""), ("node-1", "gpu-1", "HEALTHY", "")]
    assert _summary(second, pb) == [
        ("node-1", "gpu-0", "UNHEALTHY", "XID 79"),
        ("node-1", "gpu-1", "HEALTHY", ""),
    ]


async def test_the_list_is_resent_without_changes(make_plugin: Any) -> None:
    board = _board()
    async with (
        make_plugin(health_feed=board, health_resend_interval=0.01) as plugin,
        channel_to(plugin.dra_socket) as channel,
    ):
        call = _watch(channel, (v1, v1_grpc))
        first = await call.read()
        second = await call.read()
        call.cancel()

    assert second == first
    assert len(second.devices) == 2


@pytest.mark.parametrize("api", API_VERSIONS)
async def test_stop_ends_open_streams_cleanly(make_plugin: Any, api: Any) -> None:
    async with (
        make_plugin(health_feed=_board(), health_resend_interval=NEVER) as plugin,
        channel_to(plugin.dra_socket) as channel,
    ):
        call = _watch(channel, api)
        await call.read()
        await plugin.stop(grace=30)
        assert await call.read() is grpc.aio.EOF  # type: ignore[attr-defined]
        assert await call.code() is grpc.StatusCode.OK
