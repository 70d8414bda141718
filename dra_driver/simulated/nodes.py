"""Simulated node profiles: which GPUs a simulated node has, and how they are identified.

Identities follow real hardware. UUIDs are unique per node (derived from the node
name and the GPU's index), while PCI addresses follow a fixed server layout, the
same on every node of a profile -- as they are on a rack of identical servers.
Minor numbers are 0..n-1 in PCI order, as the kernel driver assigns them.

Each profile also has the in-node topology of its kind of server (see
:mod:`dra_driver.devices.topology`): how its GPUs are linked (NVSwitch all-to-all on HGX/DGX boards
and GB200 trays, NVLink bridges in pairs on a PCIe server, none on an L4 or L40S box), which PCIe
root and switch each GPU sits behind, and the NUMA node (CPU socket) of each.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from enum import Enum

from dra_driver.devices.backend import DeviceError
from dra_driver.devices.catalog import GpuModel, gpu_model
from dra_driver.devices.topology import NVSWITCH_WITHOUT_ADDRESS
from dra_driver.devices.types import DeviceNode, FabricInfo, FabricState, Gpu

NVIDIA_MAJOR = 195  # /dev/nvidia<minor>, /dev/nvidiactl (255) and /dev/nvidia-modeset (254)

# A fixed namespace, so that the same node name gives the same UUIDs on every run and machine.
_UUID_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "https://gpu.dra-driver.dev/simulated-gpu")

# Root buses of the PCIe host bridges of the simulated server; GPUs sit behind them.
_ROOT_BUSES = (0x1A, 0x3A, 0x4C, 0x5C, 0x9A, 0xBA, 0xCB, 0xDB)
# The NVSwitch chips of an HGX/DGX baseboard (four on Hopper), as PCI devices of the host.
NVSWITCH_BUS_IDS = tuple(f"0000:{bus:02x}:00.0" for bus in (0x05, 0x06, 0x07, 0x08))


class NvLinks(Enum):
    """How a simulated server's GPUs are linked by NVLink."""

    NONE = "none"  # PCIe only (L4, L40S)
    NVSWITCH = "nvswitch"  # every GPU to the same NVSwitches: all-to-all (HGX/DGX, GB200 trays)
    BRIDGED_PAIRS = "bridged-pairs"  # NVLink bridges between GPUs 0-1, 2-3, ... (H100 NVL PCIe cards)


@dataclass(frozen=True)
class NodeProfile:
    name: str
    description: str
    gpu_models: tuple[str, ...]  # catalog keys, in PCI order
    # Whether the GPUs are part of a multi-node NVLink fabric (NVML reports fabric info).
    nvlink_fabric: bool = False
    nvlinks: NvLinks = NvLinks.NVSWITCH
    # GPUs behind each PCIe switch, one switch per root complex; 0: each GPU on a root port of its own.
    gpus_per_switch: int = 0
    numa_nodes: int = 2  # CPU sockets; the GPUs are spread over them in PCI order


def _same(count: int, model: str) -> tuple[str, ...]:
    return (model,) * count


NODE_PROFILES: dict[str, NodeProfile] = {
    p.name: p
    for p in (
        NodeProfile("dgx-h100", "8x NVIDIA H100 80GB HBM3 (DGX H100)", _same(8, "h100-sxm5-80gb")),
        NodeProfile("hgx-h100-16", "16x NVIDIA H100 80GB HBM3", _same(16, "h100-sxm5-80gb")),
        NodeProfile("dgx-a100-40gb", "8x NVIDIA A100-SXM4-40GB (DGX A100)", _same(8, "a100-sxm4-40gb")),
        NodeProfile("dgx-a100-80gb", "8x NVIDIA A100-SXM4-80GB (DGX A100)", _same(8, "a100-sxm4-80gb")),
        NodeProfile("dgx-h200", "8x NVIDIA H200 (DGX H200)", _same(8, "h200-sxm-141gb")),
        NodeProfile("dgx-b200", "8x NVIDIA B200 (DGX B200)", _same(8, "b200-180gb")),
        # One compute tray of a GB200 NVL72 rack: two GB200 superchips of one Grace CPU and two
        # Blackwell GPUs each, 18 trays per rack on one NVLink domain (NVIDIA's GB200 NVL72 spec).
        NodeProfile(
            "gb200-tray",
            "4x NVIDIA GB200 (an NVL72 compute tray; Grace: ATS; multi-node NVLink)",
            _same(4, "gb200"),
            nvlink_fabric=True,
        ),
        NodeProfile("l4x4", "4x NVIDIA L4", _same(4, "l4"), nvlinks=NvLinks.NONE),
        NodeProfile(
            "mixed",
            "2x H100 80GB HBM3 (MIG without reset), 2x A100-SXM4-40GB (MIG needs a reset), 2x L4 (no MIG)",
            _same(2, "h100-sxm5-80gb") + _same(2, "a100-sxm4-40gb") + _same(2, "l4"),
            nvlinks=NvLinks.NONE,
        ),
        # A two-socket PCIe server: four cards behind one PCIe switch per socket, each card joined
        # to its neighbour by NVLink bridges (NVIDIA's H100 NVL is sold as such bridged pairs).
        NodeProfile(
            "pcie-h100nvl-bridged",
            "8x NVIDIA H100 NVL (PCIe), NVLink bridges in pairs, 4 GPUs per PCIe switch and CPU socket",
            _same(8, "h100-nvl-94gb"),
            nvlinks=NvLinks.BRIDGED_PAIRS,
            gpus_per_switch=4,
        ),
        NodeProfile(
            "l40s-4",
            "4x NVIDIA L40S (PCIe, no NVLink), two per CPU socket",
            _same(4, "l40s"),
            nvlinks=NvLinks.NONE,
        ),
    )
}


# The NVLink domain every simulated NVL72 tray joins unless told otherwise (--simulate-fabric).
DEFAULT_CLUSTER_UUID = str(uuid.uuid5(_UUID_NAMESPACE, "nvlink-cluster/0"))
DEFAULT_CLIQUE_ID = 1


def parse_fabric(text: str) -> FabricInfo:
    """``<cluster-uuid>/<clique-id>`` (or just ``<clique-id>``, in the default cluster) as fabric info."""
    cluster, _, clique = text.strip().rpartition("/")
    try:
        clique_id = int(clique)
        cluster_uuid = str(uuid.UUID(cluster)) if cluster else DEFAULT_CLUSTER_UUID
    except ValueError:
        raise DeviceError(
            f"simulated fabric {text!r} is not <cluster-uuid>/<clique-id> or <clique-id>, "
            f"e.g. {DEFAULT_CLUSTER_UUID}/{DEFAULT_CLIQUE_ID}"
        ) from None
    if not 0 <= clique_id < 2**32:
        raise DeviceError(f"simulated fabric {text!r}: the clique id must be a 32-bit unsigned number")
    return FabricInfo(cluster_uuid=cluster_uuid, clique_id=clique_id, state=FabricState.COMPLETED)


def profile_fabric(profile: NodeProfile, setting: str = "") -> FabricInfo | None:
    """The fabric info the node's GPUs report: ``setting`` if given, the default domain otherwise;
    None for a profile without multi-node NVLink (a fabric setting for it is an error)."""
    if not profile.nvlink_fabric:
        if setting:
            raise DeviceError(
                f"simulated node profile {profile.name} has no multi-node NVLink; "
                "a fabric can be given only for gb200-tray"
            )
        return None
    if setting:
        return parse_fabric(setting)
    return FabricInfo(cluster_uuid=DEFAULT_CLUSTER_UUID, clique_id=DEFAULT_CLIQUE_ID)


def node_profile(name: str) -> NodeProfile:
    try:
        return NODE_PROFILES[name]
    except KeyError:
        raise DeviceError(
            f"unknown simulated node profile {name!r}; choose one of: {', '.join(sorted(NODE_PROFILES))}"
        ) from None


def gpu_uuid(node_name: str, index: int) -> str:
    """A GPU uuid formatted like NVML's ("GPU-" + RFC 4122 text), unique per node and index."""
    return f"GPU-{uuid.uuid5(_UUID_NAMESPACE, f'{node_name}/gpu/{index}')}"


def pci_location(index: int, gpu_count: int) -> tuple[str, str]:
    """(PCI bus id, PCIe root) of GPU ``index``: one GPU per root complex, two on 16-GPU nodes."""
    per_root = -(-gpu_count // len(_ROOT_BUSES))
    root = _ROOT_BUSES[index // per_root]
    bus = root + 1 + 2 * (index % per_root)
    return f"0000:{bus:02x}:00.0", f"pci0000:{root:02x}"


@dataclass(frozen=True)
class PciPlace:
    """Where a GPU sits on the host: its address, PCIe root and switch, and NUMA node."""

    bus_id: str
    root: str
    switch: str | None
    numa_node: int


def pci_place(profile: NodeProfile, index: int, gpu_count: int) -> PciPlace:
    """GPU ``index``'s place, numbered as a kernel enumerates buses depth first.

    Behind a switch: the root port's secondary bus holds the switch's upstream port, the next bus
    its downstream ports, and each GPU gets the bus behind one of them.
    """
    numa_node = index * profile.numa_nodes // gpu_count
    if not profile.gpus_per_switch:
        bus_id, root = pci_location(index, gpu_count)
        return PciPlace(bus_id, root, None, numa_node)
    switches = -(-gpu_count // profile.gpus_per_switch)
    switch = index // profile.gpus_per_switch
    root_bus = _ROOT_BUSES[switch * len(_ROOT_BUSES) // switches]
    gpu_bus = root_bus + 3 + index % profile.gpus_per_switch
    return PciPlace(
        bus_id=f"0000:{gpu_bus:02x}:00.0",
        root=f"pci0000:{root_bus:02x}",
        switch=f"0000:{root_bus + 1:02x}:00.0",
        numa_node=numa_node,
    )


def nvlink_remotes(profile: NodeProfile, index: int, gpu_count: int) -> tuple[str, ...]:
    """The far ends of GPU ``index``'s NVLinks: the NVSwitches, its bridged partner, or none."""
    if profile.nvlinks is NvLinks.NVSWITCH:
        # A GB200 tray's NVLink switches sit in the rack's switch trays, not on this host's PCI bus.
        return (NVSWITCH_WITHOUT_ADDRESS,) if profile.nvlink_fabric else NVSWITCH_BUS_IDS
    if profile.nvlinks is NvLinks.BRIDGED_PAIRS and (index ^ 1) < gpu_count:
        return (pci_place(profile, index ^ 1, gpu_count).bus_id,)
    return ()


def _gpu(
    profile: NodeProfile,
    node_name: str,
    index: int,
    gpu_count: int,
    model: GpuModel,
    fabric: FabricInfo | None = None,
) -> Gpu:
    place = pci_place(profile, index, gpu_count)
    return Gpu(
        uuid=gpu_uuid(node_name, index),
        minor=index,
        index=index,
        product_name=model.product_name,
        brand=model.brand,
        architecture=model.architecture,
        cuda_compute_capability=model.cuda_compute_capability,
        memory_bytes=model.memory_bytes,
        multiprocessors=model.multiprocessors,
        pci_bus_id=place.bus_id,
        pci_device_id=model.pci_device_id,
        pci_vendor_id=model.pci_vendor_id,
        device_node=DeviceNode(f"/dev/nvidia{index}", NVIDIA_MAJOR, index),
        pcie_root=place.root,
        pcie_switch=place.switch,
        numa_node=place.numa_node,
        nvlink_remotes=nvlink_remotes(profile, index, gpu_count),
        mig_capable=model.mig_capable,
        mig_mode_change_requires_reset=model.mig_mode_change_requires_reset,
        memory_slices=model.memory_slices,
        mig_profiles=model.mig_profiles,
        addressing_mode=model.addressing_mode,
        fabric=fabric,
    )


def node_gpus(
    profile: NodeProfile, node_name: str, fabric: FabricInfo | None = None
) -> tuple[tuple[Gpu, GpuModel], ...]:
    """The node's GPUs in their power-on state (MIG off, no MIG devices), each with its model."""
    models = [gpu_model(key) for key in profile.gpu_models]
    return tuple((_gpu(profile, node_name, i, len(models), m, fabric), m) for i, m in enumerate(models))
