"""Simulated node profiles: which GPUs a simulated node has, and how they are identified.

Identities follow real hardware. UUIDs are unique per node (derived from the node
name and the GPU's index), while PCI addresses follow a fixed server layout, the
same on every node of a profile -- as they are on a rack of identical servers.
Minor numbers are 0..n-1 in PCI order, as the kernel driver assigns them.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from dra_driver.devices.backend import DeviceError
from dra_driver.devices.catalog import GpuModel, gpu_model
from dra_driver.devices.types import DeviceNode, FabricInfo, FabricState, Gpu

NVIDIA_MAJOR = 195  # /dev/nvidia<minor>, /dev/nvidiactl (255) and /dev/nvidia-modeset (254)

# A fixed namespace, so that the same node name gives the same UUIDs on every run and machine.
_UUID_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "https://gpu.dra-driver.dev/simulated-gpu")

# Root buses of the PCIe host bridges of the simulated server; GPUs sit behind them.
_ROOT_BUSES = (0x1A, 0x3A, 0x4C, 0x5C, 0x9A, 0xBA, 0xCB, 0xDB)


@dataclass(frozen=True)
class NodeProfile:
    name: str
    description: str
    gpu_models: tuple[str, ...]  # catalog keys, in PCI order
    # Whether the GPUs are part of a multi-node NVLink fabric (NVML reports fabric info).
    nvlink_fabric: bool = False


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
        NodeProfile("l4x4", "4x NVIDIA L4", _same(4, "l4")),
        NodeProfile(
            "mixed",
            "2x H100 80GB HBM3 (MIG without reset), 2x A100-SXM4-40GB (MIG needs a reset), 2x L4 (no MIG)",
            _same(2, "h100-sxm5-80gb") + _same(2, "a100-sxm4-40gb") + _same(2, "l4"),
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


def _gpu(
    node_name: str, index: int, gpu_count: int, model: GpuModel, fabric: FabricInfo | None = None
) -> Gpu:
    bus_id, pcie_root = pci_location(index, gpu_count)
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
        pci_bus_id=bus_id,
        pci_device_id=model.pci_device_id,
        pci_vendor_id=model.pci_vendor_id,
        device_node=DeviceNode(f"/dev/nvidia{index}", NVIDIA_MAJOR, index),
        pcie_root=pcie_root,
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
    return tuple((_gpu(node_name, i, len(models), m, fabric), m) for i, m in enumerate(models))
