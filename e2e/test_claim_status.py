"""status.devices as the real API server takes it from the driver's writer (no driver process needed)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes.aio.client import ApiClient, Configuration

from dra_driver.node.claim_status import (
    ALLOCATION_BYTES_REASON,
    ApiServerClaimStatus,
    StatusWriteError,
    refusal_reason,
)
from dra_driver.node.types import ClaimRef
from e2e import manifests
from e2e.cluster import ClusterInfo, FakeNodeFactory, JsonObject, RestClient
from e2e.cluster.rest import kubectl_json
from e2e.driver import DRIVER_NAME as DRIVER

pytestmark = pytest.mark.cluster

CLAIMS = "/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims"


def _aio(cluster: ClusterInfo) -> ApiClient:
    configuration = Configuration(
        host=cluster.server,
        api_key={"BearerToken": cluster.admin_token},
        api_key_prefix={"BearerToken": "Bearer"},
        ssl_ca_cert=str(cluster.ca_file),
    )
    return ApiClient(configuration)


def _allocated_claim(rest: RestClient, namespace: str, name: str, node_name: str) -> ClaimRef:
    """A claim allocated gpu-0 of the node and a NIC of another driver, as the scheduler would leave it."""
    collection = CLAIMS.format(namespace=namespace)
    requests = [{"name": "gpu", "exactly": {"deviceClassName": "gpu.dra-driver.dev"}}]
    claim = rest.create(collection, {"metadata": {"name": name}, "spec": {"devices": {"requests": requests}}})
    node_selector = {
        "nodeSelectorTerms": [
            {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node_name]}]}
        ]
    }
    allocation = {
        "devices": {
            "results": [
                {"request": "gpu", "driver": DRIVER, "pool": node_name, "device": "gpu-0"},
                {"request": "gpu", "driver": "nic.example.com", "pool": node_name, "device": "nic-0"},
            ]
        },
        "nodeSelector": node_selector,
    }
    rest.request(
        "PATCH",
        f"{collection}/{name}/status",
        {"status": {"allocation": allocation}},
        content_type="application/merge-patch+json",
    )
    return ClaimRef(namespace, name, claim["metadata"]["uid"])


def _entry(node_name: str, gpu_uuid: str) -> dict[str, Any]:
    return {
        "driver": DRIVER,
        "pool": node_name,
        "device": "gpu-0",
        "data": {"uuid": gpu_uuid},
        "conditions": [
            {
                "type": "Healthy",
                "status": "True",
                "reason": "NoFault",
                "message": "no fault reported for the GPU",
                "lastTransitionTime": "2027-01-15T08:00:00Z",
            }
        ],
    }


async def test_the_api_server_stores_the_status_as_applied_and_keeps_other_writers_fields(
    cluster: ClusterInfo, rest: RestClient, namespace: str
) -> None:
    ref = _allocated_claim(rest, namespace, "claim", "status-node")
    nic = {"driver": "nic.example.com", "pool": "status-node", "device": "nic-0", "data": {"mac": "x"}}
    async with _aio(cluster) as client:
        api = ApiServerClaimStatus(client)
        await api.apply_status(ref, [_entry("status-node", "GPU-1")], DRIVER)
        await api.apply_status(ref, [nic], "nic.example.com")  # another driver's entry, its own manager
        await api.apply_status(ref, [_entry("status-node", "GPU-2")], DRIVER)
    stored = rest.get(f"{CLAIMS.format(namespace=namespace)}/claim")["status"]["devices"]
    ours, theirs = sorted(stored, key=lambda entry: entry["driver"])
    assert ours == _entry("status-node", "GPU-2")
    assert (theirs["driver"], theirs["data"]) == ("nic.example.com", {"mac": "x"})


async def test_the_status_of_a_replaced_or_deleted_claim_is_refused(
    cluster: ClusterInfo, rest: RestClient, namespace: str
) -> None:
    ref = _allocated_claim(rest, namespace, "claim", "status-node")
    async with _aio(cluster) as client:
        api = ApiServerClaimStatus(client)
        with pytest.raises(StatusWriteError) as replaced:
            await api.apply_status(
                ClaimRef(namespace, "claim", str(uuid.uuid4())), [_entry("status-node", "GPU-1")], DRIVER
            )
        with pytest.raises(StatusWriteError) as missing:
            await api.apply_status(
                ClaimRef(namespace, "no-such-claim", ref.uid), [_entry("status-node", "GPU-1")], DRIVER
            )
    async with ApiClient(Configuration(host="https://127.0.0.1:1")) as nowhere:
        with pytest.raises(StatusWriteError) as unreachable:
            await ApiServerClaimStatus(nowhere).apply_status(ref, [], DRIVER)
    assert replaced.value.status == 422
    assert "uid" in str(replaced.value)
    assert missing.value.status == 404
    assert unreachable.value.status == 0


# --- a claim whose opaque config the API server keeps in bytes it will not take back -------------------
#
# The API server keeps `opaque.parameters` as the bytes it was sent; the scheduler copies them into the
# allocation; every later status write decodes the claim into a map and encodes it again, in Go's JSON
# (compact, keys sorted), and the immutability check then finds the allocation changed. kubectl and
# Helm send Go's JSON, so their claims are spared; json.dumps (the Python clients) is not.

CONFIG_DRIVER = "config.example.com"
CONFIG_NODE = "config-node"
PARAMETERS = {"kind": "GpuConfig", "apiVersion": "example.com/v1", "sharing": {"strategy": "TimeSlicing"}}
ENCODINGS = {
    "as kubectl sends it": kubectl_json,
    "as json.dumps writes it": lambda body: json.dumps(body).encode(),
    "compact, keys unsorted": lambda body: json.dumps(body, separators=(",", ":")).encode(),
}


@pytest.fixture
def config_driver_node(rest: RestClient, fake_node: FakeNodeFactory) -> Iterator[str]:
    """A Ready node publishing four devices of a driver of this test's own, and its DeviceClass."""
    fake_node(CONFIG_NODE)
    device_class = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": CONFIG_DRIVER},
        "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{CONFIG_DRIVER}"'}}]},
    }
    resource_slice = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": CONFIG_NODE},
        "spec": {
            "driver": CONFIG_DRIVER,
            "nodeName": CONFIG_NODE,
            "pool": {"name": CONFIG_NODE, "generation": 1, "resourceSliceCount": 1},
            "devices": [{"name": f"dev-{i}"} for i in range(4)],
        },
    }
    with manifests.created(rest, [device_class, resource_slice]):
        yield CONFIG_NODE


def _claim_with_config(name: str) -> JsonObject:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name},
        "spec": {
            "devices": {
                "requests": [{"name": "dev", "exactly": {"deviceClassName": CONFIG_DRIVER}}],
                "config": [
                    {"requests": ["dev"], "opaque": {"driver": CONFIG_DRIVER, "parameters": PARAMETERS}}
                ],
            }
        },
    }


@pytest.mark.parametrize("encoding", list(ENCODINGS))
async def test_the_status_of_a_claim_allocated_with_a_config_not_sent_as_kubectl_sends_it_is_refused(
    cluster: ClusterInfo, rest: RestClient, namespace: str, config_driver_node: str, encoding: str
) -> None:
    """Upstream behaviour this driver lives with (docs/binding-conditions.md); seen on 1.34 to 1.37."""
    collection = CLAIMS.format(namespace=namespace)
    rest.request("POST", collection, ENCODINGS[encoding](_claim_with_config("claim")))
    pod = {
        "metadata": {"name": "pod"},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": config_driver_node},
            "resourceClaims": [{"name": "dev", "resourceClaimName": "claim"}],
            "containers": [
                {"name": "app", "image": "ubuntu:24.04", "resources": {"claims": [{"name": "dev"}]}}
            ],
        },
    }
    rest.create(f"/api/v1/namespaces/{namespace}/pods", pod)
    claim = rest.wait_for(collection, "claim", lambda c: bool((c.get("status") or {}).get("allocation")))
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    (config,) = claim["status"]["allocation"]["devices"]["config"]
    assert config["opaque"]["parameters"] == PARAMETERS  # the same value, whatever its bytes
    entry = {**_entry(result["pool"], "GPU-1"), "driver": CONFIG_DRIVER, "device": result["device"]}
    ref = ClaimRef(namespace, "claim", claim["metadata"]["uid"])
    async with _aio(cluster) as client:
        api = ApiServerClaimStatus(client)
        if encoding == "as kubectl sends it":
            await api.apply_status(ref, [entry], CONFIG_DRIVER)
            assert rest.get(f"{collection}/claim")["status"]["devices"] == [entry]
            return
        with pytest.raises(StatusWriteError) as refused:
            await api.apply_status(ref, [entry], CONFIG_DRIVER)
    assert refused.value.status == 422
    assert refusal_reason(refused.value) == ALLOCATION_BYTES_REASON, str(refused.value)
    assert "devices" not in rest.get(f"{collection}/claim")["status"]
