"""Immutable descriptions of GPUs, MIG profiles and MIG devices.

Every backend (NVML on a real node, the simulator elsewhere) produces these same
objects, so that everything above this layer is a pure function of them.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


@dataclass(frozen=True, order=True)
class Placement:
    """A GPU-instance placement: the memory slices ``[start, start + size)``."""

    start: int
    size: int

    @property
    def memory_slices(self) -> range:
        return range(self.start, self.start + self.size)

    def overlaps(self, other: Placement) -> bool:
        return self.start < other.start + other.size and other.start < self.start + self.size


@dataclass(frozen=True, order=True)
class OrphanedGpuInstance:
    """A GPU instance the driver created and a failed rollback left: nobody holds it, and its
    memory slices are lost to every claim until it is destroyed.

    Named by its GPU, profile and placement, not by its id: placements on one GPU never
    overlap, and the rollback may have failed before NVML told the id.
    """

    gpu_uuid: str
    profile_id: int
    placement: Placement


@dataclass(frozen=True)
class MigProfile:
    """One GPU-instance profile of a MIG-capable GPU, as ``nvidia-smi mig -lgip`` lists it."""

    name: str  # "1g.10gb", "1g.10gb+me"
    profile_id: int  # the per-product lgip ID that `nvidia-smi mig -cgi` takes
    nvml_profile: int  # the NVML_GPU_INSTANCE_PROFILE_* constant
    compute_slices: int
    instance_count: int  # how many instances of this profile a GPU can hold at once
    memory_mib: int
    multiprocessors: int
    copy_engines: int
    decoders: int
    encoders: int
    jpeg_engines: int
    ofa_engines: int
    placements: tuple[Placement, ...]

    @property
    def memory_bytes(self) -> int:
        return self.memory_mib * 2**20


@dataclass(frozen=True)
class DeviceNode:
    """A character device the container needs, with numbers so a runtime need not stat it.

    Numbers None: the runtime reads them from the host's node (``/dev/vfio/<group>``, whose major
    the kernel picks, and which exists only once the GPU is on vfio-pci).
    """

    path: str
    major: int | None
    minor: int | None
    host_path: str | None = None  # set when the node lives elsewhere on the host (driver root)


@dataclass(frozen=True)
class MigDevice:
    """A MIG device that exists on the GPU right now (GPU instance + compute instance)."""

    uuid: str  # "MIG-..."
    parent_uuid: str
    profile: str  # profile name, e.g. "3g.40gb"
    profile_id: int
    placement: Placement
    gpu_instance_id: int
    compute_instance_id: int
    # The two nvidia-caps nodes that grant access to this GI/CI.
    cap_nodes: tuple[DeviceNode, ...] = ()


class FabricState(Enum):
    """``nvmlGpuFabricState_t``: how far the GPU got registering with the NVLink fabric."""

    NOT_SUPPORTED = "NotSupported"  # no multi-node NVLink (NVML_GPU_FABRIC_STATE_NOT_SUPPORTED)
    NOT_STARTED = "NotStarted"
    IN_PROGRESS = "InProgress"
    COMPLETED = "Completed"


@dataclass(frozen=True)
class FabricInfo:
    """A GPU's place in a multi-node NVLink fabric (``nvmlDeviceGetGpuFabricInfoV``).

    GPUs that can exchange memory over NVLink (through IMEX) share one cluster UUID and one
    clique id; the pair names the NVLink partition, e.g. one GB200 NVL72 rack.
    """

    cluster_uuid: str  # RFC 4122 text; all zeros until registration completed
    clique_id: int
    state: FabricState = FabricState.COMPLETED
    status: str = "Success"  # NVML's nvmlReturn_t text for the registration result

    @property
    def clique(self) -> str:
        """``<clusterUUID>.<cliqueId>``: the clique as NVIDIA's driver names it (node label, status)."""
        return f"{self.cluster_uuid}.{self.clique_id}"


@dataclass(frozen=True)
class Gpu:
    """One physical GPU."""

    uuid: str  # "GPU-..."
    minor: int  # /dev/nvidia<minor>; stable across reboots, unlike the NVML index
    index: int
    product_name: str  # NVML name, e.g. "NVIDIA H100 80GB HBM3"
    brand: str  # "Nvidia", "Tesla", ...
    architecture: str  # "Ampere", "Hopper", ...
    cuda_compute_capability: tuple[int, int]
    memory_bytes: int
    multiprocessors: int
    pci_bus_id: str  # "0000:3b:00.0"
    pci_device_id: int  # 0x2330 (device part of the PCI id)
    pci_vendor_id: int  # 0x10de
    device_node: DeviceNode
    pcie_root: str | None = None  # "pci0000:3a" when sysfs tells us
    # The upstream port of the PCIe switch the GPU sits behind ("0000:3b:00.0"); None when the GPU
    # hangs directly off a root port. GPUs behind one switch talk peer-to-peer without the CPU.
    pcie_switch: str | None = None
    numa_node: int | None = None  # the CPU socket's NUMA node, from sysfs; None where it has none
    # The far ends of the GPU's active NVLinks: PCI bus ids of GPUs (a bridge) or NVSwitches, and
    # NVSWITCH_WITHOUT_ADDRESS for a switch NVML gives no address of (see devices/topology.py).
    nvlink_remotes: tuple[str, ...] = ()
    # "ATS", "HMM" or "None" where the platform has coherent memory (Grace); None where it has not.
    addressing_mode: str | None = None
    mig_capable: bool = False
    mig_enabled: bool = False
    # Whether switching MIG mode needs a GPU reset (Ampere) or not (Hopper and newer).
    mig_mode_change_requires_reset: bool = True
    memory_slices: int = 0
    mig_profiles: tuple[MigProfile, ...] = ()
    mig_devices: tuple[MigDevice, ...] = ()
    fabric: FabricInfo | None = None  # None: NVML reports no fabric info (no multi-node NVLink)
    # GPU instances that are no usable MIG device (no compute instance, or several): the profile name
    # and placement of each. Their memory slices are taken, so nothing overlapping them is offered.
    reserved_placements: tuple[tuple[str, Placement], ...] = ()

    def profile(self, name: str) -> MigProfile | None:
        return next((p for p in self.mig_profiles if p.name == name), None)


@dataclass(frozen=True)
class Inventory:
    """Everything a backend knows about the node's GPUs at one moment."""

    gpus: tuple[Gpu, ...]
    driver_version: str  # as NVML prints it, e.g. "580.95.05"
    cuda_driver_version: tuple[int, int]  # (13, 0)
    # Nodes every container with a GPU needs: nvidiactl, nvidia-uvm, nvidia-uvm-tools, modeset.
    control_nodes: tuple[DeviceNode, ...] = field(default=())

    def gpu(self, uuid: str) -> Gpu | None:
        return next((g for g in self.gpus if g.uuid == uuid), None)

    def as_dict(self) -> dict[str, Any]:
        """Everything as JSON-able data (tuples become lists): for `inventory` output and golden files."""
        result: dict[str, Any] = json.loads(json.dumps(dataclasses.asdict(self)))
        return result


class HealthState(Enum):
    HEALTHY = "Healthy"
    UNHEALTHY = "Unhealthy"
    UNKNOWN = "Unknown"


class ComputeMode(Enum):
    """``nvmlComputeMode_t``: how many CUDA contexts a GPU accepts (``nvidia-smi -c``)."""

    DEFAULT = "Default"  # any number of contexts, time-sliced: NVML_COMPUTEMODE_DEFAULT (0)
    PROHIBITED = "Prohibited"  # no context at all: NVML_COMPUTEMODE_PROHIBITED (2)
    EXCLUSIVE_PROCESS = (
        "ExclusiveProcess"  # one process (an MPS server): NVML_COMPUTEMODE_EXCLUSIVE_PROCESS (3)
    )


class TimeSlice(Enum):
    """The GPU's time-slice setting (``nvidia-smi compute-policy --set-timeslice 0..3``)."""

    DEFAULT = "Default"
    SHORT = "Short"
    MEDIUM = "Medium"
    LONG = "Long"

    @property
    def level(self) -> int:
        """The number ``nvidia-smi compute-policy --set-timeslice`` takes: 0 (Default) to 3 (Long)."""
        return list(TimeSlice).index(self)


@dataclass(frozen=True)
class ComputePolicy:
    """What decides how processes share a full GPU: its compute mode and its time slice."""

    compute_mode: ComputeMode = ComputeMode.DEFAULT
    time_slice: TimeSlice = TimeSlice.DEFAULT

    def as_dict(self) -> dict[str, str]:
        return {"computeMode": self.compute_mode.value, "timeSlice": self.time_slice.value}

    @classmethod
    def from_dict(cls, data: dict[str, str]) -> ComputePolicy:
        return cls(ComputeMode(data["computeMode"]), TimeSlice(data["timeSlice"]))
