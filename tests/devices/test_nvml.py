"""The NVML backend's logic, against a fake of the pynvml module surface.

No GPU exists here, so the GPU itself is the one stand-in: ``FakeNvml`` answers the
pynvml functions the backend calls, with pynvml's real ctypes structs and error
classes, and models what the hardware does (placements, overlaps, MIG mode, the
kernel's capability files in procfs). Every other pynvml function is replaced by
one that fails the test, so the backend provably calls nothing else -- no reset
among them. The fake hardware is built from the shipped catalog, so the NVML
backend and the simulator are checked to describe the same GPU the same way.
"""

from __future__ import annotations

import ctypes
import dataclasses
import inspect
import json
import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pynvml
import pytest

from dra_driver.devices.backend import DeviceError, DeviceInUseError, PlacementUnavailableError
from dra_driver.devices.backends import open_backend
from dra_driver.devices.catalog import GpuModel, gpu_model
from dra_driver.devices.fabric import node_clique
from dra_driver.devices.nvml import NvmlBackend
from dra_driver.devices.simulated import SimulatedBackend
from dra_driver.devices.types import DeviceNode, Placement

ARCHITECTURES = {"Turing": 6, "Ampere": 7, "Ada Lovelace": 8, "Hopper": 9, "Blackwell": 10}
CAPS_MAJOR = 236  # deliberately not the simulator's 237: the backend must read it from /proc/devices


def _nvml_error(code: int) -> pynvml.NVMLError:
    return pynvml.NVMLError(code)


@dataclass(eq=False)
class FakeComputeInstance:
    gpu_instance: FakeGpuInstance
    id: int
    uuid: str
    busy: bool = False


@dataclass(eq=False)
class FakeGpuInstance:
    gpu: FakeGpu
    id: int
    profile_id: int
    placement: Placement
    compute_instances: dict[int, FakeComputeInstance] = field(default_factory=dict)


@dataclass(frozen=True)
class FakeMigDevice:
    compute_instance: FakeComputeInstance


@dataclass(eq=False)
class FakeGpu:
    model: GpuModel
    index: int
    uuid: str
    nvml_bus_id: bytes  # as NVML reports it: 32-bit domain, upper case
    cores: int | None  # None: NVML says NotSupported
    mig_mode: int = pynvml.NVML_DEVICE_MIG_DISABLE
    full_gpu_busy: bool = False
    struct_names: dict[int, bytes] = field(default_factory=dict)
    gpu_instances: dict[int, FakeGpuInstance] = field(default_factory=dict)
    # (cluster uuid bytes, clique id, nvmlGpuFabricState_t); None: NVML says NotSupported
    fabric: tuple[bytes, int, int] | None = None

    @property
    def minor(self) -> int:
        return self.index

    def profile(self, profile_id: int):
        return next((p for p in self.model.mig_profiles if p.profile_id == profile_id), None)


class FakeNvml:
    """The pynvml functions the backend uses, answering like the GPUs in ``gpus`` would."""

    def __init__(self, gpus: list[FakeGpu], procfs: Path) -> None:
        self.gpus = gpus
        self.procfs = procfs
        self.calls: list[str] = []
        self.mig_mode_changes: list[tuple[str, int]] = []
        self.fail_next_compute_instance = False
        self.initialised = False
        self._serial = 0
        procfs.mkdir(parents=True, exist_ok=True)
        (procfs / "devices").write_text(
            f"Character devices:\n  1 mem\n195 nvidia-frontend\n{CAPS_MAJOR} nvidia-caps\n510 nvidia-uvm\n\n"
            "Block devices:\n  8 sd\n259 blkext\n"
        )

    # --- the capability files the kernel driver keeps for each GPU / compute instance ---

    def _caps_dir(self, gi: FakeGpuInstance) -> Path:
        return (
            self.procfs / "driver" / "nvidia" / "capabilities" / f"gpu{gi.gpu.minor}" / "mig" / f"gi{gi.id}"
        )

    def _write_caps(self, gi: FakeGpuInstance, ci: FakeComputeInstance) -> None:
        base = self._caps_dir(gi)
        (base / f"ci{ci.id}").mkdir(parents=True, exist_ok=True)
        (base / "access").write_text(
            f"DeviceFileMinor: {1000 + 10 * gi.id}\nDeviceFileMode: 292\nDeviceFileModify: 1\n"
        )
        (base / f"ci{ci.id}" / "access").write_text(
            f"DeviceFileMinor: {1001 + 10 * gi.id + ci.id}\nDeviceFileMode: 292\n"
        )

    # --- library ---

    def nvmlInit(self):
        self.initialised = True

    def nvmlShutdown(self):
        self.calls.append("nvmlShutdown")

    def nvmlErrorString(self, code):
        return {19: "In use by another client", 23: "Insufficient resources"}.get(code, f"error {code}")

    def nvmlSystemGetDriverVersion(self):
        return "580.95.05"

    def nvmlSystemGetCudaDriverVersion(self):
        return 12080

    # --- full GPUs ---

    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index):
        return self.gpus[index]

    def nvmlDeviceGetHandleByUUID(self, gpu_uuid):
        gpu = next((g for g in self.gpus if g.uuid == gpu_uuid), None)
        if gpu is None:
            raise _nvml_error(pynvml.NVML_ERROR_NOT_FOUND)
        return gpu

    def nvmlDeviceGetUUID(self, handle):
        return handle.compute_instance.uuid if isinstance(handle, FakeMigDevice) else handle.uuid

    def nvmlDeviceGetName(self, gpu):
        return gpu.model.product_name

    def nvmlDeviceGetBrand(self, gpu):
        return pynvml.NVML_BRAND_NVIDIA

    def nvmlDeviceGetArchitecture(self, gpu):
        return ARCHITECTURES[gpu.model.architecture]

    def nvmlDeviceGetCudaComputeCapability(self, gpu):
        return gpu.model.cuda_compute_capability

    def nvmlDeviceGetMemoryInfo(self, gpu):
        return pynvml.c_nvmlMemory_t(total=gpu.model.memory_bytes, free=gpu.model.memory_bytes, used=0)

    def nvmlDeviceGetNumGpuCores(self, gpu):
        if gpu.cores is None:
            raise _nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return gpu.cores

    def nvmlDeviceGetPciInfo(self, gpu):
        info = pynvml.nvmlPciInfo_t()
        info.busId = gpu.nvml_bus_id
        info.pciDeviceId = gpu.model.pci_device_id << 16 | gpu.model.pci_vendor_id
        return info

    def nvmlDeviceGetMinorNumber(self, gpu):
        return gpu.minor

    def nvmlDeviceGetGpuFabricInfo(self, gpu, info_ref):
        if gpu.fabric is None:
            raise _nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        info = info_ref._obj
        cluster, info.cliqueId, info.state = gpu.fabric
        info.clusterUuid[:] = list(cluster)
        info.status = pynvml.NVML_SUCCESS

    # --- MIG mode and profiles ---

    def nvmlDeviceGetMigMode(self, gpu):
        if not gpu.model.mig_capable:
            raise _nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return [gpu.mig_mode, gpu.mig_mode]

    def nvmlDeviceSetMigMode(self, gpu, mode):
        self.mig_mode_changes.append((gpu.uuid, mode))
        if gpu.model.mig_mode_change_requires_reset:
            raise AssertionError("the backend must never switch MIG mode where that resets the GPU")
        if mode == pynvml.NVML_DEVICE_MIG_DISABLE and gpu.gpu_instances:
            raise _nvml_error(pynvml.NVML_ERROR_IN_USE)
        if gpu.full_gpu_busy:
            return pynvml.NVML_ERROR_IN_USE  # the activation status
        gpu.mig_mode = mode
        return pynvml.NVML_SUCCESS

    def nvmlDeviceGetGpuInstanceProfileInfo(self, gpu, nvml_profile, version=2):
        assert version == 2
        profile = next((p for p in gpu.model.mig_profiles if p.nvml_profile == nvml_profile), None)
        if not gpu.model.mig_capable or profile is None:
            raise _nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        info = pynvml.c_nvmlGpuInstanceProfileInfo_v2_t()
        info.id = profile.profile_id
        info.sliceCount = profile.compute_slices
        info.instanceCount = profile.instance_count
        info.multiprocessorCount = profile.multiprocessors
        info.copyEngineCount = profile.copy_engines
        info.decoderCount = profile.decoders
        info.encoderCount = profile.encoders
        info.jpegCount = profile.jpeg_engines
        info.ofaCount = profile.ofa_engines
        info.memorySizeMB = profile.memory_mib
        info.name = gpu.struct_names.get(profile.profile_id, f"MIG {profile.name}".encode())
        return info

    def nvmlDeviceGetGpuInstancePossiblePlacements(self, gpu, profile_id, placements, count):
        offered = gpu.profile(profile_id).placements
        if placements is None:
            count.contents.value = len(offered)
            return pynvml.NVML_SUCCESS
        if len(placements) < len(offered):
            raise _nvml_error(pynvml.NVML_ERROR_INSUFFICIENT_SIZE)
        for slot, placement in zip(placements, offered, strict=False):
            slot.start, slot.size = placement.start, placement.size
        count.contents.value = len(offered)
        return pynvml.NVML_SUCCESS

    # --- MIG devices ---

    def _mig_devices(self, gpu) -> list[FakeMigDevice]:
        return [
            FakeMigDevice(ci)
            for gi in sorted(gpu.gpu_instances.values(), key=lambda g: g.id)
            for ci in gi.compute_instances.values()
        ]

    def nvmlDeviceGetMaxMigDeviceCount(self, gpu):
        return 7

    def nvmlDeviceGetMigDeviceHandleByIndex(self, gpu, index):
        devices = self._mig_devices(gpu)
        if index >= len(devices):
            raise _nvml_error(pynvml.NVML_ERROR_NOT_FOUND)
        return devices[index]

    def nvmlDeviceGetGpuInstanceId(self, mig):
        return mig.compute_instance.gpu_instance.id

    def nvmlDeviceGetComputeInstanceId(self, mig):
        return mig.compute_instance.id

    def nvmlDeviceGetGpuInstanceById(self, gpu, gi_id):
        if gi_id not in gpu.gpu_instances:
            raise _nvml_error(pynvml.NVML_ERROR_NOT_FOUND)
        return gpu.gpu_instances[gi_id]

    def nvmlGpuInstanceGetInfo(self, gi):
        return pynvml.c_nvmlGpuInstanceInfo_t(
            id=gi.id,
            profileId=gi.profile_id,
            placement=pynvml.c_nvmlGpuInstancePlacement_t(gi.placement.start, gi.placement.size),
        )

    def nvmlDeviceCreateGpuInstanceWithPlacement(self, gpu, profile_id, placement):
        self.calls.append("nvmlDeviceCreateGpuInstanceWithPlacement")
        if gpu.mig_mode != pynvml.NVML_DEVICE_MIG_ENABLE:
            raise _nvml_error(pynvml.NVML_ERROR_INVALID_STATE)
        wanted = Placement(placement.contents.start, placement.contents.size)
        profile = gpu.profile(profile_id)
        if profile is None or wanted not in profile.placements:
            raise _nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        same = [gi for gi in gpu.gpu_instances.values() if gi.profile_id == profile_id]
        if any(gi.placement.overlaps(wanted) for gi in gpu.gpu_instances.values()) or len(same) >= (
            profile.instance_count
        ):
            raise _nvml_error(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
        gi_id = max(gpu.gpu_instances, default=0) + 1  # the fake numbers GIs its own way
        gpu.gpu_instances[gi_id] = FakeGpuInstance(gpu, gi_id, profile_id, wanted)
        return gpu.gpu_instances[gi_id]

    def nvmlGpuInstanceGetComputeInstanceProfileInfo(self, gi, ci_profile, engine_profile, version=2):
        assert engine_profile == pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
        slices = gi.gpu.profile(gi.profile_id).compute_slices
        if {1: 0x0, 2: 0x1, 3: 0x2, 4: 0x3, 7: 0x4}[slices] != ci_profile:
            raise _nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)  # the full-size CI is the one asked for
        info = pynvml.c_nvmlComputeInstanceProfileInfo_v2_t()
        info.id = ci_profile
        info.sliceCount = slices
        return info

    def nvmlGpuInstanceCreateComputeInstance(self, gi, ci_profile_id):
        self.calls.append("nvmlGpuInstanceCreateComputeInstance")
        if self.fail_next_compute_instance:
            self.fail_next_compute_instance = False
            raise _nvml_error(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
        self._serial += 1
        ci = FakeComputeInstance(gi, 0, f"MIG-{uuid.UUID(int=self._serial)}")
        gi.compute_instances[ci.id] = ci
        self._write_caps(gi, ci)
        return ci

    def nvmlComputeInstanceGetInfo(self, ci):
        return pynvml.c_nvmlComputeInstanceInfo_t(id=ci.id, profileId=0)

    def nvmlGpuInstanceGetComputeInstanceById(self, gi, ci_id):
        return gi.compute_instances[ci_id]

    def nvmlComputeInstanceDestroy(self, ci):
        self.calls.append("nvmlComputeInstanceDestroy")
        if ci.busy:
            raise _nvml_error(pynvml.NVML_ERROR_IN_USE)
        del ci.gpu_instance.compute_instances[ci.id]

    def nvmlGpuInstanceDestroy(self, gi):
        self.calls.append("nvmlGpuInstanceDestroy")
        if gi.compute_instances:
            raise _nvml_error(pynvml.NVML_ERROR_IN_USE)
        del gi.gpu.gpu_instances[gi.id]

    # --- what an administrator does before the driver starts ("static MIG") ---

    def admin_create(self, gpu: FakeGpu, profile_name: str, start: int) -> FakeComputeInstance:
        gpu.mig_mode = pynvml.NVML_DEVICE_MIG_ENABLE
        profile = next(p for p in gpu.model.mig_profiles if p.name == profile_name)
        where = pynvml.c_nvmlGpuInstancePlacement_t(start, profile.placements[0].size)
        gi = self.nvmlDeviceCreateGpuInstanceWithPlacement(gpu, profile.profile_id, ctypes.pointer(where))
        return self.nvmlGpuInstanceCreateComputeInstance(gi, 0)


def _forbidden(name: str):
    def call(*args, **kwargs):
        raise AssertionError(f"the NVML backend called pynvml.{name}, which it must not (or the fake lacks)")

    return call


@dataclass
class Host:
    """The host's /sys, /proc and /dev as the plugin sees them."""

    sysfs: Path
    procfs: Path
    dev: Path

    def backend(self) -> NvmlBackend:
        return NvmlBackend(sysfs_root=self.sysfs, procfs_root=self.procfs, dev_root=self.dev)


@pytest.fixture
def host(tmp_path) -> Host:
    sysfs, procfs, dev_root = tmp_path / "sys", tmp_path / "proc", tmp_path / "driver-root"
    (dev_root / "dev").mkdir(parents=True)
    # Real character devices stand in for the NVIDIA ones: the backend must report what stat() says.
    for name, target in (
        ("nvidiactl", "/dev/null"),
        ("nvidia-uvm", "/dev/zero"),
        ("nvidia-uvm-tools", "/dev/full"),
    ):
        (dev_root / "dev" / name).symlink_to(target)
    (dev_root / "dev" / "nvidia1").symlink_to("/dev/urandom")
    return Host(sysfs, procfs, dev_root)


def _plug_in(host: Host, index: int, bus: int, root: int) -> bytes:
    """Create the GPU's sysfs entry as the kernel does; return its bus id as NVML prints it."""
    bus_id = f"0000:{bus:02x}:00.0"
    device = host.sysfs / "devices" / f"pci0000:{root:02x}" / f"0000:{root:02x}:01.0" / bus_id
    device.mkdir(parents=True)
    links = host.sysfs / "bus" / "pci" / "devices"
    links.mkdir(parents=True, exist_ok=True)
    (links / bus_id).symlink_to(os.path.relpath(device, links))
    return f"00000000:{bus:02X}:00.0".encode()


@pytest.fixture
def install(monkeypatch):
    def _install(fake: FakeNvml) -> FakeNvml:
        for name in dir(pynvml):
            if name.startswith("nvml") and inspect.isfunction(getattr(pynvml, name)):
                monkeypatch.setattr(pynvml, name, getattr(fake, name, _forbidden(name)))
        return fake

    return _install


def _fake(host: Host, *keys: str) -> FakeNvml:
    gpus = []
    for index, key in enumerate(keys):
        model = gpu_model(key)
        bus_id = _plug_in(host, index, 0x1B + 0x20 * index, 0x1A + 0x20 * index)
        per_sm = 64 if model.cuda_compute_capability in ((8, 0), (7, 5)) else 128
        gpus.append(
            FakeGpu(
                model=model,
                index=index,
                uuid=f"GPU-{uuid.UUID(int=index + 1)}",
                nvml_bus_id=bus_id,
                cores=model.multiprocessors * per_sm,
            )
        )
    return FakeNvml(gpus, host.procfs)


# --- start-up ------------------------------------------------------------------------------------


def test_without_nvml_the_error_points_to_the_simulator(monkeypatch, host):
    def no_library():
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlInit", no_library)
    with pytest.raises(
        DeviceError, match=r"NVML not available: NVML Shared Library Not Found.*--simulate PROFILE"
    ):
        host.backend()


def test_open_backend_picks_the_simulator_or_nvml(tmp_path, host, install):
    simulated = open_backend("l4x4", tmp_path / "data", "node-a")
    assert isinstance(simulated, SimulatedBackend)
    assert len(simulated.inventory().gpus) == 4
    fake = install(_fake(host, "l4"))
    real = open_backend(
        None, tmp_path / "data", "node-a", sysfs_root=host.sysfs, procfs_root=host.procfs, dev_root=host.dev
    )
    assert isinstance(real, NvmlBackend)
    assert fake.initialised
    real.close()
    assert fake.calls == ["nvmlShutdown"]


# --- reading -------------------------------------------------------------------------------------


def test_full_gpus_are_described_from_nvml(host, install):
    install(_fake(host, "h100-sxm5-80gb", "l4"))
    inventory = host.backend().inventory()
    h100, l4 = inventory.gpus
    assert (h100.uuid, h100.index, h100.minor) == ("GPU-00000000-0000-0000-0000-000000000001", 0, 0)
    assert (h100.product_name, h100.brand, h100.architecture) == ("NVIDIA H100 80GB HBM3", "Nvidia", "Hopper")
    assert h100.cuda_compute_capability == (9, 0)
    assert h100.memory_bytes == 81559 * 2**20
    assert h100.multiprocessors == 132  # 16896 CUDA cores / 128 per SM
    assert (h100.pci_bus_id, h100.pcie_root) == ("0000:1b:00.0", "pci0000:1a")
    assert (h100.pci_device_id, h100.pci_vendor_id) == (0x2330, 0x10DE)
    assert h100.mig_capable
    assert not h100.mig_enabled
    assert not h100.mig_mode_change_requires_reset
    assert (l4.pci_bus_id, l4.pcie_root, l4.architecture) == ("0000:3b:00.0", "pci0000:3a", "Ada Lovelace")
    assert not l4.mig_capable
    assert (l4.mig_profiles, l4.memory_slices, l4.mig_mode_change_requires_reset) == ((), 0, False)
    assert inventory.driver_version == "580.95.05"
    assert inventory.cuda_driver_version == (12, 8)


def test_fabric_info_names_the_nvlink_clique(host, install):
    fake = _fake(host, "gb200", "gb200")
    cluster = uuid.UUID("8a2d6e1c-1b1e-4a3e-9f0a-2b6c1d7e5f40")
    for gpu in fake.gpus:
        gpu.fabric = (cluster.bytes, 7, pynvml.NVML_GPU_FABRIC_STATE_COMPLETED)
    install(fake)
    inventory = host.backend().inventory()
    assert {gpu.fabric.clique for gpu in inventory.gpus if gpu.fabric} == {f"{cluster}.7"}
    assert node_clique(inventory).clique == f"{cluster}.7"


def test_gpus_without_fabric_info_join_no_clique(host, install):
    install(_fake(host, "h100-sxm5-80gb"))
    inventory = host.backend().inventory()
    assert inventory.gpus[0].fabric is None
    assert "without NVLink fabric info" in node_clique(inventory).reason


def test_ampere_is_known_to_need_a_reset_for_mig_mode(host, install):
    install(_fake(host, "a100-sxm4-40gb"))
    (a100,) = host.backend().inventory().gpus
    assert a100.mig_mode_change_requires_reset
    assert a100.multiprocessors == 108  # 6912 cores / 64 per SM on GA100


@pytest.mark.parametrize(
    ("key", "node_profile"),
    [
        ("a100-sxm4-40gb", "dgx-a100-40gb"),
        ("a100-sxm4-80gb", "dgx-a100-80gb"),
        ("h100-sxm5-80gb", "dgx-h100"),
        ("h200-sxm-141gb", "dgx-h200"),
        ("b200-180gb", "dgx-b200"),
    ],
)
def test_nvml_and_the_simulator_describe_the_same_gpu_alike(tmp_path, host, install, key, node_profile):
    install(_fake(host, key))
    (real,) = host.backend().inventory().gpus
    simulated = SimulatedBackend(node_profile, "node-a", tmp_path / "sim").inventory().gpus[0]
    for attribute in (
        "product_name",
        "brand",
        "architecture",
        "cuda_compute_capability",
        "memory_bytes",
        "multiprocessors",
        "pci_device_id",
        "pci_vendor_id",
        "mig_capable",
        "mig_mode_change_requires_reset",
        "memory_slices",
    ):
        assert getattr(real, attribute) == getattr(simulated, attribute), attribute
    # NVML lists profiles by GPU-instance constant, the catalog by size; the profiles are the same,
    # names included: recomputed from NVML's memory sizes, they agree with the catalog's.
    assert sorted(real.mig_profiles, key=lambda p: p.profile_id) == sorted(
        simulated.mig_profiles, key=lambda p: p.profile_id
    )


def test_profile_names_come_from_the_formula_not_from_nvmls_struct(host, install):
    fake = _fake(host, "a100-sxm4-80gb")
    fake.gpus[0].struct_names[9] = b"MIG 3g.39gb"  # what mig-parted#31 saw some drivers call it
    install(fake)
    (a100,) = host.backend().inventory().gpus
    assert a100.profile("3g.40gb") is not None
    assert a100.profile("3g.39gb") is None


def test_without_a_core_count_the_catalog_supplies_the_sm_count(host, install):
    fake = _fake(host, "h200-sxm-141gb")
    fake.gpus[0].cores = None
    install(fake)
    (h200,) = host.backend().inventory().gpus
    assert h200.multiprocessors == 132


def test_an_unknown_product_without_a_core_count_has_zero_sms(host, install):
    fake = _fake(host, "l4")
    fake.gpus[0].cores = None
    fake.gpus[0].model = dataclasses.replace(gpu_model("l4"), pci_device_id=0x9999)
    install(fake)
    (gpu,) = host.backend().inventory().gpus
    assert gpu.multiprocessors == 0


def test_static_mig_devices_are_read_with_their_capability_nodes(host, install):
    fake = install(_fake(host, "h100-sxm5-80gb", "h100-sxm5-80gb"))
    gpu1 = fake.gpus[1]
    three_g = fake.admin_create(gpu1, "3g.40gb", 4)
    one_g = fake.admin_create(gpu1, "1g.10gb", 0)
    inventory = host.backend().inventory()
    first, second = inventory.gpus
    assert first.mig_devices == ()
    assert second.mig_enabled
    assert [(d.uuid, d.profile, d.profile_id, d.placement) for d in second.mig_devices] == [
        (three_g.uuid, "3g.40gb", 9, Placement(4, 4)),
        (one_g.uuid, "1g.10gb", 19, Placement(0, 1)),
    ]
    device = second.mig_devices[0]
    assert (device.parent_uuid, device.gpu_instance_id, device.compute_instance_id) == (gpu1.uuid, 1, 0)
    caps = host.dev / "dev" / "nvidia-caps"  # the driver root's /dev holds the nodes on the host
    assert device.cap_nodes == (
        DeviceNode("/dev/nvidia-caps/nvidia-cap1010", CAPS_MAJOR, 1010, str(caps / "nvidia-cap1010")),
        DeviceNode("/dev/nvidia-caps/nvidia-cap1011", CAPS_MAJOR, 1011, str(caps / "nvidia-cap1011")),
    )


def test_a_missing_capability_file_names_the_setting_to_fix(host, install):
    fake = install(_fake(host, "h100-sxm5-80gb"))
    fake.admin_create(fake.gpus[0], "7g.80gb", 0)
    for access in sorted((host.procfs / "driver").rglob("access"), reverse=True):
        access.unlink()
    with pytest.raises(DeviceError, match=r"gpu0/mig/gi1/access.*procfs root"):
        host.backend().inventory()


def test_device_nodes_carry_the_numbers_stat_reports(host, install):
    install(_fake(host, "h100-sxm5-80gb", "h100-sxm5-80gb"))
    inventory = host.backend().inventory()
    dev = host.dev / "dev"
    expected = {
        f"/dev/{name}": (
            os.major(os.stat(dev / name).st_rdev),
            os.minor(os.stat(dev / name).st_rdev),
            str(dev / name),
        )
        for name in ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools")  # nvidia-modeset is absent: left out
    }
    assert {n.path: (n.major, n.minor, n.host_path) for n in inventory.control_nodes} == expected
    gpu0, gpu1 = inventory.gpus
    assert gpu0.device_node == DeviceNode(
        "/dev/nvidia0", 195, 0, host_path=str(dev / "nvidia0")
    )  # absent node
    urandom = os.stat("/dev/urandom").st_rdev
    assert gpu1.device_node == DeviceNode(
        "/dev/nvidia1", os.major(urandom), os.minor(urandom), str(dev / "nvidia1")
    )


def test_without_nvidiactl_the_dev_root_is_questioned(host, install):
    install(_fake(host, "l4"))
    (host.dev / "dev" / "nvidiactl").unlink()
    with pytest.raises(DeviceError, match=r"nvidiactl does not exist.*dev root"):
        host.backend().inventory()


def test_a_regular_file_is_not_taken_for_a_device_node(host, install):
    install(_fake(host, "l4"))
    (host.dev / "dev" / "nvidiactl").unlink()
    (host.dev / "dev" / "nvidiactl").write_text("")
    with pytest.raises(DeviceError, match="not a character device"):
        host.backend().inventory()


def test_without_sysfs_the_pcie_root_is_unknown(host, install):
    install(_fake(host, "l4"))
    backend = NvmlBackend(sysfs_root=host.sysfs / "missing", procfs_root=host.procfs, dev_root=host.dev)
    (gpu,) = backend.inventory().gpus
    assert gpu.pcie_root is None
    assert gpu.pci_bus_id == "0000:1b:00.0"


def test_the_inventory_dumps_to_json(host, install):
    fake = install(_fake(host, "a100-sxm4-40gb"))
    fake.admin_create(fake.gpus[0], "1g.5gb", 3)
    dumped = json.loads(json.dumps(host.backend().inventory().as_dict()))
    gpu = dumped["gpus"][0]
    assert gpu["product_name"] == "NVIDIA A100-SXM4-40GB"
    assert gpu["mig_devices"][0]["placement"] == {"start": 3, "size": 1}
    assert gpu["mig_profiles"][0]["placements"][0] == {"start": 0, "size": 1}


# --- creating and destroying ---------------------------------------------------------------------


def test_hopper_switches_mig_mode_on_and_creates_the_placement(host, install):
    fake = install(_fake(host, "h100-sxm5-80gb"))
    backend = host.backend()
    gpu = fake.gpus[0]
    created = backend.create_mig_device(gpu.uuid, 14, Placement(2, 2))
    assert fake.mig_mode_changes == [(gpu.uuid, pynvml.NVML_DEVICE_MIG_ENABLE)]
    assert (created.profile, created.placement, created.parent_uuid) == ("2g.20gb", Placement(2, 2), gpu.uuid)
    assert created.cap_nodes[0].major == CAPS_MAJOR
    (shown,) = backend.inventory().gpus
    assert shown.mig_devices == (created,)


def test_ampere_with_mig_mode_off_is_left_alone(host, install):
    fake = install(_fake(host, "a100-sxm4-40gb"))
    with pytest.raises(DeviceError, match="needs a GPU reset") as refused:
        host.backend().create_mig_device(fake.gpus[0].uuid, 19, Placement(0, 1))
    assert type(refused.value) is DeviceError
    assert fake.mig_mode_changes == []
    assert fake.gpus[0].gpu_instances == {}


def test_ampere_in_mig_mode_creates_without_touching_the_mode(host, install):
    fake = install(_fake(host, "a100-sxm4-40gb"))
    fake.gpus[0].mig_mode = pynvml.NVML_DEVICE_MIG_ENABLE
    backend = host.backend()
    created = backend.create_mig_device(fake.gpus[0].uuid, 0, Placement(0, 8))
    assert created.profile == "7g.40gb"
    backend.destroy_mig_device(fake.gpus[0].uuid, created.uuid)
    assert fake.mig_mode_changes == []
    assert fake.gpus[0].mig_mode == pynvml.NVML_DEVICE_MIG_ENABLE


def test_a_busy_gpu_refuses_mig_mode_with_a_retryable_error(host, install):
    fake = install(_fake(host, "h100-sxm5-80gb"))
    fake.gpus[0].full_gpu_busy = True
    with pytest.raises(DeviceInUseError, match="in use"):
        host.backend().create_mig_device(fake.gpus[0].uuid, 19, Placement(0, 1))
    assert fake.gpus[0].gpu_instances == {}


def test_an_overlap_the_hardware_refuses_is_a_placement_error(host, install):
    fake = install(_fake(host, "h100-sxm5-80gb"))
    fake.admin_create(fake.gpus[0], "4g.40gb", 0)
    with pytest.raises(PlacementUnavailableError, match="taken by a live MIG instance"):
        host.backend().create_mig_device(fake.gpus[0].uuid, 19, Placement(2, 1))
    assert len(fake.gpus[0].gpu_instances) == 1


def test_placements_and_profiles_the_gpu_does_not_offer_never_reach_nvml(host, install):
    fake = install(_fake(host, "h100-sxm5-80gb"))
    backend = host.backend()
    with pytest.raises(PlacementUnavailableError, match=r"3g\.40gb starts only at slices 0, 4"):
        backend.create_mig_device(fake.gpus[0].uuid, 9, Placement(2, 4))
    with pytest.raises(PlacementUnavailableError, match="no such profile"):
        backend.create_mig_device(fake.gpus[0].uuid, 77, Placement(0, 1))
    assert "nvmlDeviceCreateGpuInstanceWithPlacement" not in fake.calls
    assert fake.mig_mode_changes == []


def test_a_failed_compute_instance_leaves_the_gpu_as_it_was(host, install):
    fake = install(_fake(host, "h100-sxm5-80gb"))
    fake.fail_next_compute_instance = True
    gpu = fake.gpus[0]
    with pytest.raises(PlacementUnavailableError):
        host.backend().create_mig_device(gpu.uuid, 9, Placement(0, 4))
    assert gpu.gpu_instances == {}
    assert gpu.mig_mode == pynvml.NVML_DEVICE_MIG_DISABLE
    assert fake.mig_mode_changes == [
        (gpu.uuid, pynvml.NVML_DEVICE_MIG_ENABLE),
        (gpu.uuid, pynvml.NVML_DEVICE_MIG_DISABLE),
    ]


def test_a_missing_capability_file_after_creating_rolls_the_device_back(host, install):
    fake = install(_fake(host, "h100-sxm5-80gb"))
    gpu = fake.gpus[0]
    (host.procfs / "devices").write_text(
        "Character devices:\n195 nvidia\n\nBlock devices:\n"
    )  # no nvidia-caps
    with pytest.raises(DeviceError, match="no nvidia-caps"):
        host.backend().create_mig_device(gpu.uuid, 9, Placement(4, 4))
    assert gpu.gpu_instances == {}
    assert gpu.mig_mode == pynvml.NVML_DEVICE_MIG_DISABLE


def test_destroy_removes_the_compute_then_the_gpu_instance_and_ends_mig_mode(host, install):
    fake = install(_fake(host, "h100-sxm5-80gb"))
    backend = host.backend()
    gpu = fake.gpus[0]
    first = backend.create_mig_device(gpu.uuid, 19, Placement(0, 1))
    second = backend.create_mig_device(gpu.uuid, 19, Placement(1, 1))
    backend.destroy_mig_device(gpu.uuid, first.uuid)
    assert gpu.mig_mode == pynvml.NVML_DEVICE_MIG_ENABLE  # one is still there
    fake.calls.clear()
    backend.destroy_mig_device(gpu.uuid, second.uuid)
    assert fake.calls == ["nvmlComputeInstanceDestroy", "nvmlGpuInstanceDestroy"]
    assert gpu.gpu_instances == {}
    assert gpu.mig_mode == pynvml.NVML_DEVICE_MIG_DISABLE


def test_destroying_a_busy_mig_device_is_retryable(host, install):
    fake = install(_fake(host, "h100-sxm5-80gb"))
    backend = host.backend()
    created = backend.create_mig_device(fake.gpus[0].uuid, 0, Placement(0, 8))
    fake.gpus[0].gpu_instances[1].compute_instances[0].busy = True
    with pytest.raises(DeviceInUseError):
        backend.destroy_mig_device(fake.gpus[0].uuid, created.uuid)
    assert len(fake.gpus[0].gpu_instances) == 1


def test_destroying_an_unknown_mig_device_is_a_no_op(host, install):
    fake = install(_fake(host, "h100-sxm5-80gb"))
    host.backend().destroy_mig_device(fake.gpus[0].uuid, "MIG-gone")
    assert "nvmlComputeInstanceDestroy" not in fake.calls


def test_an_unknown_gpu_is_an_error(host, install):
    install(_fake(host, "h100-sxm5-80gb"))
    with pytest.raises(DeviceError, match="no GPU GPU-nope on this node"):
        host.backend().create_mig_device("GPU-nope", 19, Placement(0, 1))
