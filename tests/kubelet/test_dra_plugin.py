"""NodePrepareResources / NodeUnprepareResources through a real socket, v1 and v1beta1."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest
from structlog.testing import capture_logs

from dra_driver.kubelet.pb.dra.v1 import dra_pb2 as v1
from dra_driver.kubelet.pb.dra.v1 import dra_pb2_grpc as v1_grpc
from dra_driver.kubelet.pb.dra.v1beta1 import dra_pb2 as v1beta1
from dra_driver.kubelet.pb.dra.v1beta1 import dra_pb2_grpc as v1beta1_grpc
from dra_driver.node.types import ClaimError, ClaimRef, PreparedDevice

from .conftest import ScriptedPreparer, channel_to

API_VERSIONS = [pytest.param((v1, v1_grpc), id="v1"), pytest.param((v1beta1, v1beta1_grpc), id="v1beta1")]

CLAIM_A = ClaimRef(namespace="team-a", name="train", uid="uid-a")
CLAIM_B = ClaimRef(namespace="team-b", name="infer", uid="uid-b")

GPU0 = PreparedDevice(
    requests=("gpu",),
    pool="node-1",
    device="gpu-0",
    cdi_device_ids=("k8s.gpu.dra-driver.dev/claim=uid-a-gpu-0",),
)
SHARED_GPU1 = PreparedDevice(
    requests=(),
    pool="node-1",
    device="gpu-1",
    cdi_device_ids=("k8s.gpu.dra-driver.dev/claim=uid-a-gpu-1", "k8s.gpu.dra-driver.dev/claim=uid-a-common"),
    share_id="4f1c0b2e-share",
)


def _claims(pb: ModuleType, *refs: ClaimRef) -> list[Any]:
    return [pb.Claim(namespace=r.namespace, name=r.name, uid=r.uid) for r in refs]


async def _prepare(plugin: Any, api: tuple[ModuleType, ModuleType], *refs: ClaimRef) -> Any:
    pb, pb_grpc = api
    async with channel_to(plugin.dra_socket) as channel:
        return await pb_grpc.DRAPluginStub(channel).NodePrepareResources(
            pb.NodePrepareResourcesRequest(claims=_claims(pb, *refs))
        )


async def _unprepare(plugin: Any, api: tuple[ModuleType, ModuleType], *refs: ClaimRef) -> Any:
    pb, pb_grpc = api
    async with channel_to(plugin.dra_socket) as channel:
        return await pb_grpc.DRAPluginStub(channel).NodeUnprepareResources(
            pb.NodeUnprepareResourcesRequest(claims=_claims(pb, *refs))
        )


@pytest.mark.parametrize("api", API_VERSIONS)
async def test_prepare_passes_claim_identities_to_the_preparer(make_plugin: Any, api: Any) -> None:
    preparer = ScriptedPreparer(prepared={CLAIM_A.uid: (), CLAIM_B.uid: ()})
    async with make_plugin(preparer) as plugin:
        await _prepare(plugin, api, CLAIM_A, CLAIM_B)
    assert preparer.prepare_calls == [[CLAIM_A, CLAIM_B]]


@pytest.mark.parametrize("api", API_VERSIONS)
async def test_prepare_reports_devices_and_errors_per_claim(make_plugin: Any, api: Any) -> None:
    preparer = ScriptedPreparer(
        prepared={
            CLAIM_A.uid: (GPU0, SHARED_GPU1),
            CLAIM_B.uid: ClaimError("claim team-b/infer is not allocated"),
        }
    )
    async with make_plugin(preparer) as plugin:
        response = await _prepare(plugin, api, CLAIM_A, CLAIM_B)

    assert set(response.claims) == {CLAIM_A.uid, CLAIM_B.uid}
    a = response.claims[CLAIM_A.uid]
    assert a.error == ""
    assert [
        (list(d.request_names), d.pool_name, d.device_name, list(d.cdi_device_ids)) for d in a.devices
    ] == [
        (["gpu"], "node-1", "gpu-0", ["k8s.gpu.dra-driver.dev/claim=uid-a-gpu-0"]),
        (
            [],
            "node-1",
            "gpu-1",
            ["k8s.gpu.dra-driver.dev/claim=uid-a-gpu-1", "k8s.gpu.dra-driver.dev/claim=uid-a-common"],
        ),
    ]
    b = response.claims[CLAIM_B.uid]
    assert b.error == "claim team-b/infer is not allocated"
    assert list(b.devices) == []


async def test_v1_sets_share_id_only_when_the_device_has_one(make_plugin: Any) -> None:
    preparer = ScriptedPreparer(prepared={CLAIM_A.uid: (GPU0, SHARED_GPU1)})
    async with make_plugin(preparer) as plugin:
        response = await _prepare(plugin, (v1, v1_grpc), CLAIM_A)

    unshared, shared = response.claims[CLAIM_A.uid].devices
    assert not unshared.HasField("share_id")
    assert shared.HasField("share_id")
    assert shared.share_id == "4f1c0b2e-share"


async def test_v1beta1_devices_carry_no_share_id(make_plugin: Any) -> None:
    preparer = ScriptedPreparer(prepared={CLAIM_A.uid: (SHARED_GPU1,)})
    async with make_plugin(preparer) as plugin:
        response = await _prepare(plugin, (v1beta1, v1beta1_grpc), CLAIM_A)

    (device,) = response.claims[CLAIM_A.uid].devices
    assert device.device_name == "gpu-1"
    assert "share_id" not in v1beta1.Device.DESCRIPTOR.fields_by_name


async def test_a_claim_without_devices_still_gets_an_entry(make_plugin: Any) -> None:
    preparer = ScriptedPreparer(prepared={CLAIM_A.uid: ()})
    async with make_plugin(preparer) as plugin:
        response = await _prepare(plugin, (v1, v1_grpc), CLAIM_A)

    assert CLAIM_A.uid in response.claims
    assert response.claims[CLAIM_A.uid].error == ""


@pytest.mark.parametrize("api", API_VERSIONS)
async def test_a_preparer_exception_fails_each_claim_not_the_call(make_plugin: Any, api: Any) -> None:
    preparer = ScriptedPreparer(raises=RuntimeError("checkpoint file is corrupt"))
    with capture_logs() as logs:
        async with make_plugin(preparer) as plugin:
            response = await _prepare(plugin, api, CLAIM_A, CLAIM_B)

    assert set(response.claims) == {CLAIM_A.uid, CLAIM_B.uid}
    for entry in response.claims.values():
        assert "RuntimeError: checkpoint file is corrupt" in entry.error
        assert list(entry.devices) == []
    (logged,) = [e for e in logs if e["event"] == "preparer raised"]
    assert logged["log_level"] == "error"
    assert logged["operation"] == "prepare"
    assert logged["exc_info"] is True


async def test_a_claim_the_preparer_skipped_gets_an_error_and_unrequested_ones_are_dropped(
    make_plugin: Any,
) -> None:
    preparer = ScriptedPreparer(prepared={CLAIM_A.uid: (GPU0,), "uid-nobody-asked": ()})
    async with make_plugin(preparer) as plugin:
        response = await _prepare(plugin, (v1, v1_grpc), CLAIM_A, CLAIM_B)

    assert set(response.claims) == {CLAIM_A.uid, CLAIM_B.uid}
    assert response.claims[CLAIM_A.uid].error == ""
    assert "no result for this claim" in response.claims[CLAIM_B.uid].error


async def test_an_error_without_a_message_still_fails_the_claim(make_plugin: Any) -> None:
    preparer = ScriptedPreparer(prepared={CLAIM_A.uid: ClaimError("")})
    async with make_plugin(preparer) as plugin:
        response = await _prepare(plugin, (v1, v1_grpc), CLAIM_A)

    assert response.claims[CLAIM_A.uid].error != ""


@pytest.mark.parametrize("api", API_VERSIONS)
async def test_unprepare_reports_success_and_errors_per_claim(make_plugin: Any, api: Any) -> None:
    preparer = ScriptedPreparer(
        unprepared={CLAIM_A.uid: None, CLAIM_B.uid: ClaimError("cannot delete MIG device: in use")}
    )
    async with make_plugin(preparer) as plugin:
        response = await _unprepare(plugin, api, CLAIM_A, CLAIM_B)

    assert preparer.unprepare_calls == [[CLAIM_A, CLAIM_B]]
    assert {uid: entry.error for uid, entry in response.claims.items()} == {
        CLAIM_A.uid: "",
        CLAIM_B.uid: "cannot delete MIG device: in use",
    }


@pytest.mark.parametrize("api", API_VERSIONS)
async def test_an_unprepare_exception_fails_each_claim_not_the_call(make_plugin: Any, api: Any) -> None:
    preparer = ScriptedPreparer(raises=OSError("read-only file system"))
    async with make_plugin(preparer) as plugin:
        response = await _unprepare(plugin, api, CLAIM_A, CLAIM_B)

    assert set(response.claims) == {CLAIM_A.uid, CLAIM_B.uid}
    assert all("read-only file system" in entry.error for entry in response.claims.values())
