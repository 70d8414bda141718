"""Consumable capacity end to end: several claims share one GPU, each with its memory.

The driver publishes the simulated DGX H100's GPUs as shareable (--consumable-capacity), the real
kube-scheduler packs the claims of docs/examples/consumable-capacity/ onto a GPU and records each
share, the kubelet's own DRA code prepares them through the driver, and the tests check what the
containers get (one CDI device per share, the share's MPS limits) and what the scheduler refuses:
more memory than is left, a request the policy does not allow, and an exclusive claim beside shares.
With the validating webhook (run with the chart's webhook account alone), a request no GPU could
ever take is refused when the claim is created instead, and one the policy rounds up still runs.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from dra_driver.cdi.spec import cdi_device_id
from e2e import manifests
from e2e.claims import claim_for_gpu, claim_of, gpu_uuid, pod_using, wait_unschedulable
from e2e.cluster import ApiError, ClusterInfo, JsonObject, RestClient
from e2e.cluster.features import kube_minor
from e2e.daemon import wait_until
from e2e.driver import DRIVER_NAME
from e2e.gpu_node import GpuNode, published_devices
from e2e.manifests import collection
from e2e.webhook import chart_webhook_kubeconfig, label_namespace, running_webhook
from e2e.workloads import cdi_devices, delete_pod, pod_claim, wait_running

pytestmark = pytest.mark.e2e

EXAMPLES = manifests.EXAMPLES / "consumable-capacity"
GIB = 2**30


@pytest.fixture(scope="module")
def gpu_node(
    cluster: ClusterInfo,
    kubelet_harness_binary: Path,
    gpu_device_class: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[GpuNode]:
    """A simulated DGX H100 whose full GPUs are shareable."""
    name = "node-consumable-capacity"
    node = GpuNode(
        cluster,
        kubelet_harness_binary,
        tmp_path_factory.mktemp(name),
        name,
        driver_args=["--consumable-capacity"],
    )
    with node.running():
        yield node


def share_of(claim: JsonObject) -> JsonObject:
    """The claim's one allocation result: device, shareID, consumedCapacity."""
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    assert result["driver"] == DRIVER_NAME
    return dict(result)


def claim_spec(node: GpuNode, claim: JsonObject) -> JsonObject:
    spec: JsonObject = json.loads(node.driver.spec_path(claim["metadata"]["uid"]).read_text())
    return spec


def claim_env(spec: JsonObject) -> dict[str, str]:
    return dict(variable.split("=", 1) for variable in spec["containerEdits"]["env"])


def sized_claim(name: str, uuid: str, memory: str | None) -> JsonObject:
    """A claim for GPU ``uuid``, asking for ``memory`` of it (None: no capacity request)."""
    claim = claim_for_gpu(name, uuid)
    if memory is not None:
        claim["spec"]["devices"]["requests"][0]["exactly"]["capacity"] = {"requests": {"memory": memory}}
    return claim


def run(rest: RestClient, node: GpuNode, namespace: str, name: str, uuid: str, memory: str | None) -> None:
    objects = [sized_claim(name, uuid, memory), pod_using(name, name)]
    manifests.apply(rest, manifests.pinned(objects, node.name), namespace)


def test_the_node_publishes_shareable_gpus_that_pass_api_validation(node: GpuNode) -> None:
    devices = published_devices(node.rest, node.name)
    gpus = {name: d for name, d in devices.items() if d["attributes"]["type"] == {"string": "gpu"}}
    assert len(gpus) == 8
    for device in gpus.values():
        assert device["allowMultipleAllocations"] is True
        memory = device["capacity"]["memory"]
        assert memory["requestPolicy"]["validRange"] == {"min": "1Gi", "max": "79Gi", "step": "1Gi"}
        assert memory["requestPolicy"]["default"] == "79Gi"
        assert device["consumesCounters"]  # still one with its MIG placements' counters


def scheduler_packs_shares(kube_version: str) -> bool:
    """Whether the scheduler packs shares onto the GPU it tried first. From 1.36 its allocator visits
    a pool's slices by name, so every claim tries the same GPU first; before, in the order its
    informer lists them, which changes between scheduling cycles, so claims that fit anywhere may
    each land on another GPU (correctly, but not packed)."""
    return kube_minor(kube_version) >= 36


def kept_to_gpu(objects: list[JsonObject], uuid: str) -> list[JsonObject]:
    """The example with its claim template's request kept to the GPU with ``uuid``."""
    for template in manifests.of_kind(objects, "ResourceClaimTemplate"):
        (request,) = template["spec"]["spec"]["devices"]["requests"]
        expression = f'device.attributes["{DRIVER_NAME}"].uuid == "{uuid}"'
        request["exactly"]["selectors"] = [{"cel": {"expression": expression}}]
    return objects


def test_claims_of_10gi_are_packed_onto_one_gpu_each_with_its_own_cdi_device_and_limit(
    rest: RestClient, cluster: ClusterInfo, node: GpuNode, namespace: str
) -> None:
    objects = manifests.load(EXAMPLES / "inference.yaml")
    if not scheduler_packs_shares(cluster.kube_version):  # one GPU to share, as packing would give
        objects = kept_to_gpu(objects, gpu_uuid(node, 0))
    manifests.apply(rest, manifests.pinned(objects, node.name), namespace)

    pods = {
        name: wait_running(rest, namespace, name) for name in ("inference-1", "inference-2", "inference-3")
    }
    claims = {name: pod_claim(rest, pod, "gpu") for name, pod in pods.items()}
    shares = {name: share_of(claim) for name, claim in claims.items()}
    assert len({share["device"] for share in shares.values()}) == 1  # packed: one GPU
    assert len({share["shareID"] for share in shares.values()}) == 3
    for share in shares.values():
        consumed = share["consumedCapacity"]
        assert (consumed["memory"], consumed["multiprocessors"]) == ("10Gi", "0")
        assert {value for name, value in consumed.items() if name not in ("memory", "multiprocessors")} == {
            "0"
        }
    device = shares["inference-1"]["device"]
    minor = int(device.removeprefix("gpu-"))
    uuid = gpu_uuid(node, minor)

    cdi_ids = set()
    for name, claim in claims.items():
        uid, share_id = claim["metadata"]["uid"], shares[name]["shareID"]
        expected = cdi_device_id(DRIVER_NAME, uid, device, share_id)
        assert cdi_devices(pods[name]) == {"server": [expected]}  # what the runtime was handed
        spec = claim_spec(node, claim)
        assert [d["name"] for d in spec["devices"]] == [expected.partition("=")[2]]
        env = claim_env(spec)
        assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"{uuid}=10240M"
        assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in env  # asked for no SMs
        assert env["CUDA_MPS_PIPE_DIRECTORY"] == "/tmp/nvidia-mps"
        (device_env,) = [d["containerEdits"]["env"] for d in spec["devices"]]
        assert f"DRA_GPU_UUID_{device.upper().replace('-', '_')}={uuid}" in device_env
        cdi_ids.add(expected)
        # The driver reports the share in the claim's status too, once the kubelet's calls pause.
        written = rest.wait_for(
            collection("ResourceClaim", namespace),
            claim["metadata"]["name"],
            lambda c: bool(c.get("status", {}).get("devices")),
        )
        (status,) = written["status"]["devices"]
        assert (status["device"], status["shareID"]) == (device, share_id)
    assert len(cdi_ids) == 3
    mounts = [
        {m["containerPath"]: m["hostPath"] for m in claim_spec(node, c)["containerEdits"]["mounts"]}
        for c in claims.values()
    ]
    assert len({m["/tmp/nvidia-mps"] for m in mounts}) == 1  # one MPS daemon serves the GPU's shares

    delete_pod(rest, namespace, "inference-1")  # one share goes, the others stay prepared
    assert not node.driver.spec_path(claims["inference-1"]["metadata"]["uid"]).exists()
    for name in ("inference-2", "inference-3"):
        assert node.driver.spec_path(claims[name]["metadata"]["uid"]).exists()


def test_sms_asked_for_become_the_shares_thread_percentage(
    rest: RestClient, node: GpuNode, namespace: str
) -> None:
    manifests.apply_example(rest, EXAMPLES / "compute-share.yaml", namespace, node_name=node.name)

    claim = pod_claim(rest, wait_running(rest, namespace, "quarter-gpu"), "gpu")

    consumed = share_of(claim)["consumedCapacity"]
    assert (consumed["memory"], consumed["multiprocessors"]) == ("20Gi", "33")
    env = claim_env(claim_spec(node, claim))
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"].endswith("=20480M")


def _claims_on(rest: RestClient, node: GpuNode, device: str) -> list[str]:
    """The claims of the whole cluster allocated ``device`` of ``node``."""
    claims = rest.get("/apis/resource.k8s.io/v1/resourceclaims")["items"]
    return [
        claim["metadata"]["name"]
        for claim in claims
        for result in claim.get("status", {}).get("allocation", {}).get("devices", {}).get("results", [])
        if (result.get("pool"), result.get("device")) == (node.name, device)
    ]


def test_seven_10gi_claims_fit_an_h100_and_the_eighth_waits_for_memory(
    rest: RestClient, node: GpuNode, namespace: str
) -> None:
    uuid = gpu_uuid(node, 5)
    wait_until(  # an earlier test's claims are deallocated a moment after their namespace goes
        lambda: not _claims_on(rest, node, "gpu-5"),
        timeout_seconds=60,
        waiting_for="earlier tests' claims on gpu-5 to be deallocated",
    )
    # One at a time: the 1.37 scheduler counts a share's capacity twice until its pod's binding is
    # done (docs/binding-conditions.md). Seven created together on a loaded machine left the seventh
    # turned away while the first were still binding, and its retry came after this test's wait.
    for index in range(7):
        run(rest, node, namespace, f"share-{index}", uuid, "10Gi")
        wait_running(rest, namespace, f"share-{index}")

    run(rest, node, namespace, "eighth", uuid, "10Gi")  # 80Gi > the GPU's 79.6Gi

    wait_unschedulable(rest, namespace, "eighth")
    assert "allocation" not in claim_of(rest, namespace, "eighth").get("status", {})
    delete_pod(rest, namespace, "share-0")
    wait_running(rest, namespace, "eighth")  # the scheduler retries once the memory is free


def test_a_request_the_policy_does_not_allow_is_refused_by_the_scheduler(
    rest: RestClient, node: GpuNode, namespace: str
) -> None:
    run(rest, node, namespace, "too-big", gpu_uuid(node, 6), "80Gi")  # more than the policy's 79Gi

    pod = wait_unschedulable(rest, namespace, "too-big")

    (condition,) = [c for c in pod["status"]["conditions"] if c["type"] == "PodScheduled"]
    assert "cannot allocate all claims" in condition["message"]
    assert "allocation" not in claim_of(rest, namespace, "too-big").get("status", {})
    typo = sized_claim("typo", gpu_uuid(node, 6), "10Gi")
    requests = typo["spec"]["devices"]["requests"][0]["exactly"]["capacity"]["requests"]
    requests["memroy"] = requests.pop("memory")  # a capacity no GPU has
    manifests.apply(rest, manifests.pinned([typo, pod_using("typo", "typo")], node.name), namespace)
    wait_unschedulable(rest, namespace, "typo")


def test_exclusive_claims_and_shares_of_one_gpu_never_mix(
    rest: RestClient, node: GpuNode, namespace: str
) -> None:
    """A claim that asks for no memory consumes the policy's default, all of it: the GPU is its own."""
    uuid = gpu_uuid(node, 7)
    run(rest, node, namespace, "whole", uuid, None)
    claim = pod_claim(rest, wait_running(rest, namespace, "whole"), "gpu")
    assert share_of(claim)["consumedCapacity"]["memory"] == "79Gi"
    assert "CUDA_MPS_PIPE_DIRECTORY" not in claim_env(claim_spec(node, claim))  # the GPU itself, not limited

    run(rest, node, namespace, "share", uuid, "1Gi")
    wait_unschedulable(rest, namespace, "share")

    delete_pod(rest, namespace, "whole")
    wait_running(rest, namespace, "share")
    run(rest, node, namespace, "whole-again", uuid, None)
    wait_unschedulable(rest, namespace, "whole-again")


# The validating webhook (chart: webhook.enabled) with the driver's slices: what no GPU could ever
# take is refused when the claim is created, with a message naming it, not left Pending.

CHECKED = "consumable-capacity-e2e.dra-driver.dev/checked"


@pytest.fixture(scope="module")
def capacity_webhook(
    cluster: ClusterInfo, gpu_node: GpuNode, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[None]:
    """`dra-driver webhook` with the chart's webhook account alone, for namespaces labelled CHECKED."""
    directory = tmp_path_factory.mktemp("webhook")
    rest = cluster.rest()
    account_namespace = f"webhook-account-{uuid.uuid4().hex[:6]}"
    rest.create("/api/v1/namespaces", {"metadata": {"name": account_namespace}})
    try:
        with (
            chart_webhook_kubeconfig(
                cluster, account_namespace, DRIVER_NAME, directory / "kubeconfig"
            ) as kubeconfig,
            running_webhook(
                cluster,
                directory,
                driver=DRIVER_NAME,
                name="capacity-webhook-e2e",
                selector_label=CHECKED,
                extra_args=[f"--kubeconfig={kubeconfig}"],
                ready_line="listed the driver's ResourceSlices",
            ),
        ):
            yield
    finally:
        rest.delete(f"/api/v1/namespaces/{account_namespace}")


def refusal(rest: RestClient, namespace: str, obj: JsonObject) -> ApiError | None:
    """The API server's refusal of `obj`; None (and `obj` deleted) while the webhook is not called yet."""
    try:
        rest.create(manifests.collection(obj["kind"], namespace), obj)
    except ApiError as error:
        return error
    rest.delete(f"{manifests.collection(obj['kind'], namespace)}/{obj['metadata']['name']}")
    return None


def test_the_webhook_refuses_at_creation_what_no_gpu_could_take_naming_the_request(
    rest: RestClient, node: GpuNode, namespace: str, capacity_webhook: None
) -> None:
    label_namespace(rest, namespace, CHECKED)
    too_big = sized_claim("too-big", gpu_uuid(node, 4), "100Gi")

    error = wait_until(
        lambda: refusal(rest, namespace, too_big),
        timeout_seconds=30,
        waiting_for="the webhook to refuse the claim",
    )

    assert error.status == 422
    assert (
        'request "gpu" asks for memory 100Gi, more than any share of a gpu.dra-driver.dev GPU can have '
        "(79Gi on NVIDIA H100 80GB HBM3)"
    ) in error.message
    template = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": "typo"},
        "spec": {"spec": sized_claim("typo", gpu_uuid(node, 4), None)["spec"]},
    }
    template["spec"]["spec"]["devices"]["requests"][0]["exactly"]["capacity"] = {
        "requests": {"memroy": "10Gi"}
    }
    error = wait_until(
        lambda: refusal(rest, namespace, template), timeout_seconds=10, waiting_for="the template refused"
    )
    assert (
        'request "gpu" names capacity "memroy", which no gpu.dra-driver.dev GPU has (they have '
        in error.message
    )
    assert "memory, multiprocessors" in error.message


def test_a_request_the_policy_rounds_up_passes_the_webhook_and_runs(
    rest: RestClient, node: GpuNode, namespace: str, capacity_webhook: None
) -> None:
    label_namespace(rest, namespace, CHECKED)
    wait_until(  # the webhook is called for this namespace: a refusal proves it
        lambda: refusal(rest, namespace, sized_claim("probe", gpu_uuid(node, 4), "100Gi")),
        timeout_seconds=30,
        waiting_for="the webhook to be called",
    )

    run(rest, node, namespace, "rounded", gpu_uuid(node, 4), "10.5Gi")  # consumes 11Gi: allowed

    claim = pod_claim(rest, wait_running(rest, namespace, "rounded"), "gpu")
    assert share_of(claim)["consumedCapacity"]["memory"] == "11Gi"
    assert claim_env(claim_spec(node, claim))["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"].endswith("=11264M")
