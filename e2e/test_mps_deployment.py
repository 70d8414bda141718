"""A real node's MPS control daemons, as Deployments, against the real API server and controllers.

No kubelet runs pods here, so the test plays the kubelet's part the API server sees: it reports the
daemon pod's container ready (or exited) in the pod's status, as a kubelet would. Everything else is
real: the API server validates the Deployment the plugin creates, the deployment and replica-set
controllers make its pod and count it ready, and the garbage collector removes it when it is stopped.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from kubernetes.aio.client import ApiClient, Configuration

from dra_driver.apiserver.rest import JsonApi
from dra_driver.node.sharing.mps import MpsDaemonError, MpsDaemonSpec, MpsDevice, daemon_id
from dra_driver.node.sharing.mps_deployment import (
    CLAIM_LABEL,
    NODE_LABEL,
    DeploymentMpsDaemons,
    deployment_name,
)
from e2e.cluster import JsonObject, RestClient

pytestmark = pytest.mark.cluster
GPU = "GPU-5b6c7d8e-0000-4000-8000-000000000001"


@pytest.fixture
def node(fake_node: Callable[..., Any]) -> Any:
    return fake_node(f"mps-node-{uuid.uuid4().hex[:6]}")


@pytest.fixture
async def client(cluster: Any) -> AsyncIterator[ApiClient]:
    configuration = Configuration(
        host=cluster.server,
        api_key={"BearerToken": cluster.admin_token},
        api_key_prefix={"BearerToken": "Bearer"},
        ssl_ca_cert=str(cluster.ca_file),
    )
    async with ApiClient(configuration) as api:
        yield api


def spec() -> MpsDaemonSpec:
    claim_uid = str(uuid.uuid4())
    return MpsDaemonSpec(
        id=daemon_id(claim_uid, ["gpu-0"]),
        claim_uid=claim_uid,
        claim="team-a/inference",
        devices=(MpsDevice(GPU, 10 * 2**30),),
        active_thread_percentage=30,
    )


def daemon_pod(rest: RestClient, namespace: str, daemon: MpsDaemonSpec) -> JsonObject:
    """The pod the controllers made for the daemon, once they have."""

    def pods() -> list[JsonObject]:
        listed = rest.request(
            "GET",
            f"/api/v1/namespaces/{namespace}/pods",
            query={"labelSelector": f"{CLAIM_LABEL}={daemon.claim_uid}"},
        )
        items: list[JsonObject] = listed["items"]
        return items

    for _ in range(600):
        if found := pods():
            return found[0]
        time.sleep(0.1)
    raise AssertionError("the deployment controller made no pod for the MPS daemon")


def report(rest: RestClient, namespace: str, pod: JsonObject, container: dict[str, Any], ready: bool) -> None:
    """What the kubelet would write into the pod's status."""
    status = {
        "phase": "Running",
        "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        "containerStatuses": [
            {
                "name": "mps-control-daemon",
                "image": pod["spec"]["containers"][0]["image"],
                "imageID": "",
                "ready": ready,
                "restartCount": 0 if ready else 1,
                **container,
            }
        ],
    }
    rest.request(
        "PATCH",
        f"/api/v1/namespaces/{namespace}/pods/{pod['metadata']['name']}/status",
        {"status": status},
        content_type="application/merge-patch+json",
    )


async def test_the_daemon_deployment_is_accepted_made_ready_and_removed(
    client: ApiClient, rest: RestClient, namespace: str, node: Any, tmp_path: Path
) -> None:
    name = node.metadata.name
    daemons = DeploymentMpsDaemons(
        JsonApi(client),
        namespace=namespace,
        node_name=name,
        image="registry.example.com/dra-driver-gpu:test",
        driver_root="/",
        root=tmp_path / "mps",
        mount_shm=False,
    )
    daemon = spec()
    paths = await daemons.start(daemon)
    assert await daemons.start(daemon) == paths  # idempotent
    assert paths.pipe.is_dir()
    assert paths.shm.is_dir()

    stored = await asyncio.to_thread(
        rest.get, f"/apis/apps/v1/namespaces/{namespace}/deployments/{deployment_name(daemon.id)}"
    )
    assert stored["metadata"]["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "Node", "name": name, "uid": node.metadata.uid}
    ]
    assert stored["metadata"]["labels"][NODE_LABEL] == name
    template = stored["spec"]["template"]["spec"]
    assert template["nodeName"] == name
    (container,) = template["containers"]
    assert {"name": "CUDA_VISIBLE_DEVICES", "value": GPU} in container["env"]
    script = container["args"][0]
    assert 'chroot /driver-root sh -c "nvidia-cuda-mps-control -d"' in script
    assert "set_default_active_thread_percentage 30" in script
    assert f"set_default_device_pinned_mem_limit {GPU} 10240M" in script
    volumes = {v["name"]: v["hostPath"]["path"] for v in template["volumes"]}
    assert volumes["mps-pipe"] == str(paths.pipe)
    assert await daemons.running() == {daemon.id}

    pod = await asyncio.to_thread(daemon_pod, rest, namespace, daemon)
    with pytest.raises(MpsDaemonError, match="was not ready within 1s"):
        await daemons.wait_ready(daemon, timeout_s=1)
    await asyncio.to_thread(report, rest, namespace, pod, {"state": {"running": {}}}, True)
    await daemons.wait_ready(daemon, timeout_s=60)

    await daemons.stop(daemon.id)
    assert not paths.root.exists()
    gone = await asyncio.to_thread(
        rest.request,
        "GET",
        f"/apis/apps/v1/namespaces/{namespace}/deployments",
        query={"labelSelector": f"{CLAIM_LABEL}={daemon.claim_uid}"},
    )
    assert all(item["metadata"].get("deletionTimestamp") for item in gone["items"])
    await daemons.stop(daemon.id)  # idempotent


async def test_a_daemon_that_exits_fails_with_its_reason(
    client: ApiClient, rest: RestClient, namespace: str, node: Any, tmp_path: Path
) -> None:
    daemons = DeploymentMpsDaemons(
        JsonApi(client),
        namespace=namespace,
        node_name=node.metadata.name,
        image="registry.example.com/dra-driver-gpu:test",
        driver_root="/",
        root=tmp_path / "mps",
        mount_shm=False,
    )
    daemon = spec()
    await daemons.start(daemon)
    pod = await asyncio.to_thread(daemon_pod, rest, namespace, daemon)
    exited = {"exitCode": 1, "reason": "Error", "message": "nvidia-cuda-mps-control: not found"}
    await asyncio.to_thread(
        report,
        rest,
        namespace,
        pod,
        {"state": {"waiting": {"reason": "CrashLoopBackOff"}}, "lastState": {"terminated": exited}},
        False,
    )
    with pytest.raises(MpsDaemonError, match="failed: CrashLoopBackOff"):
        await daemons.wait_ready(daemon, timeout_s=60)
    await daemons.stop(daemon.id)
