"""The NVML backend on NVML's real C interface: the mock libnvidia-ml.so.1 of hack/mock-nvml.

The library is loaded from a driver root as on a host, and pynvml talks to it through its
ctypes structs; the GPUs are NVIDIA's go-nvml mocks (a DGX H100 or DGX A100), not our
catalog, so nothing here checks the backend against itself. What the hardware does on its
own -- an administrator's MIG configuration, a reboot, a GPU that stops answering -- comes
through the mock's control interface (tests/mock_nvml.py).
"""

from __future__ import annotations

import ctypes
import json
import os
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pynvml
import pytest
from structlog.testing import capture_logs

from dra_driver.devices.backend import DeviceError, DeviceInUseError, PlacementUnavailableError
from dra_driver.devices.backends import open_backend
from dra_driver.devices.nvcaps import Capability, ensure_node
from dra_driver.devices.nvml import NvmlBackend
from dra_driver.devices.types import OrphanedGpuInstance, Placement
from dra_driver.resources.devices import build_devices
from dra_driver.simulated.gpus import SimulatedBackend
from tests.mock_nvml import (
    CAPS_MAJOR,
    LIBRARY_DIR,
    MockNvml,
    MockNvmlError,
    install_driver_root,
    install_procfs,
    mock_nvml_library,
)

REPO = Path(__file__).resolve().parents[2]
# H100 GPU-instance profile ids as NVIDIA's mock reports them (NVML_GPU_INSTANCE_PROFILE_*).
ONE_G, TWO_G, THREE_G, FOUR_G, SEVEN_G = 0, 1, 2, 3, 4


@dataclass
class Node:
    """A host with the mock driver: driver root, /proc and /sys as the plugin sees them."""

    mock: MockNvml
    root: Path
    procfs: Path
    sysfs: Path
    state: Path
    backends: list[NvmlBackend] = field(default_factory=list)

    def backend(self, **options: Any) -> NvmlBackend:
        backend = NvmlBackend(
            sysfs_root=self.sysfs,
            procfs_root=self.procfs,
            dev_root=self.root,
            driver_root=self.root,
            state_dir=self.state,
            **options,
        )
        self.backends.append(backend)
        return backend

    def control(self, command: str) -> str:
        return self.mock.control(command)

    def gpu_state(self, index: int) -> dict[str, Any]:
        gpu: dict[str, Any] = self.mock.state()["gpus"][index]
        return gpu

    def restart(self, machine: str, mock_state: Path) -> None:
        """The driver process starts again: NVML is shut down and loaded afresh on the same hardware."""
        for backend in self.backends:
            backend.close()
        self.backends.clear()
        self.mock.configure(machine, mock_state, proc_root=self.procfs)


@pytest.fixture(scope="session")
def mock() -> MockNvml:
    return MockNvml()


@pytest.fixture
def make_node(tmp_path: Path, mock: MockNvml) -> Iterator[Callable[..., Node]]:
    made: list[Node] = []

    def make(machine: str = "dgxh100:2", mock_state: Path | None = None) -> Node:
        root = install_driver_root(tmp_path / "driver-root")
        procfs = install_procfs(tmp_path / "proc")
        mock.configure(machine, mock_state, proc_root=procfs)
        node = Node(mock, root, procfs, tmp_path / "sys", tmp_path / "state")
        made.append(node)
        return node

    yield make
    for node in made:
        for backend in node.backends:
            backend.close()


@pytest.fixture
def node(make_node: Callable[..., Node]) -> Node:
    return make_node()


# --- loading -------------------------------------------------------------------------------------


def _python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_a_bare_pynvml_init_works_on_the_library(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOCK_NVML_")}
    env["LD_LIBRARY_PATH"] = str(mock_nvml_library().parent)
    done = _python(
        "import pynvml; pynvml.nvmlInit(); h = pynvml.nvmlDeviceGetHandleByIndex(7); "
        "print(pynvml.nvmlDeviceGetCount(), pynvml.nvmlDeviceGetName(h))",
        env,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "8 NVIDIA H100 80GB HBM3"  # a DGX H100 unless told otherwise


def test_the_backend_loads_nvml_from_the_driver_root_without_a_library_path(tmp_path: Path) -> None:
    root = install_driver_root(tmp_path / "driver-root")
    env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH",) and not k.startswith("MOCK_")}
    env["MOCK_NVML_MACHINE"] = "dgxa100:3"
    done = _python(
        "from pathlib import Path; from dra_driver.devices.nvml import NvmlBackend; "
        f"b = NvmlBackend(driver_root=Path({str(root)!r}), dev_root=Path({str(root)!r})); "
        "print(len(b.inventory().gpus)); "
        "print(next(l for l in open('/proc/self/maps') if 'libnvidia-ml' in l).split()[-1])",
        env,
    )
    assert done.returncode == 0, done.stderr
    *_logs, count, loaded = done.stdout.strip().splitlines()  # log lines go to stdout too
    assert count == "3"
    assert Path(loaded) == mock_nvml_library().resolve()
    assert (root / LIBRARY_DIR / "libnvidia-ml.so.1").resolve() == Path(loaded)


def test_without_nvml_the_error_points_to_the_simulator(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def no_library() -> None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlInit", no_library)
    with pytest.raises(
        DeviceError, match=r"NVML not available: NVML Shared Library Not Found.*--simulate PROFILE"
    ):
        NvmlBackend(dev_root=tmp_path)


def test_open_backend_picks_the_simulator_or_nvml(tmp_path: Path, node: Node) -> None:
    simulated = open_backend("l4x4", tmp_path / "data", "node-a")
    assert isinstance(simulated, SimulatedBackend)
    # No dev root given: the driver root holds /dev/nvidiactl, so its /dev is where the nodes are.
    real = open_backend(
        None, node.state, "node-a", sysfs_root=node.sysfs, procfs_root=node.procfs, driver_root=node.root
    )
    node.backends.append(real)  # type: ignore[arg-type]
    assert isinstance(real, NvmlBackend)
    assert len(real.inventory().gpus) == 2


# --- reading -------------------------------------------------------------------------------------


def test_full_gpus_are_described_from_nvidias_data(node: Node) -> None:
    inventory = node.backend().inventory()
    assert (inventory.driver_version, inventory.cuda_driver_version) == ("550.54.15", (12, 4))
    first, second = inventory.gpus
    assert (first.index, first.minor, second.index, second.minor) == (0, 0, 1, 1)
    assert first.uuid.startswith("GPU-")
    assert first.uuid != second.uuid
    assert (first.product_name, first.brand, first.architecture) == (
        "NVIDIA H100 80GB HBM3",
        "Nvidia",
        "Hopper",
    )
    assert first.cuda_compute_capability == (9, 0)
    assert first.memory_bytes == 81920 * 2**20
    assert (first.pci_device_id, first.pci_vendor_id, first.pci_bus_id) == (0x2330, 0x10DE, "0000:18:00.0")
    assert first.multiprocessors == 132  # NVML reports no core count here: the catalog's H100 value
    assert (first.mig_capable, first.mig_enabled, first.mig_mode_change_requires_reset) == (
        True,
        False,
        False,
    )
    assert sorted(p.name for p in first.mig_profiles) == [
        "1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb",
    ]  # fmt: skip
    three_g = first.profile("3g.40gb")
    assert three_g is not None
    assert (three_g.profile_id, three_g.multiprocessors, three_g.instance_count) == (THREE_G, 48, 2)
    assert three_g.placements == (Placement(0, 3), Placement(4, 3))
    assert first.memory_slices == 7


def test_the_counter_set_of_a_mock_h100_holds_no_more_than_the_gpu(node: Node) -> None:
    """NVIDIA's mock table adds up to 120Gi and 7 decoders on an 80 GB GPU with 5 (issue 22)."""
    gpu = build_devices(node.backend().inventory())[0]
    assert gpu.counter_set is not None
    counters = {name: int(counter["value"]) for name, counter in gpu.counter_set["counters"].items()}
    full = gpu.devices[0]
    assert full["name"] == "gpu-0"
    capacity = {name: int(value["value"]) for name, value in full["capacity"].items()}
    assert counters["memory"] == capacity["memory"] == 81920 * 2**20
    assert counters["decoders"] == capacity["decoders"] == 5  # 7g.80gb's, as NVIDIA publishes
    assert counters["multiprocessors"] == capacity["multiprocessors"] == 132  # what CUDA sees whole


def test_the_virtualization_mode_is_bare_metal_unless_set(node: Node) -> None:
    """NVIDIA's driver asks it before offering dynamic MIG, which a vGPU guest cannot repartition."""
    node.backend()  # NVML started on the mock
    first, second = (pynvml.nvmlDeviceGetHandleByIndex(i) for i in (0, 1))
    assert pynvml.nvmlDeviceGetVirtualizationMode(first) == pynvml.NVML_GPU_VIRTUALIZATION_MODE_NONE
    node.control("virtualization 1 vgpu")
    assert pynvml.nvmlDeviceGetVirtualizationMode(second) == pynvml.NVML_GPU_VIRTUALIZATION_MODE_VGPU
    assert pynvml.nvmlDeviceGetVirtualizationMode(first) == pynvml.NVML_GPU_VIRTUALIZATION_MODE_NONE
    with pytest.raises(MockNvmlError, match="not none, passthrough"):
        node.control("virtualization 0 sriov")


def test_every_call_of_nvidias_dynamic_mig_path_answers(node: Node) -> None:
    """The NVML calls NVIDIA's gpu-kubelet-plugin makes to offer and create a MIG device
    (isDynamicMIGCapable, createMigDevice in cmd/gpu-kubelet-plugin/nvlib.go), in its order."""
    node.backend()
    gpu = pynvml.nvmlDeviceGetHandleByUUID(pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(0)))
    assert pynvml.nvmlDeviceGetVirtualizationMode(gpu) == pynvml.NVML_GPU_VIRTUALIZATION_MODE_NONE
    assert pynvml.nvmlDeviceGetArchitecture(gpu) == pynvml.NVML_DEVICE_ARCH_HOPPER
    pynvml.nvmlDeviceSetMigMode(gpu, pynvml.NVML_DEVICE_MIG_ENABLE)
    info = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(gpu, ONE_G)
    placement = pynvml.c_nvmlGpuInstancePlacement_t(2, 1)
    gpu_instance = pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(gpu, info.id, ctypes.pointer(placement))
    assert pynvml.nvmlGpuInstanceGetInfo(gpu_instance).placement.start == 2
    ci_info = pynvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
        gpu_instance,
        pynvml.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE,
        pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED,
    )
    compute_instance = pynvml.nvmlGpuInstanceCreateComputeInstance(gpu_instance, ci_info.id)
    # nvml.h documents the compute instance's `device` as its parent GPU, and so the mock answers;
    # NVIDIA's plugin reads the new MIG device's UUID from it (see docs/mock-nvml.md).
    parent = pynvml.nvmlComputeInstanceGetInfo(compute_instance).device
    assert pynvml.nvmlDeviceGetUUID(parent) == pynvml.nvmlDeviceGetUUID(gpu)
    mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu, 0)
    assert pynvml.nvmlDeviceGetUUID(mig).startswith("MIG-")
    pynvml.nvmlComputeInstanceDestroy(compute_instance)
    pynvml.nvmlGpuInstanceDestroy(gpu_instance)
    pynvml.nvmlDeviceSetMigMode(gpu, pynvml.NVML_DEVICE_MIG_DISABLE)


def test_ampere_needs_a_reset_for_mig_mode(make_node: Callable[..., Node]) -> None:
    (a100,) = make_node("dgxa100:1").backend().inventory().gpus
    assert (a100.architecture, a100.mig_mode_change_requires_reset) == ("Ampere", True)
    assert a100.multiprocessors == 108
    assert a100.profile("7g.40gb") is not None


def test_static_mig_devices_are_read_with_their_capability_nodes(node: Node) -> None:
    node.control("mig 1 1")
    gi = node.control(f"create-gi 1 {THREE_G} 4")
    mig_uuid = node.control(f"create-ci 1 {gi} 2")  # the 3-slice compute instance spans it
    inventory = node.backend().inventory()
    first, second = inventory.gpus
    assert (first.mig_enabled, first.mig_devices) == (False, ())
    (device,) = second.mig_devices
    assert (device.uuid, device.profile, device.placement, device.parent_uuid) == (
        mig_uuid,
        "3g.40gb",
        Placement(4, 3),
        second.uuid,
    )
    assert (device.gpu_instance_id, device.compute_instance_id) == (1, 0)
    # The minors come from the capability files the kernel driver (here, the mock) writes in procfs.
    assert [(n.path, n.major, n.minor) for n in device.cap_nodes] == [
        ("/dev/nvidia-caps/nvidia-cap1210", CAPS_MAJOR, 1210),
        ("/dev/nvidia-caps/nvidia-cap1211", CAPS_MAJOR, 1211),
    ]


def test_a_gpu_instance_without_a_compute_instance_keeps_its_slices(node: Node) -> None:
    node.control("mig 0 1")
    node.control(f"create-gi 0 {FOUR_G} 0")  # an administrator's GPU instance, no compute instance yet
    inventory = node.backend().inventory()
    gpu = inventory.gpus[0]
    assert gpu.mig_devices == ()
    assert gpu.reserved_placements == (("4g.40gb", Placement(0, 4)),)
    offered = {d["name"] for d in build_devices(inventory)[0].devices}
    one_g = {f"gpu-0-mig-1g10gb-{ONE_G}-{start}" for start in range(7)}
    # Only the free slices are offered (the names carry the profile without its dot).
    assert offered & one_g == {f"gpu-0-mig-1g10gb-{ONE_G}-{start}" for start in (4, 5, 6)}


def test_a_gpu_instance_with_several_compute_instances_is_not_published(node: Node) -> None:
    node.control("mig 0 1")
    gi = node.control(f"create-gi 0 {THREE_G} 0")
    node.control(f"create-ci 0 {gi} 0")
    node.control(f"create-ci 0 {gi} 0")  # two 1-slice compute instances: two MIG devices at one placement
    inventory = node.backend().inventory()
    assert inventory.gpus[0].mig_devices == ()
    assert inventory.gpus[0].reserved_placements == (("3g.40gb", Placement(0, 3)),)
    names = [d["name"] for devices in build_devices(inventory) for d in devices.devices]
    assert len(names) == len(set(names))


def test_one_failing_gpu_leaves_the_others_published(node: Node) -> None:
    node.control("fail nvmlDeviceGetMemoryInfo 999 gpu=1")
    with capture_logs() as logs:
        inventory = node.backend().inventory()
    assert [g.index for g in inventory.gpus] == [0]
    (left_out,) = [e for e in logs if e["event"] == "gpu_left_out_of_inventory"]
    assert left_out["index"] == 1
    assert "Unknown Error" in left_out["error"]


def test_a_lost_gpu_at_start_up_is_left_out(node: Node) -> None:
    node.control("lose 0")
    assert [g.index for g in node.backend().inventory().gpus] == [1]


def test_an_older_driver_without_a_mig_call_is_read_as_not_mig_capable(node: Node) -> None:
    node.control("fail nvmlDeviceGetMigMode 13")  # FUNCTION_NOT_FOUND, as for a missing symbol
    gpus = node.backend().inventory().gpus
    assert [(g.mig_capable, g.mig_profiles) for g in gpus] == [(False, ()), (False, ())]


def test_a_hanging_nvml_call_fails_the_read_with_a_timeout(node: Node) -> None:
    backend = node.backend(call_timeout=0.3)
    node.control("hang nvmlDeviceGetCount_v2 2000 count=1")
    with pytest.raises(DeviceError, match=r"reading the GPU inventory: NVML did not answer within 0.3s"):
        backend.inventory()


def test_a_mig_device_made_after_its_creation_timed_out_is_destroyed_again(node: Node) -> None:
    backend = node.backend(call_timeout=0.3)
    gpu = backend.inventory().gpus[0]
    node.control("hang nvmlDeviceCreateGpuInstanceWithPlacement 1500 count=1")
    with capture_logs() as logs:
        with pytest.raises(
            DeviceError, match=rf"creating a MIG device on GPU {gpu.uuid}: NVML did not answer"
        ):
            backend.create_mig_device(gpu.uuid, TWO_G, Placement(2, 2))
        assert backend.inventory().gpus[0].uuid == gpu.uuid  # the next call is answered meanwhile
        # NVML goes on and makes it; the claim it was for has failed, so it must not stay.
        deadline = time.monotonic() + 30
        while not any(e["event"] == "abandoned_mig_device_destroyed" for e in logs):
            assert time.monotonic() < deadline, "the late MIG device was never destroyed"
            time.sleep(0.05)
    state = node.gpu_state(0)
    assert (state["gpuInstances"], state["migCurrent"], state["migPending"]) == ([], 0, 0)


def test_the_inventory_dumps_to_json(node: Node) -> None:
    node.control("mig 0 1")
    gi = node.control(f"create-gi 0 {ONE_G} 3")
    node.control(f"create-ci 0 {gi} 0")
    dumped = json.loads(json.dumps(node.backend().inventory().as_dict()))
    assert dumped["gpus"][0]["mig_devices"][0]["placement"] == {"start": 3, "size": 1}


# --- creating and destroying ---------------------------------------------------------------------


def test_hopper_switches_mig_mode_on_creates_the_placement_and_switches_it_off_again(node: Node) -> None:
    backend = node.backend()
    gpu = backend.inventory().gpus[0]
    created = backend.create_mig_device(gpu.uuid, TWO_G, Placement(2, 2))
    assert (created.profile, created.placement, created.parent_uuid) == ("2g.20gb", Placement(2, 2), gpu.uuid)
    assert created.cap_nodes[0].major == CAPS_MAJOR
    assert node.gpu_state(0)["migCurrent"] == 1
    (shown,) = backend.inventory().gpus[:1]
    assert shown.mig_devices == (created,)
    backend.destroy_mig_device(gpu.uuid, created.uuid)
    assert (node.gpu_state(0)["migCurrent"], node.gpu_state(0)["gpuInstances"]) == (0, [])


def test_a_created_mig_device_gets_its_capability_nodes_on_the_host(node: Node) -> None:
    """The host's /dev/nvidia-caps is empty at start, as on a host where nvidia-modprobe never ran."""
    caps = node.root / "dev" / "nvidia-caps"
    assert not caps.exists()
    backend = node.backend()
    gpu = backend.inventory().gpus[0]
    created = backend.create_mig_device(gpu.uuid, ONE_G, Placement(3, 1))
    assert len(created.cap_nodes) == 2
    for cap in created.cap_nodes:
        assert cap.host_path is None  # the CDI spec names the container path only, as NVIDIA's does
        host = node.root / cap.path.removeprefix("/")
        info = host.lstat()
        assert stat.S_ISCHR(info.st_mode), host
        assert (os.major(info.st_rdev), os.minor(info.st_rdev)) == (CAPS_MAJOR, cap.minor)
        assert stat.S_IMODE(info.st_mode) == 0o444  # DeviceFileMode 292 in the access file
    # The same device read again (e.g. after a restart) names the same nodes.
    (again,) = backend.inventory().gpus[0].mig_devices
    assert again.cap_nodes == created.cap_nodes


def test_capability_nodes_that_exist_or_may_not_be_modified_are_left_alone(tmp_path: Path) -> None:
    existing = Capability(minor=7, mode=0o444, modify=True)
    host = tmp_path / "dev" / "nvidia-caps" / "nvidia-cap7"
    host.parent.mkdir(parents=True)
    host.write_text("an administrator's")
    assert not ensure_node(tmp_path, existing, CAPS_MAJOR)
    assert host.read_text() == "an administrator's"
    assert not ensure_node(tmp_path, Capability(minor=8, mode=0o444, modify=False), CAPS_MAJOR)
    assert not (host.parent / "nvidia-cap8").exists()


def test_mig_mode_an_administrator_enabled_stays_after_the_last_destroy(node: Node) -> None:
    node.control("mig 0 1")
    backend = node.backend()
    uuid = backend.inventory().gpus[0].uuid
    created = backend.create_mig_device(uuid, ONE_G, Placement(0, 1))
    backend.destroy_mig_device(uuid, created.uuid)
    assert (node.gpu_state(0)["migCurrent"], node.gpu_state(0)["gpuInstances"]) == (1, [])


def test_ampere_with_mig_mode_off_is_left_alone(make_node: Callable[..., Node]) -> None:
    node = make_node("dgxa100:1")
    backend = node.backend()
    uuid = backend.inventory().gpus[0].uuid
    with pytest.raises(DeviceError, match="needs a GPU reset") as refused:
        backend.create_mig_device(uuid, ONE_G, Placement(0, 1))
    assert type(refused.value) is DeviceError
    assert (node.gpu_state(0)["migCurrent"], node.gpu_state(0)["migPending"]) == (0, 0)


def test_ampere_in_mig_mode_creates_without_touching_the_mode(make_node: Callable[..., Node]) -> None:
    node = make_node("dgxa100:1")
    node.control("mig 0 1")
    backend = node.backend()
    uuid = backend.inventory().gpus[0].uuid
    created = backend.create_mig_device(uuid, SEVEN_G, Placement(0, 8))
    assert created.profile == "7g.40gb"
    backend.destroy_mig_device(uuid, created.uuid)
    assert (node.gpu_state(0)["migCurrent"], node.gpu_state(0)["migPending"]) == (1, 1)


def test_a_busy_gpu_refuses_mig_mode_and_its_pending_mode_is_put_back(node: Node) -> None:
    backend = node.backend()
    uuid = backend.inventory().gpus[0].uuid
    node.control("busy 0 on")
    with pytest.raises(DeviceInUseError, match="in use"):
        backend.create_mig_device(uuid, ONE_G, Placement(0, 1))
    state = node.gpu_state(0)
    # Left pending, the GPU would come up in MIG mode at its next reset.
    assert (state["migCurrent"], state["migPending"], state["gpuInstances"]) == (0, 0, [])


def test_a_gpu_renumbered_by_the_mig_mode_switch_is_read_again(node: Node) -> None:
    node.control("renumber on")  # nvml.h: SetMigMode may reset the GPU and change its minor number
    backend = node.backend()
    uuid = backend.inventory().gpus[0].uuid
    created = backend.create_mig_device(uuid, ONE_G, Placement(0, 1))
    renumbered = node.gpu_state(0)["minor"]
    assert renumbered != 0
    assert created.cap_nodes[0].minor == 1000 + 200 * renumbered + 10 * created.gpu_instance_id


def test_an_overlap_the_hardware_refuses_is_a_placement_error(node: Node) -> None:
    node.control("mig 0 1")
    node.control(f"create-gi 0 {FOUR_G} 0")
    backend = node.backend()
    with pytest.raises(PlacementUnavailableError, match="taken by a live MIG instance"):
        backend.create_mig_device(backend.inventory().gpus[0].uuid, ONE_G, Placement(2, 1))
    assert len(node.gpu_state(0)["gpuInstances"]) == 1


def test_placements_and_profiles_the_gpu_does_not_offer_never_reach_nvml(node: Node) -> None:
    backend = node.backend()
    uuid = backend.inventory().gpus[0].uuid
    with pytest.raises(PlacementUnavailableError, match=r"3g\.40gb starts only at slices 0, 4"):
        backend.create_mig_device(uuid, THREE_G, Placement(2, 3))
    with pytest.raises(PlacementUnavailableError, match="no such profile"):
        backend.create_mig_device(uuid, 77, Placement(0, 1))
    assert node.gpu_state(0)["migCurrent"] == 0


def test_a_failed_compute_instance_leaves_the_gpu_as_it_was(node: Node) -> None:
    backend = node.backend()
    uuid = backend.inventory().gpus[0].uuid
    node.control("fail nvmlGpuInstanceCreateComputeInstance 23 count=1")
    with pytest.raises(PlacementUnavailableError):
        backend.create_mig_device(uuid, THREE_G, Placement(0, 3))
    assert (node.gpu_state(0)["gpuInstances"], node.gpu_state(0)["migCurrent"]) == ([], 0)


def test_a_rollback_step_that_fails_once_is_tried_again(node: Node) -> None:
    backend = node.backend()
    uuid = backend.inventory().gpus[0].uuid
    (node.procfs / "devices").write_text(
        "Character devices:\n195 nvidia\n\nBlock devices:\n"
    )  # no nvidia-caps
    node.control("fail nvmlComputeInstanceDestroy 999 count=1")
    with pytest.raises(DeviceError, match="no nvidia-caps"):
        backend.create_mig_device(uuid, THREE_G, Placement(4, 3))
    assert (node.gpu_state(0)["gpuInstances"], node.gpu_state(0)["migCurrent"]) == ([], 0)


def test_destroying_a_busy_mig_device_is_retryable(node: Node) -> None:
    backend = node.backend()
    uuid = backend.inventory().gpus[0].uuid
    created = backend.create_mig_device(uuid, SEVEN_G, Placement(0, 7))
    node.control(f"busy-gi 0 {created.gpu_instance_id} on")
    with pytest.raises(DeviceInUseError):
        backend.destroy_mig_device(uuid, created.uuid)
    assert len(node.gpu_state(0)["gpuInstances"]) == 1


def test_destroying_an_unknown_mig_device_is_a_no_op(node: Node) -> None:
    backend = node.backend()
    backend.destroy_mig_device(backend.inventory().gpus[0].uuid, "MIG-gone")


def test_an_unknown_gpu_is_an_error(node: Node) -> None:
    with pytest.raises(DeviceError, match="no GPU GPU-nope on this node"):
        node.backend().create_mig_device("GPU-nope", ONE_G, Placement(0, 1))


# --- restarts and reboots ------------------------------------------------------------------------


def test_mig_devices_survive_a_driver_restart_and_are_adopted(
    make_node: Callable[..., Node], tmp_path: Path
) -> None:
    hardware = tmp_path / "hardware"
    node = make_node("dgxh100:2", mock_state=hardware)
    backend = node.backend()
    uuid = backend.inventory().gpus[1].uuid
    created = backend.create_mig_device(uuid, TWO_G, Placement(4, 2))
    node.restart("dgxh100:2", hardware)
    (adopted,) = node.backend().inventory().gpus[1].mig_devices
    assert adopted == created


def test_after_a_reboot_mig_mode_the_driver_switched_on_goes_off(
    make_node: Callable[..., Node], tmp_path: Path
) -> None:
    hardware = tmp_path / "hardware"
    node = make_node("dgxh100:2", mock_state=hardware)
    node.control("mig 1 1")  # the administrator's, on GPU 1
    backend = node.backend()
    uuid = backend.inventory().gpus[0].uuid
    backend.create_mig_device(uuid, ONE_G, Placement(0, 1))
    node.restart("dgxh100:2", hardware)
    node.control("reboot")  # MIG mode persists, instances do not
    first, second = node.backend().inventory().gpus
    assert (first.mig_enabled, second.mig_enabled) == (False, True)


def test_a_gpu_lost_later_stays_as_last_read_so_its_taint_has_a_device(node: Node) -> None:
    backend = node.backend()
    before = backend.inventory()
    node.control("lose 1")
    with capture_logs() as logs:
        assert backend.inventory().gpus == before.gpus
    assert [e["index"] for e in logs if e["event"] == "gpu_read_failed_kept_as_last_read"] == [1]


def _leak_a_gpu_instance(node: Node, backend: NvmlBackend, function: str) -> str:
    """A MIG device whose creation fails after its GPU instance, and whose rollback keeps failing."""
    uuid = backend.inventory().gpus[0].uuid
    (node.procfs / "devices").write_text(
        "Character devices:\n195 nvidia\n\nBlock devices:\n"
    )  # no nvidia-caps
    node.control(f"fail {function} 999 count=50")  # beyond every attempt of the rollback
    with capture_logs() as logs, pytest.raises(DeviceError, match="no nvidia-caps"):
        backend.create_mig_device(uuid, THREE_G, Placement(4, 3))
    assert [e["attempt"] for e in logs if e["event"] == "mig_rollback_failed"] == [1, 2, 3]
    assert [e["event"] for e in logs if e["event"] == "gpu_instance_orphaned"] == ["gpu_instance_orphaned"]
    install_procfs(node.procfs)
    return uuid


def _offered_one_g(backend: NvmlBackend) -> set[int]:
    offered = {d["name"] for d in build_devices(backend.inventory())[0].devices}
    return {start for start in range(7) if f"gpu-0-mig-1g10gb-{ONE_G}-{start}" in offered}


def test_a_gpu_instance_a_failing_rollback_left_is_reserved_then_destroyed_once_nvml_answers(
    node: Node,
) -> None:
    backend = node.backend()
    _leak_a_gpu_instance(node, backend, "nvmlGpuInstanceDestroy")
    (left,) = node.gpu_state(0)["gpuInstances"]  # the GPU instance outlived the rollback ...
    assert left["computeInstances"] == []
    # ... and while NVML keeps failing, the refresh cannot destroy it: its slices are never offered.
    inventory = backend.inventory()
    assert inventory.gpus[0].reserved_placements == (("3g.40gb", Placement(4, 3)),)
    assert _offered_one_g(backend) == {0, 1, 2, 3}
    node.control("clear-faults")
    with capture_logs() as logs:
        assert _offered_one_g(backend) == set(range(7))  # the next refresh destroyed it
    assert node.gpu_state(0)["gpuInstances"] == []
    assert node.gpu_state(0)["migCurrent"] == 0  # the driver had switched MIG mode on for it
    assert [e["placement"] for e in logs if e["event"] == "orphaned_gpu_instance_destroyed"] == [4]
    assert backend.inventory().gpus[0].reserved_placements == ()


def test_a_compute_instance_a_failing_rollback_left_is_not_published_and_is_destroyed_later(
    node: Node,
) -> None:
    backend = node.backend()
    _leak_a_gpu_instance(node, backend, "nvmlComputeInstanceDestroy")
    (left,) = node.gpu_state(0)["gpuInstances"]
    assert len(left["computeInstances"]) == 1  # a whole MIG device, that no claim holds
    gpu = backend.inventory().gpus[0]
    assert (gpu.mig_devices, gpu.reserved_placements) == ((), (("3g.40gb", Placement(4, 3)),))
    node.control("clear-faults")
    assert _offered_one_g(backend) == set(range(7))
    assert node.gpu_state(0)["gpuInstances"] == []


def test_an_orphaned_gpu_instance_handed_back_at_the_next_start_is_destroyed(
    make_node: Callable[..., Node], tmp_path: Path
) -> None:
    """The node keeps the backend's orphans in its store and hands them back at its next start."""
    hardware = tmp_path / "hardware"
    node = make_node("dgxh100:2", mock_state=hardware)
    first = node.backend()
    uuid = _leak_a_gpu_instance(node, first, "nvmlGpuInstanceDestroy")
    remembered = first.orphaned_gpu_instances()
    assert remembered == {OrphanedGpuInstance(uuid, THREE_G, Placement(4, 3))}
    node.control("clear-faults")
    node.restart("dgxh100:2", hardware)
    node.backend().adopt_orphaned_gpu_instances(remembered)  # before any inventory is read
    assert node.gpu_state(0)["gpuInstances"] == []


def test_a_control_node_that_loads_after_start_is_in_the_next_inventory(node: Node) -> None:
    uvm = node.root / "dev" / "nvidia-uvm"
    uvm.unlink()  # nvidia-uvm loads lazily, at the first CUDA call on the host
    backend = node.backend()
    assert "/dev/nvidia-uvm" not in [n.path for n in backend.inventory().control_nodes]
    uvm.symlink_to("/dev/zero")
    assert "/dev/nvidia-uvm" in [n.path for n in backend.inventory().control_nodes]


def test_a_gpu_whose_mig_state_cannot_be_read_is_left_out_with_a_reason(node: Node) -> None:
    node.control("mig 0 1")
    gi = node.control(f"create-gi 0 {ONE_G} 0")
    node.control(f"create-ci 0 {gi} 0")
    node.control("fail nvmlDeviceGetMigDeviceHandleByIndex 999 gpu=0")  # NVML_ERROR_UNKNOWN
    with capture_logs() as logs:
        gpus = node.backend().inventory().gpus
    assert [gpu.index for gpu in gpus] == [1]
    (left_out,) = [e for e in logs if e["event"] == "gpu_left_out_of_inventory"]
    assert left_out["index"] == 0
    assert "reading GPU 0: Unknown Error" in left_out["error"]


def test_a_read_only_backend_changes_nothing_it_would_otherwise_clean_up(node: Node) -> None:
    backend = node.backend()
    uuid = _leak_a_gpu_instance(node, backend, "nvmlGpuInstanceDestroy")  # MIG mode on, by the driver
    node.control("clear-faults")
    before = node.mock.state()
    reader = node.backend(read_only=True)  # would reconcile MIG mode and destroy the orphan at start
    reader.adopt_orphaned_gpu_instances(backend.orphaned_gpu_instances())
    assert reader.inventory().gpus[0].reserved_placements == (("3g.40gb", Placement(4, 3)),)
    for change in (
        lambda: reader.create_mig_device(uuid, ONE_G, Placement(0, 1)),
        lambda: reader.destroy_mig_device(uuid, "MIG-any"),
    ):
        with pytest.raises(DeviceError, match="opened read-only"):
            change()
    assert node.mock.state() == before


def test_a_mig_device_made_where_an_orphan_was_is_never_taken_for_it(node: Node) -> None:
    backend = node.backend()
    uuid = _leak_a_gpu_instance(node, backend, "nvmlGpuInstanceDestroy")
    node.control("clear-faults")
    node.control("reset 0")  # the orphan goes with the reset, before the driver destroyed it
    created = backend.create_mig_device(uuid, THREE_G, Placement(4, 3))  # a claim's, at the same place
    assert backend.inventory().gpus[0].mig_devices == (created,)
    assert len(node.gpu_state(0)["gpuInstances"]) == 1
