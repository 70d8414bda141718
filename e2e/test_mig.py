"""MIG partitions end to end: the real scheduler allocates MIG placements from the driver's counters,
the kubelet harness (the kubelet's own DRA code) calls the driver daemon, and the driver creates and
destroys the MIG devices on a simulated 16-GPU H100 node -- whose simulator refuses whatever the
hardware would refuse, so a wrong allocation fails here loudly.

Checked where a user would look: pods running or pending, the claims' allocations, the CDI spec on the
node, and the simulated GPUs themselves (their state file, read as `dra-driver simulate` reads it).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dra_driver.devices.types import Gpu, MigDevice
from dra_driver.resources.device_names import mig_device_name
from dra_driver.resources.server_rules import rules_for
from dra_driver.simulated.gpus import SimulatedBackend
from e2e import manifests
from e2e.cluster import ClusterInfo, JsonObject, RestClient
from e2e.daemon import wait_until
from e2e.driver import DRIVER_NAME
from e2e.gpu_node import GpuNode, published_devices, published_slices
from e2e.manifests import collection
from e2e.workloads import (
    allocated_devices,
    cdi_devices,
    delete_pod,
    expected_cdi_ids,
    pod_claim,
    wait_running,
)

pytestmark = pytest.mark.e2e

PROFILE = "hgx-h100-16"
GPUS = 16
MIG_CLASS = "mig.dra-driver.dev"
GPU_CLASS = "gpu.dra-driver.dev"
DEVICES_PER_IDLE_H100 = 26  # the full GPU and its 25 placements
MIG_EXAMPLES = manifests.EXAMPLES / "mig"


@pytest.fixture(scope="module")
def gpu_node(
    cluster: ClusterInfo,
    kubelet_harness_binary: Path,
    gpu_device_class: str,
    mig_device_class: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[GpuNode]:
    """This module's node, a simulated 16-GPU H100 server (replaces conftest's DGX H100)."""
    node = GpuNode(
        cluster,
        kubelet_harness_binary,
        tmp_path_factory.mktemp("node-mig"),
        "node-mig",
        profile=PROFILE,
        # Static MIG devices are noticed by re-reading the GPUs: soon, for the test that makes one.
        driver_args=["--inventory-refresh-seconds=1"],
    )
    with node.running():
        yield node


# --- what the node's GPUs say -----------------------------------------------------------------------------


def gpus(node: GpuNode) -> tuple[Gpu, ...]:
    """The simulated GPUs as they are now, from the state file the daemon keeps."""
    return SimulatedBackend(PROFILE, node.name, node.driver.paths.data).inventory().gpus


def placements(node: GpuNode, minor: int) -> list[str]:
    """The names of the MIG devices that exist on GPU `minor`, as the driver publishes them."""
    return sorted(_name(gpus(node)[minor], mig) for mig in gpus(node)[minor].mig_devices)


def _name(gpu: Gpu, mig: MigDevice) -> str:
    return mig_device_name(gpu.minor, mig.profile, mig.profile_id, mig.placement.start)


def wait_gpu_idle(rest: RestClient, node: GpuNode, minor: int) -> None:
    """Until GPU `minor` has no MIG device, MIG mode is off and the scheduler is offered it whole again."""
    wait_until(
        lambda: not gpus(node)[minor].mig_enabled and f"gpu-{minor}" in published_devices(rest, node.name),
        timeout_seconds=60,
        waiting_for=f"gpu-{minor} to be idle and published whole again",
    )


# --- what a user applies ------------------------------------------------------------------------------------


def on_gpu(minor: int, node: GpuNode, device_class: str = MIG_CLASS) -> str:
    """A CEL selector that keeps a request of `device_class` on one GPU of the node.

    Full GPUs have a `uuid`; MIG devices a `parentUUID` (and placements no `uuid`: a selector that
    reads a missing attribute fails the allocation rather than not matching).
    """
    attribute = "uuid" if device_class == GPU_CLASS else "parentUUID"
    return f'device.attributes["{DRIVER_NAME}"].{attribute} == "{gpus(node)[minor].uuid}"'


def template(name: str, device_class: str, *selectors: str) -> JsonObject:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name},
        "spec": {
            "spec": {
                "devices": {
                    "requests": [
                        {
                            "name": "gpu",
                            "exactly": {
                                "deviceClassName": device_class,
                                "selectors": [{"cel": {"expression": s}} for s in selectors],
                            },
                        }
                    ]
                }
            }
        },
    }


def pod(name: str, template_name: str) -> JsonObject:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": template_name}],
            "containers": [
                {"name": "app", "image": "ubuntu:24.04", "resources": {"claims": [{"name": "gpu"}]}}
            ],
        },
    }


def profile_is(profile: str) -> str:
    return f'device.attributes["{DRIVER_NAME}"].profile == "{profile}"'


def apply(rest: RestClient, node: GpuNode, namespace: str, *objects: JsonObject) -> None:
    manifests.apply(rest, manifests.pinned(objects, node.name), namespace)


def pods(rest: RestClient, namespace: str) -> list[JsonObject]:
    items: list[JsonObject] = rest.request("GET", collection("Pod", namespace))["items"]
    return items


def unschedulable(pod: JsonObject) -> bool:
    conditions = pod.get("status", {}).get("conditions") or []
    return any(c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable" for c in conditions)


def wait_unschedulable(rest: RestClient, namespace: str, name: str) -> JsonObject:
    return rest.wait_for(collection("Pod", namespace), name, unschedulable, timeout_seconds=60)


def check_mig_spec(node: GpuNode, claim: JsonObject) -> None:
    """Every allocated MIG device exists on its GPU at the allocated placement, and the claim's CDI spec
    gives the parent's device node, that MIG device's capability nodes and its uuid."""
    uid = claim["metadata"]["uid"]
    spec = json.loads(node.driver.spec_path(uid).read_text())
    edits = {device["name"]: device["containerEdits"] for device in spec["devices"]}
    live = {_name(gpu, mig): (gpu, mig) for gpu in gpus(node) for mig in gpu.mig_devices}
    for device in allocated_devices(claim):
        gpu, mig = live[device]
        nodes = [n["path"] for n in edits[f"{uid}-{device}"]["deviceNodes"]]
        assert nodes == [f"/dev/nvidia{gpu.minor}", *(cap.path for cap in mig.cap_nodes)]
        assert (
            f"DRA_GPU_UUID_{device.upper().replace('-', '_')}={mig.uuid}" in edits[f"{uid}-{device}"]["env"]
        )


# --- the tests ----------------------------------------------------------------------------------------------


def test_a_16_gpu_node_publishes_valid_slices_and_serves_its_last_gpu(
    rest: RestClient, cluster: ClusterInfo, node: GpuNode, namespace: str
) -> None:
    def complete_pool() -> list[JsonObject] | None:
        items = published_slices(rest, node.name)
        generation = max((item["spec"]["pool"]["generation"] for item in items), default=0)
        newest = [item for item in items if item["spec"]["pool"]["generation"] == generation]
        return newest if newest and len(newest) == newest[0]["spec"]["pool"]["resourceSliceCount"] else None

    items = wait_until(
        complete_pool, timeout_seconds=60, waiting_for="a complete pool of the newest generation"
    )
    counter_sets = [cs for item in items for cs in item["spec"].get("sharedCounters") or []]
    devices = [d for item in items for d in item["spec"].get("devices") or []]
    assert sorted(cs["name"] for cs in counter_sets) == sorted(f"gpu-{i}-counter-set" for i in range(GPUS))
    if rules_for(cluster.kube_version).counters_beside_devices:
        # 1.34: one slice per GPU, holding its counter set beside the devices that consume it.
        assert len(items) == GPUS
        assert all(len(item["spec"]["sharedCounters"]) == 1 for item in items)
    else:
        # 16 counter sets fill two slices of 8; 16 x 26 devices that consume counters, 64 at most per slice.
        assert len(items) == 10  # 2 counter slices, 8 device slices of two GPUs (52 devices) each
    counter_free = [d["name"] for d in devices if not d.get("consumesCounters")]
    assert sorted(counter_free) == sorted(f"gpu-{i}-maintenance" for i in range(GPUS))  # admin access only
    assert len(devices) - len(counter_free) == GPUS * DEVICES_PER_IDLE_H100

    apply(
        rest,
        node,
        namespace,
        template("last", MIG_CLASS, profile_is("7g.80gb"), on_gpu(15, node)),
        pod("last", "last"),
    )
    claim = pod_claim(rest, wait_running(rest, namespace, "last"), "gpu")

    assert allocated_devices(claim) == ["gpu-15-mig-7g80gb-0-0"]
    assert placements(node, 15) == ["gpu-15-mig-7g80gb-0-0"]
    check_mig_spec(node, claim)
    delete_pod(rest, namespace, "last")
    wait_gpu_idle(rest, node, 15)


def test_seven_1g_claims_fill_an_h100_and_an_eighth_waits_for_a_free_slice(
    rest: RestClient, node: GpuNode, namespace: str
) -> None:
    names = [f"small-{i}" for i in range(8)]
    apply(
        rest,
        node,
        namespace,
        template("small", MIG_CLASS, profile_is("1g.10gb"), on_gpu(14, node)),
        *(pod(name, "small") for name in names),
    )

    def seven_running_one_pending() -> list[JsonObject] | None:
        items = pods(rest, namespace)
        running = [p for p in items if p.get("status", {}).get("phase") == "Running"]
        pending = [p for p in items if unschedulable(p)]
        return pending if len(running) == 7 and len(pending) == 1 else None

    (waiting,) = wait_until(
        seven_running_one_pending, timeout_seconds=120, waiting_for="7 running pods, 1 pending"
    )
    assert placements(node, 14) == [f"gpu-14-mig-1g10gb-19-{start}" for start in range(7)]
    assert "cannot allocate all claims" in json.dumps(waiting["status"]["conditions"])

    released = next(name for name in names if name != waiting["metadata"]["name"])
    delete_pod(rest, namespace, released)
    wait_running(rest, namespace, waiting["metadata"]["name"])
    assert len(placements(node, 14)) == 7

    for name in names:
        if name != released:
            delete_pod(rest, namespace, name)
    wait_gpu_idle(rest, node, 14)  # deleting the pods gave every slice back


def test_a_full_gpu_claim_waits_until_the_partition_on_its_gpu_is_released(
    rest: RestClient, node: GpuNode, namespace: str
) -> None:
    apply(
        rest,
        node,
        namespace,
        template("slice", MIG_CLASS, profile_is("1g.10gb"), on_gpu(13, node)),
        pod("slice", "slice"),
    )
    wait_running(rest, namespace, "slice")
    apply(
        rest,
        node,
        namespace,
        template("whole", GPU_CLASS, on_gpu(13, node, GPU_CLASS)),
        pod("whole", "whole"),
    )

    wait_unschedulable(rest, namespace, "whole")
    assert gpus(node)[13].mig_enabled
    wait_until(  # in MIG mode the GPU is not offered whole at all (its counters forbid it already)
        lambda: "gpu-13" not in published_devices(rest, node.name),
        timeout_seconds=30,
        waiting_for="gpu-13 to be published without its full-GPU device",
    )

    delete_pod(rest, namespace, "slice")
    claim = pod_claim(rest, wait_running(rest, namespace, "whole"), "gpu")

    assert allocated_devices(claim) == ["gpu-13"]
    assert not gpus(node)[13].mig_enabled
    spec = json.loads(node.driver.spec_path(claim["metadata"]["uid"]).read_text())
    assert [n["path"] for n in spec["devices"][0]["containerEdits"]["deviceNodes"]] == ["/dev/nvidia13"]


def test_mixed_profiles_on_one_gpu_get_placements_that_do_not_overlap(
    rest: RestClient, node: GpuNode, namespace: str
) -> None:
    sizes = {"big": "3g.40gb", "medium": "2g.20gb", "small": "1g.10gb"}
    for name, profile in sizes.items():
        apply(
            rest,
            node,
            namespace,
            template(name, MIG_CLASS, profile_is(profile), on_gpu(12, node)),
            pod(name, name),
        )

    claims = {name: pod_claim(rest, wait_running(rest, namespace, name), "gpu") for name in sizes}

    chosen = {name: allocated_devices(claim)[0] for name, claim in claims.items()}
    assert sorted(chosen.values()) == placements(node, 12)  # the simulated GPU agrees with the scheduler
    gpu = gpus(node)[12]
    taken = [set(mig.placement.memory_slices) for mig in gpu.mig_devices]
    assert sum(len(s) for s in taken) == len(set().union(*taken)) == 4 + 2 + 1
    for claim in claims.values():
        check_mig_spec(node, claim)


@pytest.mark.parametrize(
    ("example", "pod_name", "wanted"),
    [
        ("by-profile.yaml", "mig-by-profile", lambda d: d["attributes"]["profile"]["string"] == "1g.10gb"),
        ("by-memory.yaml", "mig-by-memory", lambda d: int(d["capacity"]["memory"]["value"]) >= 16 * 2**30),
        (
            "by-multiprocessors.yaml",
            "mig-by-multiprocessors",
            lambda d: int(d["capacity"]["multiprocessors"]["value"]) >= 32,
        ),
    ],
)
def test_documented_ways_to_ask_for_a_mig_device(
    rest: RestClient, node: GpuNode, namespace: str, example: str, pod_name: str, wanted: Any
) -> None:
    devices_before = published_devices(rest, node.name)
    manifests.apply_example(rest, MIG_EXAMPLES / example, namespace, node_name=node.name)

    running = wait_running(rest, namespace, pod_name)
    claim = pod_claim(rest, running, "mig")

    (device,) = allocated_devices(claim)
    published = devices_before[device]
    assert published["attributes"]["type"]["string"] == "mig"
    assert wanted(published)
    assert cdi_devices(running) == {"app": expected_cdi_ids(claim)}
    check_mig_spec(node, claim)
    delete_pod(rest, namespace, pod_name)
    assert not node.driver.spec_path(claim["metadata"]["uid"]).exists()
    assert all(not gpu.mig_devices for gpu in gpus(node))


def first_available_on(node: GpuNode, minor: int) -> list[JsonObject]:
    """The first-available example, each alternative kept to GPU `minor`."""
    objects = manifests.load(MIG_EXAMPLES / "first-available.yaml")
    for obj in manifests.of_kind(objects, "ResourceClaimTemplate"):
        for alternative in obj["spec"]["spec"]["devices"]["requests"][0]["firstAvailable"]:
            selector = on_gpu(minor, node, alternative["deviceClassName"])
            alternative.setdefault("selectors", []).append({"cel": {"expression": selector}})
    return objects


def sharing_env(node: GpuNode, claim: JsonObject) -> list[str]:
    spec = json.loads(node.driver.spec_path(claim["metadata"]["uid"]).read_text())
    return [
        e for device in spec["devices"] for e in device["containerEdits"]["env"] if "SHARING_STRATEGY" in e
    ]


def test_first_available_takes_a_full_gpu_or_else_a_mig_device_with_the_parent_requests_config(
    rest: RestClient, node: GpuNode, namespace: str
) -> None:
    (whole_template, _) = manifests.apply_example(
        rest, MIG_EXAMPLES / "first-available.yaml", namespace, node_name=node.name
    )
    whole = pod_claim(rest, wait_running(rest, namespace, "gpu-or-mig"), "gpu")
    assert [r["request"] for r in whole["status"]["allocation"]["devices"]["results"]] == ["gpu/whole"]
    assert sharing_env(node, whole) == [
        f"DRA_GPU_SHARING_STRATEGY_{allocated_devices(whole)[0].upper().replace('-', '_')}=TimeSlicing"
    ]
    delete_pod(rest, namespace, "gpu-or-mig")
    rest.delete(manifests.object_path(whole_template, namespace))

    # GPU 11 holds a MIG device: it cannot be had whole, so the second alternative is taken there.
    apply(
        rest,
        node,
        namespace,
        template("slice", MIG_CLASS, profile_is("1g.10gb"), on_gpu(11, node)),
        pod("slice", "slice"),
    )
    wait_running(rest, namespace, "slice")
    apply(rest, node, namespace, *first_available_on(node, 11))
    running = wait_running(rest, namespace, "gpu-or-mig")
    fallback = pod_claim(rest, running, "gpu")

    (result,) = fallback["status"]["allocation"]["devices"]["results"]
    assert result["request"] == "gpu/mig-3g"
    assert result["device"].startswith("gpu-11-mig-3g40gb-9-")
    assert cdi_devices(running) == {"app": expected_cdi_ids(fallback)}  # the container named "gpu"
    check_mig_spec(node, fallback)
    assert sharing_env(node, fallback) == [
        f"DRA_GPU_SHARING_STRATEGY_{result['device'].upper().replace('-', '_')}=MPS"
    ]


def simulate(node: GpuNode, *args: str) -> str:
    """`dra-driver simulate ...` on the node's simulated GPUs, as an administrator runs it."""
    argv = [sys.executable, "-m", "dra_driver", "simulate", *args]
    argv += [f"--simulate={PROFILE}", f"--node-name={node.name}", f"--data-dir={node.driver.paths.data}"]
    return subprocess.run(argv, check=True, capture_output=True, text=True).stdout.strip()


def test_a_mig_device_an_administrator_made_is_published_as_it_is_and_outlives_its_claim(
    rest: RestClient, node: GpuNode, namespace: str
) -> None:
    static_uuid = simulate(node, "create-mig", "--gpu=10", "--profile=3g.40gb", "--start=4")
    try:
        # The placement it sits on was offered before; now the device itself is, with its uuid.
        uuid = wait_until(
            lambda: published_devices(rest, node.name)["gpu-10-mig-3g40gb-9-4"]["attributes"].get("uuid"),
            timeout_seconds=30,
            waiting_for="the static MIG device to be published",
        )
        assert uuid == {"string": static_uuid}
        devices = published_devices(rest, node.name)
        assert "gpu-10" not in devices  # MIG mode is on
        assert "gpu-10-mig-3g40gb-9-0" in devices  # the free half is still offered
        assert "gpu-10-mig-7g80gb-0-0" not in devices  # it would overlap the static device

        by_uuid = f'device.attributes["{DRIVER_NAME}"].?uuid.orValue("") == "{static_uuid}"'
        apply(rest, node, namespace, template("static", MIG_CLASS, by_uuid), pod("static", "static"))
        claim = pod_claim(rest, wait_running(rest, namespace, "static"), "gpu")

        assert allocated_devices(claim) == ["gpu-10-mig-3g40gb-9-4"]
        check_mig_spec(node, claim)
        delete_pod(rest, namespace, "static")
        assert [mig.uuid for mig in gpus(node)[10].mig_devices] == [
            static_uuid
        ]  # not the driver's to destroy
    finally:
        SimulatedBackend(PROFILE, node.name, node.driver.paths.data).destroy_mig_device(
            gpus(node)[10].uuid, static_uuid
        )
    wait_gpu_idle(rest, node, 10)
