"""A plugin that registers before its preparer is ready, as the kubelet sees it over the sockets."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from dra_driver.kubelet.deferred import DeferredPreparer
from dra_driver.kubelet.pb.dra.v1 import dra_pb2 as v1
from dra_driver.kubelet.pb.dra.v1 import dra_pb2_grpc as v1_grpc
from dra_driver.kubelet.pb.pluginregistration import registration_pb2 as reg
from dra_driver.kubelet.pb.pluginregistration import registration_pb2_grpc as reg_grpc
from dra_driver.node.types import ClaimRef, PreparedDevice

from .conftest import ScriptedPreparer, channel_to

CLAIM = ClaimRef(namespace="team-a", name="train", uid="uid-a")
GPU0 = PreparedDevice(
    requests=("gpu",), pool="node-1", device="gpu-0", cdi_device_ids=("k8s.gpu.dra-driver.dev/claim=uid-a",)
)
REQUEST = v1.NodePrepareResourcesRequest(claims=[v1.Claim(namespace="team-a", name="train", uid="uid-a")])
UNPREPARE = v1.NodeUnprepareResourcesRequest(claims=[v1.Claim(namespace="team-a", name="train", uid="uid-a")])


async def _register(plugin: Any) -> None:
    """What the kubelet's plugin watcher does when the registration socket appears."""
    async with channel_to(plugin.registration_socket) as channel:
        stub = reg_grpc.RegistrationStub(channel)
        info = await stub.GetInfo(reg.InfoRequest(), timeout=1)
        assert info.endpoint == str(plugin.dra_socket)
        await stub.NotifyRegistrationStatus(reg.RegistrationStatus(plugin_registered=True), timeout=5)


async def test_a_prepare_sent_right_after_registration_waits_and_succeeds_once_ready(
    make_plugin: Any,
) -> None:
    deferred = DeferredPreparer()
    real = ScriptedPreparer(prepared={CLAIM.uid: (GPU0,)})
    async with make_plugin(deferred) as plugin:
        await _register(plugin)  # answered at once: registration does not wait for the preparer
        async with channel_to(plugin.dra_socket) as channel:
            call = asyncio.ensure_future(
                v1_grpc.DRAPluginStub(channel).NodePrepareResources(REQUEST, timeout=30)
            )
            await asyncio.sleep(0.3)
            assert not call.done(), "the prepare was answered before the daemon was ready"
            assert real.prepare_calls == []
            deferred.ready(real)
            response = await call
    assert response.claims[CLAIM.uid].error == ""
    assert [d.device_name for d in response.claims[CLAIM.uid].devices] == ["gpu-0"]
    assert real.prepare_calls == [[CLAIM]]


async def test_an_unprepare_held_at_start_reaches_the_real_preparer(make_plugin: Any) -> None:
    deferred = DeferredPreparer()
    real = ScriptedPreparer(unprepared={CLAIM.uid: None})
    async with make_plugin(deferred) as plugin, channel_to(plugin.dra_socket) as channel:
        call = asyncio.ensure_future(
            v1_grpc.DRAPluginStub(channel).NodeUnprepareResources(UNPREPARE, timeout=30)
        )
        await asyncio.sleep(0.1)
        deferred.ready(real)
        response = await call
    assert response.claims[CLAIM.uid].error == ""
    assert real.unprepare_calls == [[CLAIM]]


async def test_a_failed_start_answers_held_calls_with_its_error(make_plugin: Any) -> None:
    deferred = DeferredPreparer()
    async with make_plugin(deferred) as plugin, channel_to(plugin.dra_socket) as channel:
        stub = v1_grpc.DRAPluginStub(channel)
        held = asyncio.ensure_future(stub.NodePrepareResources(REQUEST, timeout=30))
        await asyncio.sleep(0.1)
        deferred.failed("cannot read kubeconfig /etc/kube.conf")
        response = await held
        later = await stub.NodePrepareResources(REQUEST, timeout=5)
    for answer in (response, later):
        assert answer.claims[CLAIM.uid].error == (
            "the DRA driver failed to start: cannot read kubeconfig /etc/kube.conf"
        )


async def test_a_held_call_ends_at_its_deadline_and_the_plugin_serves_on(make_plugin: Any) -> None:
    deferred = DeferredPreparer()
    real = ScriptedPreparer(prepared={CLAIM.uid: (GPU0,)})
    async with make_plugin(deferred) as plugin, channel_to(plugin.dra_socket) as channel:
        stub = v1_grpc.DRAPluginStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as expired:
            await stub.NodePrepareResources(REQUEST, timeout=0.2)
        assert expired.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        # The server cancels the handler when it sees the deadline pass, a moment after the client.
        for _ in range(500):
            if deferred.held == 0:
                break
            await asyncio.sleep(0.01)
        assert deferred.held == 0, "the expired call is still held"
        deferred.ready(real)
        response = await stub.NodePrepareResources(REQUEST, timeout=5)
    assert response.claims[CLAIM.uid].error == ""
    assert real.prepare_calls == [[CLAIM]], "the expired call must not be prepared behind the kubelet's back"
