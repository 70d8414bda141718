"""Small, realistic inventories for the resources tests.

Numbers are those of real hardware, from shared/data/gpu-catalog.yaml (nvidia-smi mig -lgip
and -lgipp on an H100 SXM5 80GB and an A100-SXM4-40GB). The tests build their inventories
here rather than through the simulated backend, so that they depend on nothing but the
frozen device types.
"""

from __future__ import annotations

from dataclasses import replace

from hypothesis import strategies as st

from dra_driver.devices.types import DeviceNode, Gpu, Inventory, MigDevice, MigProfile, Placement

DRIVER = "gpu.dra-driver.dev"
NODE = "node-1"
MIB = 2**20


def _profile(
    name: str,
    profile_id: int,
    nvml_profile: int,
    compute_slices: int,
    instance_count: int,
    memory_mib: int,
    engines: tuple[int, int, int, int, int, int],
    size: int,
    starts: tuple[int, ...],
) -> MigProfile:
    multiprocessors, copy_engines, decoders, encoders, jpeg_engines, ofa_engines = engines
    return MigProfile(
        name=name,
        profile_id=profile_id,
        nvml_profile=nvml_profile,
        compute_slices=compute_slices,
        instance_count=instance_count,
        memory_mib=memory_mib,
        multiprocessors=multiprocessors,
        copy_engines=copy_engines,
        decoders=decoders,
        encoders=encoders,
        jpeg_engines=jpeg_engines,
        ofa_engines=ofa_engines,
        placements=tuple(Placement(start, size) for start in starts),
    )


# engines = (SMs, copy engines, NVDEC, NVENC, NVJPG, OFA)
H100_PROFILES = (
    _profile("1g.10gb", 19, 0x0, 1, 7, 9984, (16, 1, 1, 0, 1, 0), 1, (0, 1, 2, 3, 4, 5, 6)),
    _profile("1g.10gb+me", 20, 0x7, 1, 1, 9984, (16, 1, 1, 0, 1, 1), 1, (0, 1, 2, 3, 4, 5, 6)),
    _profile("1g.20gb", 15, 0x9, 1, 4, 20096, (26, 1, 1, 0, 1, 0), 2, (0, 2, 4, 6)),
    _profile("2g.20gb", 14, 0x1, 2, 3, 20096, (32, 2, 2, 0, 2, 0), 2, (0, 2, 4)),
    _profile("3g.40gb", 9, 0x2, 3, 2, 40448, (60, 3, 3, 0, 3, 0), 4, (0, 4)),
    _profile("4g.40gb", 5, 0x3, 4, 1, 40448, (64, 4, 4, 0, 4, 0), 4, (0,)),
    _profile("7g.80gb", 0, 0x4, 7, 1, 81152, (132, 8, 7, 0, 7, 1), 8, (0,)),
)

A100_40GB_PROFILES = (
    _profile("1g.5gb", 19, 0x0, 1, 7, 4864, (14, 1, 0, 0, 0, 0), 1, (0, 1, 2, 3, 4, 5, 6)),
    _profile("1g.5gb+me", 20, 0x7, 1, 1, 4864, (14, 1, 1, 0, 1, 1), 1, (0, 1, 2, 3, 4, 5, 6)),
    _profile("1g.10gb", 15, 0x9, 1, 4, 9856, (14, 1, 1, 0, 0, 0), 2, (0, 2, 4, 6)),
    _profile("2g.10gb", 14, 0x1, 2, 3, 9856, (28, 2, 1, 0, 0, 0), 2, (0, 2, 4)),
    _profile("3g.20gb", 9, 0x2, 3, 2, 19968, (42, 3, 2, 0, 0, 0), 4, (0, 4)),
    _profile("4g.20gb", 5, 0x3, 4, 1, 19968, (56, 4, 2, 0, 0, 0), 4, (0,)),
    _profile("7g.40gb", 0, 0x4, 7, 1, 40192, (98, 7, 5, 0, 1, 1), 8, (0,)),
)


def _uuid(prefix: str, minor: int) -> str:
    return f"{prefix}-{minor:08x}-1111-2222-3333-444455556666"


def h100(minor: int = 0, *, mig_enabled: bool = False, mig_devices: tuple[MigDevice, ...] = ()) -> Gpu:
    """An H100 SXM5 80GB: Hopper, so MIG mode can change without a GPU reset."""
    return Gpu(
        uuid=_uuid("GPU", minor),
        minor=minor,
        index=minor,
        product_name="NVIDIA H100 80GB HBM3",
        brand="Nvidia",
        architecture="Hopper",
        cuda_compute_capability=(9, 0),
        memory_bytes=81559 * MIB,
        multiprocessors=132,
        pci_bus_id=f"0000:{0x18 + minor:02x}:00.0",
        pci_device_id=0x2330,
        pci_vendor_id=0x10DE,
        device_node=DeviceNode(path=f"/dev/nvidia{minor}", major=195, minor=minor),
        pcie_root=f"pci0000:{0x17 + minor:02x}",
        mig_capable=True,
        mig_enabled=mig_enabled,
        mig_mode_change_requires_reset=False,
        memory_slices=8,
        mig_profiles=H100_PROFILES,
        mig_devices=mig_devices,
    )


def a100_40gb(minor: int = 0, *, mig_enabled: bool = False, mig_devices: tuple[MigDevice, ...] = ()) -> Gpu:
    """An A100-SXM4-40GB: Ampere, so switching MIG mode needs a GPU reset."""
    return Gpu(
        uuid=_uuid("GPU", minor),
        minor=minor,
        index=minor,
        product_name="NVIDIA A100-SXM4-40GB",
        brand="Nvidia",
        architecture="Ampere",
        cuda_compute_capability=(8, 0),
        memory_bytes=40960 * MIB,
        multiprocessors=108,
        pci_bus_id=f"0000:{0x07 + minor:02x}:00.0",
        pci_device_id=0x20B0,
        pci_vendor_id=0x10DE,
        device_node=DeviceNode(path=f"/dev/nvidia{minor}", major=195, minor=minor),
        mig_capable=True,
        mig_enabled=mig_enabled,
        mig_mode_change_requires_reset=True,
        memory_slices=8,
        mig_profiles=A100_40GB_PROFILES,
        mig_devices=mig_devices,
    )


def mig_device(gpu: Gpu, profile_name: str, start: int, *, instance: int = 1) -> MigDevice:
    """A MIG device of ``profile_name`` at ``start`` on ``gpu``."""
    profile = gpu.profile(profile_name)
    assert profile is not None, f"{gpu.product_name} has no profile {profile_name}"
    placement = next(p for p in profile.placements if p.start == start)
    return MigDevice(
        uuid=f"MIG-{gpu.minor:04x}{profile.profile_id:02x}{start:02x}-aaaa-bbbb-cccc-ddddeeeeffff",
        parent_uuid=gpu.uuid,
        profile=profile_name,
        profile_id=profile.profile_id,
        placement=placement,
        gpu_instance_id=instance,
        compute_instance_id=0,
    )


def with_mig_devices(gpu: Gpu, *devices: MigDevice) -> Gpu:
    """``gpu`` in MIG mode, holding ``devices``."""
    return replace(gpu, mig_enabled=True, mig_devices=tuple(devices))


def inventory(*gpus: Gpu) -> Inventory:
    return Inventory(gpus=tuple(gpus), driver_version="580.95.05", cuda_driver_version=(13, 0))


@st.composite
def inventories(draw: st.DrawFn, max_gpus: int = 16) -> Inventory:
    """1 to ``max_gpus`` GPUs of mixed models, MIG mode on or off, some with MIG devices."""
    count = draw(st.integers(min_value=1, max_value=max_gpus))
    minors = draw(st.lists(st.integers(0, 255), min_size=count, max_size=count, unique=True))
    gpus = []
    for minor in minors:
        make = draw(st.sampled_from([h100, a100_40gb]))
        gpu = make(minor, mig_enabled=draw(st.booleans()))
        if gpu.mig_enabled and draw(st.booleans()):
            profile = draw(st.sampled_from(gpu.mig_profiles))
            start = draw(st.sampled_from(profile.placements)).start
            gpu = with_mig_devices(gpu, mig_device(gpu, profile.name, start))
        gpus.append(gpu)
    return inventory(*gpus)


# NVIDIA's go-nvml mock of an H100 (pkg/nvml/mock/gpus/h100.go), which the mock libnvidia-ml.so.1
# serves: a table that does not add up. 1g.20gb sits on one memory slice at every start, so
# 3g.40gb beside four of them would be 120Gi; seven 1g.10gb have 7 decoders, 7g.80gb has 5.
MOCK_H100_PROFILES = (
    _profile("1g.10gb", 0x0, 0x0, 1, 7, 10240, (16, 1, 1, 0, 0, 0), 1, (0, 1, 2, 3, 4, 5, 6)),
    _profile("1g.10gb+me", 0x7, 0x7, 1, 1, 10240, (16, 1, 1, 0, 1, 1), 1, (0, 1, 2, 3, 4, 5, 6)),
    _profile("1g.20gb", 0x9, 0x9, 1, 4, 20480, (16, 1, 1, 0, 0, 0), 1, (0, 1, 2, 3, 4, 5, 6)),
    _profile("2g.20gb", 0x1, 0x1, 2, 3, 20480, (32, 2, 1, 0, 0, 0), 2, (0, 2, 4)),
    _profile("3g.40gb", 0x2, 0x2, 3, 2, 40960, (48, 3, 2, 0, 0, 0), 3, (0, 4)),
    _profile("4g.40gb", 0x3, 0x3, 4, 1, 40960, (64, 4, 2, 0, 0, 0), 4, (0,)),
    _profile("7g.80gb", 0x4, 0x4, 7, 1, 81920, (112, 7, 5, 0, 0, 0), 7, (0,)),
)


def mock_h100(minor: int = 0, *, mig_enabled: bool = False) -> Gpu:
    """An H100 as the mock NVML reports it: NVIDIA's mock table, the catalog's 132 SMs."""
    return replace(
        h100(minor, mig_enabled=mig_enabled),
        memory_bytes=81920 * MIB,
        memory_slices=7,
        mig_profiles=MOCK_H100_PROFILES,
    )
