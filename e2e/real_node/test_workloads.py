"""What a workload container sees on a real node: containerd and runc inject exactly the devices,
variables and driver files of the CDI spec the driver (installed by Helm, in its own container)
wrote for the pod's claim -- and the container's device cgroup lets it use just those nodes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from dra_driver.simulated.gpus import DRIVER_VERSION
from e2e.real_node.conftest import new_namespace
from e2e.real_node.driver import ADMIN_GPU, DRIVER_NAME, RELEASE, DriverRelease
from e2e.real_node.gpu_view import (
    allocated_devices,
    container,
    create,
    gpu_claim,
    gpu_claim_template,
    pod_manifest,
    view_of,
)
from e2e.realnode import config
from e2e.realnode.images import IMAGES
from e2e.realnode.node import RealNode

pytestmark = pytest.mark.real_node

NVIDIA_MAJOR = 195
CAPS_MAJOR = 237
# /dev/nvidiactl, -modeset, -uvm, -uvm-tools: every GPU container gets them.
CONTROL_NODES = {
    "/dev/nvidiactl": (195, 255),
    "/dev/nvidia-modeset": (195, 254),
    "/dev/nvidia-uvm": (510, 0),
    "/dev/nvidia-uvm-tools": (510, 1),
}
LIBRARIES = {f"lib{name}.so.{DRIVER_VERSION}" for name in ("cuda", "nvidia-ml")}


def _uuids_by_device(release: DriverRelease) -> dict[str, str]:
    found = {}
    for slice_ in release.slices():
        for device in slice_["spec"].get("devices", []):
            if "uuid" in device["attributes"]:  # MIG placements get theirs when created
                found[device["name"]] = device["attributes"]["uuid"]["string"]
    return found


def _minor(device: str) -> int:
    return int(device.split("-")[1])


def _expected_gpu(release: DriverRelease, device: str) -> tuple[str, tuple[int, int], str, str]:
    minor = _minor(device)
    return (
        f"/dev/nvidia{minor}",
        (NVIDIA_MAJOR, minor),
        f"DRA_GPU_UUID_{device.upper().replace('-', '_')}",
        _uuids_by_device(release)[device],
    )


def _devices_allowed(node: RealNode, api: client.ApiClient, namespace: str, pod: str) -> set[str]:
    """The container's device cgroup whitelist as runc wrote it (devices.list), read on the host."""
    found = client.CoreV1Api(api).read_namespaced_pod(pod, namespace)
    container_id = found.status.container_statuses[0].container_id.removeprefix("containerd://")
    assert node.layout is not None
    root = Path("/sys/fs/cgroup/devices") / node.layout.cgroup_root.lstrip("/")
    (listing,) = [p for p in root.rglob("devices.list") if p.parent.name == container_id]
    return set(listing.read_text().split("\n"))


def test_one_gpu_sees_only_its_own_device(
    driver: DriverRelease, real_node: RealNode, real_api: client.ApiClient, namespace: str
) -> None:
    create(real_api, namespace, gpu_claim_template("one-gpu"))
    create(
        real_api,
        namespace,
        pod_manifest(
            "one-gpu", {"gpu": {"resourceClaimTemplateName": "one-gpu"}}, [container("app", ["gpu"])]
        ),
    )

    view = view_of(real_api, namespace, "one-gpu", "app")

    (device,) = allocated_devices(real_api, namespace, "one-gpu")["gpu"]
    node_path, numbers, variable, uuid = _expected_gpu(driver, device)
    assert view.gpu_nodes == {node_path: numbers}
    assert {p: n for p, n in view.devices.items() if p not in view.gpu_nodes} == CONTROL_NODES
    assert view.uuids == {variable: uuid}
    assert view.libraries >= LIBRARIES
    # runc let the container use its GPU and the control nodes -- and no other GPU.
    allowed = _devices_allowed(real_node, real_api, namespace, "one-gpu")
    assert f"c {numbers[0]}:{numbers[1]} rwm" in allowed
    other_gpus = {f"c 195:{m} rwm" for m in range(8) if m != numbers[1]}
    assert not allowed & other_gpus


def test_two_gpus_in_one_pod(driver: DriverRelease, real_api: client.ApiClient, namespace: str) -> None:
    create(real_api, namespace, gpu_claim_template("two-gpus", count=2))
    create(
        real_api,
        namespace,
        pod_manifest(
            "two-gpus", {"gpus": {"resourceClaimTemplateName": "two-gpus"}}, [container("app", ["gpus"])]
        ),
    )

    view = view_of(real_api, namespace, "two-gpus", "app")

    devices = allocated_devices(real_api, namespace, "two-gpus")["gpus"]
    assert len(devices) == 2
    expected = [_expected_gpu(driver, d) for d in devices]
    assert view.gpu_nodes == {path: numbers for path, numbers, _, _ in expected}
    assert view.uuids == {variable: uuid for _, _, variable, uuid in expected}


def test_one_claim_shared_by_two_containers_and_two_pods(
    driver: DriverRelease, real_api: client.ApiClient, namespace: str
) -> None:
    create(real_api, namespace, gpu_claim("shared"))
    shared = {"gpu": {"resourceClaimName": "shared"}}
    create(
        real_api,
        namespace,
        pod_manifest("pod-a", shared, [container("first", ["gpu"]), container("second", ["gpu"])]),
    )
    create(real_api, namespace, pod_manifest("pod-b", shared, [container("app", ["gpu"])]))

    views = [
        view_of(real_api, namespace, "pod-a", "first"),
        view_of(real_api, namespace, "pod-a", "second"),
        view_of(real_api, namespace, "pod-b", "app"),
    ]

    (device,) = allocated_devices(real_api, namespace, "pod-a")["gpu"]
    assert allocated_devices(real_api, namespace, "pod-b")["gpu"] == [device]
    node_path, numbers, variable, uuid = _expected_gpu(driver, device)
    for view in views:
        assert view.gpu_nodes == {node_path: numbers}
        assert view.uuids == {variable: uuid}


def test_mig_device_with_its_parent_and_caps_nodes(
    driver: DriverRelease, real_node: RealNode, real_api: client.ApiClient, namespace: str
) -> None:
    template: dict[str, Any] = gpu_claim_template("mig", device_class="mig.dra-driver.dev")
    template["spec"]["spec"]["devices"]["requests"][0]["exactly"]["selectors"] = [
        {"cel": {"expression": 'device.attributes["gpu.dra-driver.dev"].profile == "1g.10gb"'}}
    ]
    create(real_api, namespace, template)
    create(
        real_api,
        namespace,
        pod_manifest("mig", {"mig": {"resourceClaimTemplateName": "mig"}}, [container("app", ["mig"])]),
    )

    view = view_of(real_api, namespace, "mig", "app")

    (device,) = allocated_devices(real_api, namespace, "mig")["mig"]
    parent = _minor(device)
    assert view.gpu_nodes == {f"/dev/nvidia{parent}": (NVIDIA_MAJOR, parent)}
    # The GPU instance's and the compute instance's access capabilities, as nvidia-caps nodes, which
    # the runtime made from the spec's numbers: the host has none of them (its driver root only the
    # config and monitor capabilities, cap1 and cap2), as on a host where nvidia-modprobe never ran.
    assert len(view.cap_nodes) == 2
    assert {numbers[0] for numbers in view.cap_nodes.values()} == {CAPS_MAJOR}
    assert real_node.layout is not None
    for path in view.cap_nodes:
        for host_dev in (Path("/"), real_node.layout.driver_root):
            assert not (host_dev / path.lstrip("/")).exists(), f"{path} exists on the host"
    ((variable, uuid),) = view.uuids.items()
    assert variable == f"DRA_GPU_UUID_{device.upper().replace('-', '_')}"
    assert uuid.startswith("MIG-")


def test_admin_access_pod_next_to_a_workload(
    driver: DriverRelease, real_api: client.ApiClient, namespace: str
) -> None:
    uuid = _uuids_by_device(driver)[ADMIN_GPU]
    template = gpu_claim_template("one-gpu")
    template["spec"]["spec"]["devices"]["requests"][0]["exactly"]["selectors"] = [
        {"cel": {"expression": f'device.attributes["gpu.dra-driver.dev"].uuid == "{uuid}"'}}
    ]
    create(real_api, namespace, template)
    create(
        real_api,
        namespace,
        pod_manifest(
            "workload", {"gpu": {"resourceClaimTemplateName": "one-gpu"}}, [container("app", ["gpu"])]
        ),
    )
    workload = view_of(real_api, namespace, "workload", "app")
    assert allocated_devices(real_api, namespace, "workload")["gpu"] == [ADMIN_GPU]

    # Only a namespace with this label may hold adminAccess claims (docs/examples/maintenance).
    maintenance = new_namespace(real_api, {"resource.kubernetes.io/admin-access": "true"})
    try:
        claim = gpu_claim("diagnostics")
        request = claim["spec"]["devices"]["requests"][0]["exactly"]
        request.update(
            adminAccess=True,
            selectors=[{"cel": {"expression": f'device.attributes["gpu.dra-driver.dev"].uuid == "{uuid}"'}}],
        )
        create(real_api, maintenance, claim)
        create(
            real_api,
            maintenance,
            pod_manifest(
                "diagnostics",
                {"gpu": {"resourceClaimName": "diagnostics"}},
                [container("diagnostics", ["gpu"])],
            ),
        )

        admin = view_of(real_api, maintenance, "diagnostics", "diagnostics")

        assert admin.gpu_nodes == workload.gpu_nodes
        assert admin.uuids == workload.uuids
    finally:
        core = client.CoreV1Api(real_api)
        core.delete_collection_namespaced_pod(maintenance, grace_period_seconds=1)
        core.delete_namespace(maintenance)


def test_the_plugin_runs_in_containerd_registered_with_the_kubelet_as_its_service_account(
    driver: DriverRelease, real_node: RealNode
) -> None:
    plugin = driver.wait_ready()
    (status,) = plugin.status.container_statuses
    assert status.container_id.startswith("containerd://")
    assert status.image == f"{IMAGES['driver']}:{driver.tag}"
    # The chart's account and its projected token: no kubeconfig reaches the daemon.
    assert plugin.spec.service_account_name == RELEASE
    (kubelet_plugin,) = plugin.spec.containers
    assert "DRA_KUBECONFIG" not in {env.name for env in kubelet_plugin.env}
    assert any(
        source.service_account_token is not None
        for volume in plugin.spec.volumes
        if volume.projected is not None
        for source in volume.projected.sources
    )
    # Registered through the kubelet's plugin watcher: the registration socket, and the kubelet saying so.
    assert real_node.layout is not None
    registry = real_node.layout.host_path(f"{config.KUBELET_ROOT}/plugins_registry")
    assert [p.name for p in registry.iterdir() if p.is_socket() and DRIVER_NAME in p.name]
    kubelet_log = (real_node.layout.logs / "kubelet.log").read_text()
    endpoint = f"{config.KUBELET_ROOT}/plugins/{DRIVER_NAME}/dra-{plugin.metadata.uid}.sock"
    assert (
        f'"Connection changed" logger="DRA registration handler" driverName="{DRIVER_NAME}" '
        f'endpoint="{endpoint}" connected=true'
    ) in kubelet_log
