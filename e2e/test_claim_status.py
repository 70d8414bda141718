"""status.devices as the real API server takes it from the driver's writer (no driver process needed)."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from kubernetes.aio.client import ApiClient, Configuration

from dra_driver.node.claim_status import ApiServerClaimStatus, StatusWriteError
from dra_driver.node.types import ClaimRef
from e2e.cluster import ClusterInfo, RestClient
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
