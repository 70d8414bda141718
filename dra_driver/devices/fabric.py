"""A node's place in a multi-node NVLink fabric, from its GPUs' fabric info.

NVML reports, per GPU, the cluster UUID and clique id of the NVLink partition the GPU registered
with (``nvmlDeviceGetGpuFabricInfo``), and how far that registration got. A node joins an IMEX
domain only when every one of its GPUs completed registration in one and the same clique: GPUs of
one node in two cliques, or some without a fabric, would break the memory sharing a workload
expects, so such a node is not offered for ComputeDomains at all (and says why).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from dra_driver.devices.types import FabricInfo, FabricState, Inventory

_NVML_STATES = {
    0: FabricState.NOT_SUPPORTED,
    1: FabricState.NOT_STARTED,
    2: FabricState.IN_PROGRESS,
    3: FabricState.COMPLETED,
}


def fabric_from_nvml(cluster_uuid: bytes, clique_id: int, state: int, status: str) -> FabricInfo | None:
    """``nvmlGpuFabricInfo_t``'s fields as fabric info; None when the GPU has no NVLink fabric."""
    fabric_state = _NVML_STATES.get(state, FabricState.NOT_SUPPORTED)
    if fabric_state is FabricState.NOT_SUPPORTED:
        return None
    if fabric_state is FabricState.COMPLETED and not any(cluster_uuid[:16]):
        # Registered, but in no cluster: single-node NVSwitch (DGX H100), "NVLink-capable, but
        # not MNNVL-capable" in NVIDIA's compute-domain plugin, which puts such a node in no clique.
        return None
    return FabricInfo(
        cluster_uuid=str(uuid.UUID(bytes=bytes(cluster_uuid[:16]).ljust(16, b"\0"))),
        clique_id=clique_id,
        state=fabric_state,
        status=status,
    )


@dataclass(frozen=True)
class NodeClique:
    """The clique all the node's GPUs share (``clique`` set), or why there is none (``reason``)."""

    clique: str = ""  # "<clusterUUID>.<cliqueId>"
    reason: str = ""


def node_clique(inventory: Inventory) -> NodeClique:
    """The node's NVLink clique: the one every GPU completed fabric registration in."""
    if not inventory.gpus:
        return NodeClique(reason="the node has no GPUs")
    missing = [gpu.uuid for gpu in inventory.gpus if gpu.fabric is None]
    if missing:
        return NodeClique(reason=f"GPUs without NVLink fabric info: {', '.join(missing)}")
    unfinished = [
        f"{gpu.uuid} ({gpu.fabric.state.value})"
        for gpu in inventory.gpus
        if gpu.fabric is not None and gpu.fabric.state is not FabricState.COMPLETED
    ]
    if unfinished:
        return NodeClique(reason=f"GPUs whose fabric registration has not completed: {', '.join(unfinished)}")
    failed = [
        f"{gpu.uuid} ({gpu.fabric.status})"
        for gpu in inventory.gpus
        if gpu.fabric is not None and gpu.fabric.status != "Success"
    ]
    if failed:  # NVML's status counts once registration completed, and then it must be a success
        return NodeClique(reason=f"GPUs whose fabric registration failed: {', '.join(failed)}")
    cliques = sorted({gpu.fabric.clique for gpu in inventory.gpus if gpu.fabric is not None})
    if len(cliques) != 1:
        listed = ", ".join(cliques)
        return NodeClique(reason=f"the node's GPUs are in {len(cliques)} NVLink cliques: {listed}")
    return NodeClique(clique=cliques[0])
