"""How NVIDIA's own tools name and number things, so that we publish the same strings.

Both backends use these functions: the NVML backend on values read from the
hardware, the simulator on values from the shipped catalog. Keeping them in one
place means a simulated node describes itself exactly as a real one would.
"""

from __future__ import annotations

from fractions import Fraction
from math import ceil, floor

PCI_VENDOR_NVIDIA = 0x10DE

# nvmlBrandType_t -> the string go-nvlib's GetBrandAsString returns, which is what
# NVIDIA's DRA driver publishes as the `brand` attribute.
BRAND_NAMES: dict[int, str] = {
    0: "Unknown",
    1: "Quadro",
    2: "Tesla",
    3: "NVS",
    4: "Grid",
    5: "GeForce",
    6: "Titan",
    7: "NvidiaVApps",
    8: "NvidiaVPC",
    9: "NvidiaVCS",
    10: "NvidiaVWS",
    11: "NvidiaCloudGaming",
    12: "QuadroRTX",
    13: "NvidiaRTX",
    14: "Nvidia",
    15: "GeForceRTX",
    16: "TitanRTX",
}

# nvmlDeviceArchitecture_t -> go-nvlib's GetArchitectureAsString.
ARCHITECTURE_NAMES: dict[int, str] = {
    2: "Kepler",
    3: "Maxwell",
    4: "Pascal",
    5: "Volta",
    6: "Turing",
    7: "Ampere",
    8: "Ada Lovelace",
    9: "Hopper",
    10: "Blackwell",
}
ARCHITECTURE_HOPPER = 9  # the first generation that switches MIG mode without a GPU reset


def brand_name(nvml_brand: int) -> str:
    """The published brand for an nvmlBrandType_t value; "Unknown" for values newer than this table."""
    return BRAND_NAMES.get(nvml_brand, "Unknown")


def architecture_name(nvml_architecture: int) -> str:
    """The published architecture for an nvmlDeviceArchitecture_t value."""
    return ARCHITECTURE_NAMES.get(nvml_architecture, "Unknown")


def split_pci_device_id(nvml_pci_device_id: int) -> tuple[int, int]:
    """NVML's ``pciDeviceId`` packs ``device << 16 | vendor``: return ``(device, vendor)``."""
    return nvml_pci_device_id >> 16, nvml_pci_device_id & 0xFFFF


def normalize_pci_bus_id(nvml_bus_id: str) -> str:
    """NVML's "00000000:3B:00.0" (32-bit domain) -> sysfs' and Kubernetes' "0000:3b:00.0"."""
    bus_id = nvml_bus_id.strip().lower()
    domain, _, rest = bus_id.partition(":")
    if len(domain) == 8 and domain.startswith("0000"):
        domain = domain[4:]
    return f"{domain}:{rest}"


# NVML_GPU_INSTANCE_PROFILE_* constants (nvml.h) -> (GPU slices "G", name suffix).
# go-nvlib: REV1 -> "+me", ALL_ME -> "+me.all", GFX -> "+gfx", NO_ME -> "-me";
# REV2 (1 compute slice with twice the memory) gets no suffix.
_GPU_INSTANCE_PROFILES: dict[int, tuple[int, str]] = {
    0x0: (1, ""),  # 1_SLICE
    0x1: (2, ""),  # 2_SLICE
    0x2: (3, ""),  # 3_SLICE
    0x3: (4, ""),  # 4_SLICE
    0x4: (7, ""),  # 7_SLICE
    0x5: (8, ""),  # 8_SLICE
    0x6: (6, ""),  # 6_SLICE
    0x7: (1, "+me"),  # 1_SLICE_REV1
    0x8: (2, "+me"),  # 2_SLICE_REV1
    0x9: (1, ""),  # 1_SLICE_REV2
    0xA: (1, "+gfx"),  # 1_SLICE_GFX
    0xB: (2, "+gfx"),  # 2_SLICE_GFX
    0xC: (4, "+gfx"),  # 4_SLICE_GFX
    0xD: (1, "-me"),  # 1_SLICE_NO_ME
    0xE: (2, "-me"),  # 2_SLICE_NO_ME
    0xF: (1, "+me.all"),  # 1_SLICE_ALL_ME
    0x10: (2, "+me.all"),  # 2_SLICE_ALL_ME
    0x11: (3, "+gfx"),  # 3_SLICE_GFX
}
GPU_INSTANCE_PROFILE_COUNT = 0x12


def mig_memory_size_gb(parent_memory_bytes: int, memory_size_mib: int) -> int:
    """The "<GB>" of a MIG profile name, computed exactly as go-nvlib's getMigMemorySizeGB.

    The name reflects the profile's share of the parent in whole eighths (memory
    slices) times the parent's memory rounded up to whole GiB -- not the profile's
    own memory: an H200 1g profile has 16 GiB but is called "1g.18gb". Exact
    fractions give the same result as Go's float64 here, because a share that is
    exactly k/8 is also exact in binary floating point.
    """
    fraction = Fraction(memory_size_mib * 2**20, parent_memory_bytes)
    eighths = Fraction(ceil(fraction * 8), 8)
    parent_gb = ceil(Fraction(parent_memory_bytes, 2**30))
    return floor(eighths * parent_gb + Fraction(1, 2))  # Go's math.Round: halves away from zero


def mig_profile_name(nvml_profile: int, memory_size_mib: int, parent_memory_bytes: int) -> str:
    """The profile name NVIDIA's tools publish, e.g. "1g.10gb", "1g.10gb+me", "1g.24gb-me".

    Only GPU-instance profiles whose single compute instance spans the whole
    instance are named here (go-nvlib's "<G>g.<GB>gb" form); that is the only kind
    NVIDIA's DRA driver publishes and the only kind this driver creates.
    """
    try:
        gpu_slices, suffix = _GPU_INSTANCE_PROFILES[nvml_profile]
    except KeyError:
        raise ValueError(f"unknown NVML GPU instance profile constant {nvml_profile:#x}") from None
    return f"{gpu_slices}g.{mig_memory_size_gb(parent_memory_bytes, memory_size_mib)}gb{suffix}"
