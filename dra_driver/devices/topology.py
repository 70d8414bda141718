"""Which GPUs of a node talk to each other fast: NVLink islands, PCIe switches and roots.

The scheduler compares attributes, not graphs: a claim's ``matchAttribute`` constraint asks that
every device it allocates has the same value of one attribute. So a topology is published as ids of
the groups a GPU belongs to, each group an attribute:

- **NVLink island**: the GPUs connected by active NVLinks, directly (an NVLink bridge between two
  PCIe cards) or through NVSwitches (every GPU of an HGX board, or of a GB200 tray) -- the GPUs
  ``nvidia-smi topo -m`` shows as ``NV#`` to each other. Its id is the lowest PCI bus id among its
  GPUs: stable across reboots (unlike NVML indices), readable, and the same on every GPU of it. A
  GPU without an NVLink peer is in no island, so a claim that matches on the island never gets it.
- **PCIe switch** (``PIX`` in ``nvidia-smi topo``): the upstream port of the switch a GPU sits
  behind, read from the GPU's sysfs path by the backend.
- **PCIe root** (``PHB``/``NODE``): the standard ``resource.kubernetes.io/pcieRoot`` that other
  drivers (NICs) publish too, so a claim can pair our GPU with their device.

NVML names the far end of each active link by its PCI bus id; the switch of a GB200 NVL72 rack sits
in another tray and may have none, so a switch without an address is one shared endpoint: every GPU
of the node linked to such a switch is in one island (they are, through the rack's NVLink domain).
GPUs of a multi-node fabric in different cliques (NVLink partitions) never share an island.
"""

from __future__ import annotations

from collections.abc import Iterable

from dra_driver.devices.types import Gpu

# The remote end of a link to an NVSwitch whose PCI address NVML does not report.
NVSWITCH_WITHOUT_ADDRESS = "nvswitch"


def nvlink_islands(gpus: Iterable[Gpu]) -> dict[str, str]:
    """The NVLink island id of every GPU that has an NVLink peer on the node, by GPU uuid."""
    gpus = list(gpus)
    parent: dict[str, str] = {}

    def root(node: str) -> str:
        parent.setdefault(node, node)
        while parent[node] != node:
            parent[node] = parent[parent[node]]  # path halving keeps the trees flat
            node = parent[node]
        return node

    for gpu in gpus:
        for remote in gpu.nvlink_remotes:
            parent[root(gpu.pci_bus_id)] = root(remote)
    members: dict[tuple[str, str], list[Gpu]] = {}
    for gpu in gpus:
        clique = gpu.fabric.clique if gpu.fabric is not None else ""
        members.setdefault((root(gpu.pci_bus_id), clique), []).append(gpu)
    return {
        gpu.uuid: min(g.pci_bus_id for g in island)
        for island in members.values()
        if len(island) > 1
        for gpu in island
    }
