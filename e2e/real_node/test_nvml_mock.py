"""The NVML backend in the chart's own image on the real node, on the mock libnvidia-ml.so.1.

The chart is installed without `simulate`: the plugin pod (containerd, runc) loads NVML from the
driver root it mounts, where the mock library sits at a host's usual place
(usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1), and reads a DGX H100 of NVIDIA's go-nvml mocks
through NVML's C interface. A workload pod then gets a GPU the NVML backend prepared.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest
from kubernetes import client

from e2e import manifests
from e2e.cluster import ClusterInfo
from e2e.daemon import wait_until
from e2e.driver import MOCK_NVML_DRIVER_VERSION
from e2e.real_node.driver import NAMESPACE, PROFILE, DriverRelease, install_driver
from e2e.real_node.gpu_view import (
    allocated_devices,
    container,
    create,
    gpu_claim_template,
    pod_manifest,
    view_of,
)
from e2e.realnode import config
from e2e.realnode.driver_root import make_nvml_driver_root
from e2e.realnode.images import IMAGES
from e2e.realnode.node import RealNode
from tests.mock_nvml import mock_nvml_library

pytestmark = pytest.mark.real_node

MPS_NODE = f"resource.dra-driver.dev/mps-node={config.NODE_NAME}"  # the plugin's MPS daemons' label
MPS_SHM_SIZE = "64Mi"  # mpsShmSize: each MPS daemon's /dev/shm, shared with its clients
_T = TypeVar("_T")


@pytest.fixture(scope="module")
def nvml_driver(real_cluster: ClusterInfo, real_node: RealNode, helm: Path) -> Iterator[DriverRelease]:
    """The chart on the NVML backend: no `simulate`, a driver root holding the mock NVML."""
    assert real_node.layout is not None
    root = real_node.layout.driver_root.parent / "driver-root-nvml"
    make_nvml_driver_root(root, mock_nvml_library(), MOCK_NVML_DRIVER_VERSION)
    release = install_driver(
        real_cluster,
        real_node,
        helm,
        replace={
            f"simulate={PROFILE}": f"simulate=,mpsShmSize={MPS_SHM_SIZE}",
            f"driverRoot={real_node.layout.driver_root}": f"driverRoot={root}",
        },
    )
    try:
        yield release
    finally:
        # The tests' pods go with their namespaces: their claims must be unprepared by this plugin
        # before it is uninstalled, or their CDI specs would outlive it on the node.
        with real_cluster.api_client() as api:
            core = client.CoreV1Api(api)
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and (
                release.cdi_specs()
                or any(p.metadata.namespace != NAMESPACE for p in core.list_pod_for_all_namespaces().items)
            ):
                time.sleep(0.5)
        release.uninstall()


def _published(release: DriverRelease) -> dict[str, dict[str, object]]:
    return {d["name"]: d["attributes"] for s in release.slices() for d in s["spec"].get("devices", [])}


def test_the_plugin_pod_publishes_the_gpus_nvml_reports(nvml_driver: DriverRelease) -> None:
    devices = _published(nvml_driver)
    full = sorted(n for n, a in devices.items() if a["type"] == {"string": "gpu"})
    assert full == [f"gpu-{i}" for i in range(8)]
    assert devices["gpu-0"]["productName"] == {"string": "NVIDIA H100 80GB HBM3"}  # NVIDIA's mock
    assert devices["gpu-0"]["driverVersion"] == {"version": MOCK_NVML_DRIVER_VERSION}


def test_a_pod_gets_a_gpu_the_nvml_backend_prepared(
    nvml_driver: DriverRelease, real_api: client.ApiClient, namespace: str
) -> None:
    create(real_api, namespace, gpu_claim_template("nvml-gpu"))
    create(
        real_api,
        namespace,
        pod_manifest(
            "nvml-gpu", {"gpu": {"resourceClaimTemplateName": "nvml-gpu"}}, [container("app", ["gpu"])]
        ),
    )
    view = view_of(real_api, namespace, "nvml-gpu", "app")
    (device,) = allocated_devices(real_api, namespace, "nvml-gpu")["gpu"]
    minor = int(device.split("-")[1])
    assert view.gpu_nodes == {f"/dev/nvidia{minor}": (195, minor)}
    uuid = _published(nvml_driver)[device]["uuid"]
    assert view.uuids == {f"DRA_GPU_UUID_{device.upper().replace('-', '_')}": uuid["string"]}  # type: ignore[index]
    # The driver's files of the version NVML reports, the mock NVML among them.
    assert {
        f"libnvidia-ml.so.{MOCK_NVML_DRIVER_VERSION}",
        f"libcuda.so.{MOCK_NVML_DRIVER_VERSION}",
    } <= view.libraries


def test_an_mps_claim_runs_its_control_daemon_as_a_deployment_on_the_kubelet(
    nvml_driver: DriverRelease, real_api: client.ApiClient, namespace: str
) -> None:
    """docs/examples/mps-gpu.yaml: the plugin's Deployment runs the claim's MPS control daemon (the
    driver root's stand-in) in a pod on the kubelet, its startup probe passes once the daemon has
    its limits, both containers get its pipe directory, and the daemon goes with the claim."""
    template, pod = manifests.load(manifests.EXAMPLES / "mps-gpu.yaml")
    for entry in pod["spec"]["containers"]:
        entry["image"] = f"{IMAGES['workload']}:{nvml_driver.tag}"
        # Also what a tenant would look at: /dev/shm, and whether it could `quit` the daemon.
        entry["command"][-1] = entry["command"][-1].replace(
            "ls /tmp/nvidia-mps;",
            "ls /tmp/nvidia-mps; grep ' /dev/shm ' /proc/mounts; "
            "ls /usr/bin/nvidia-cuda-mps-control || echo no-control-binary; ls /var/log/nvidia-mps;",
        )
    create(real_api, namespace, template)
    create(real_api, namespace, pod)
    core, apps = client.CoreV1Api(real_api), client.AppsV1Api(real_api)

    def running() -> bool:
        return bool(core.read_namespaced_pod("mps", namespace).status.phase == "Running")

    _wait(running, "the MPS pod to run (after its control daemon's pod became ready)")
    (deployment,) = apps.list_namespaced_deployment(NAMESPACE, label_selector=MPS_NODE).items
    assert deployment.metadata.name.startswith("mps-control-daemon-")
    assert deployment.status.ready_replicas == 1
    (daemon,) = core.list_namespaced_pod(NAMESPACE, label_selector=MPS_NODE).items
    (status,) = daemon.status.container_statuses
    assert (daemon.spec.node_name, daemon.status.phase, status.started, status.ready) == (
        config.NODE_NAME,
        "Running",
        True,
        True,
    )
    # The daemon's log (kubectl logs): started for the claim's GPU, with the claim's limits.
    daemon_log = core.read_namespaced_pod_log(daemon.metadata.name, NAMESPACE)
    assert "stand-in MPS control daemon started" in daemon_log
    assert "applied: set_default_active_thread_percentage 50" in daemon_log
    for name in ("server-a", "server-b"):
        log = _wait(lambda c=name: core.read_namespaced_pod_log("mps", namespace, container=c) or None, name)
        assert "CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps" in log
        assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50" in log
        assert "control" in log.split()  # `ls /tmp/nvidia-mps`: the daemon's control pipe
        # /dev/shm is the daemon's tmpfs of mpsShmSize (it reached the host: the plugin's directory
        # is mounted Bidirectional), not the kubelet's disk beneath it.
        (shm,) = [line.split() for line in log.splitlines() if line.split()[1:2] == ["/dev/shm"]]
        assert shm[2] == "tmpfs", shm
        assert "size=65536k" in shm[3].split(","), shm
        assert "no-control-binary" in log  # no nvidia-cuda-mps-control to `quit` the shared daemon
        assert "CUDA_MPS_LOG_DIRECTORY" not in log  # nor the daemon's log directory

    core.delete_namespaced_pod("mps", namespace, grace_period_seconds=1)
    _wait(
        lambda: (
            not apps.list_namespaced_deployment(NAMESPACE, label_selector=MPS_NODE).items
            and not core.list_namespaced_pod(NAMESPACE, label_selector=MPS_NODE).items
        ),
        "the MPS control daemon's Deployment and pod to go with the claim",
    )


# A tenant's MPS client, from inside its container: it fills /dev/shm past its size, plants links to
# the node's files (as the plugin and the daemon's chroot see them) in each directory it may write,
# the control pipe among them, and looks for the program that would `quit` the daemon.
_TENANT_SCRIPT = """
grep ' /dev/shm ' /proc/mounts
dd if=/dev/zero of=/dev/shm/fill bs=1M count=100 2>&1; echo "dd-exit=$?"
echo "fill-bytes=$(wc -c < /dev/shm/fill)"
for d in /tmp/nvidia-mps /dev/shm; do
  ln -s {plugin_canary} $d/to-plugin-dir; ln -s /canary $d/to-driver-root; ln -s /canary/keep $d/to-file
done
rm -f /tmp/nvidia-mps/control && ln -s /canary/keep /tmp/nvidia-mps/control
find / -path /proc -prune -o -path /sys -prune -o -name 'nvidia-cuda-mps-control*' -print | sed 's/^/found: /'
echo planted
trap 'exit 0' TERM; sleep infinity & wait
"""


def test_a_tenant_neither_fills_the_node_disk_through_dev_shm_nor_gets_links_followed(
    nvml_driver: DriverRelease, real_api: client.ApiClient, namespace: str
) -> None:
    """/dev/shm of an MPS client is the daemon's tmpfs of mpsShmSize: a write past it fails with
    ENOSPC and nothing reaches the directory beneath it on the node's disk. The links a client plants
    in its pipe and shm directories, to a directory and a file of the node, are not followed when the
    daemon stops and the plugin removes its directories; no client has nvidia-cuda-mps-control."""
    layout = nvml_driver.node.layout
    assert layout is not None
    plugin_dir = f"{config.KUBELET_ROOT}/plugins/gpu.dra-driver.dev"
    canaries = [
        layout.host_path(f"{plugin_dir}/canary"),
        layout.driver_root.parent / "driver-root-nvml" / "canary",
    ]
    for canary in canaries:
        canary.mkdir(exist_ok=True)
        (canary / "keep").write_text("the node's\n")
    template, pod = manifests.load(manifests.EXAMPLES / "mps-gpu.yaml")
    template["metadata"]["name"] = pod["spec"]["resourceClaims"][0]["resourceClaimTemplateName"] = (
        "tenant-mps"
    )
    pod["metadata"]["name"] = "tenant"
    tenant = pod["spec"]["containers"][0]
    tenant["image"] = f"{IMAGES['workload']}:{nvml_driver.tag}"
    tenant["command"] = ["sh", "-c", _TENANT_SCRIPT.format(plugin_canary=f"{plugin_dir}/canary")]
    pod["spec"]["containers"] = [tenant]
    create(real_api, namespace, template)
    create(real_api, namespace, pod)
    core, apps = client.CoreV1Api(real_api), client.AppsV1Api(real_api)

    def planted() -> str | None:
        if core.read_namespaced_pod("tenant", namespace).status.phase != "Running":
            return None  # no log to read yet (its daemon's pod starts first)
        log = core.read_namespaced_pod_log("tenant", namespace, container=tenant["name"]) or ""
        return log if "planted" in log.split() else None

    log = _wait(planted, "the tenant's container to fill /dev/shm and plant its links")
    # The daemon's directories on the node: the pipe directory (a plain directory of the node's disk)
    # holds the tenant's links: the attempt was made.
    (daemon_dir,) = [
        d
        for d in layout.host_path(f"{plugin_dir}/mps").iterdir()
        if (d / "pipe" / "to-plugin-dir").is_symlink()
    ]
    # Past the tmpfs's size: ENOSPC, and the file holds what fit (64 MiB), in memory.
    assert "No space left on device" in log, log
    assert "dd-exit=0" not in log, log
    assert "fill-bytes=67108864" in log, log
    # The directory beneath the tmpfs, on the node's disk (the tmpfs is mounted in the node's mount
    # namespace only, not the host's), got nothing.
    assert not any((daemon_dir / "shm").iterdir()), sorted((daemon_dir / "shm").iterdir())
    assert (daemon_dir / "pipe" / "control").is_symlink()
    assert "found:" not in log, log  # no nvidia-cuda-mps-control anywhere in the client

    core.delete_namespaced_pod("tenant", namespace, grace_period_seconds=1)
    _wait(
        lambda: (
            not apps.list_namespaced_deployment(NAMESPACE, label_selector=MPS_NODE).items
            and not core.list_namespaced_pod(NAMESPACE, label_selector=MPS_NODE).items
            and not daemon_dir.exists()
        ),
        "the MPS daemon and its directories to go with the claim",
    )
    for canary in canaries:
        assert sorted(p.name for p in canary.iterdir()) == ["keep"], canary
        assert (canary / "keep").read_text() == "the node's\n", canary
        shutil.rmtree(canary)


def _wait(probe: Callable[[], _T | None], what: str, timeout: float = 120) -> _T:
    return wait_until(probe, timeout_seconds=timeout, waiting_for=what)
