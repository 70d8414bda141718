"""The one interface every GPU backend implements.

Methods are blocking (NVML is a C library); callers on the event loop wrap them in
``asyncio.to_thread``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from dra_driver.devices.pci import PciBus
from dra_driver.devices.types import ComputePolicy, Inventory, MigDevice, OrphanedGpuInstance, Placement


class DeviceError(Exception):
    """A hardware operation failed; the message says what and what to do."""


class DeviceInUseError(DeviceError):
    """The device is busy (processes attached); the operation may succeed on retry."""


class PlacementUnavailableError(DeviceError):
    """The requested MIG placement is not offered or overlaps a live instance."""


class Backend(Protocol):
    """What the driver needs from the hardware."""

    def inventory(self) -> Inventory:
        """Read the node's GPUs and their MIG state as they are now."""
        ...

    def create_mig_device(self, parent_uuid: str, profile_id: int, placement: Placement) -> MigDevice:
        """Create a GPU instance at exactly ``placement`` plus a compute instance spanning it.

        Enables MIG mode first where that needs no reset. Leaves the GPU as it was on failure.
        """
        ...

    def destroy_mig_device(self, parent_uuid: str, mig_uuid: str) -> None:
        """Destroy the compute and GPU instance behind ``mig_uuid``; unknown uuids are a no-op.

        Where MIG mode switches without a reset, switches it off again once the GPU
        has no MIG device left, so the full GPU is usable again.
        """
        ...

    def compute_policy(self, gpu_uuid: str) -> ComputePolicy:
        """The full GPU's compute mode and time slice as they are now."""
        ...

    def set_compute_policy(self, gpu_uuid: str, policy: ComputePolicy) -> None:
        """Set the full GPU's compute mode, then its time slice; on failure the GPU is left as it was."""
        ...

    def orphaned_gpu_instances(self) -> frozenset[OrphanedGpuInstance]:
        """The GPU instances failed rollbacks left that are not destroyed yet: for the node to remember."""
        ...

    def adopt_orphaned_gpu_instances(self, orphans: Iterable[OrphanedGpuInstance]) -> None:
        """Those an earlier run of the driver left (as the node remembered them): kept off the
        inventory's devices, and destroyed now or at an inventory read once NVML lets them go."""

    def processes(self, gpu_uuid: str) -> int:
        """How many processes use the full GPU now (compute and graphics): passthrough needs none."""
        ...

    def pci(self) -> PciBus:
        """The node's PCI bus, where a GPU is moved to vfio-pci for passthrough and back."""
        ...

    def close(self) -> None:
        """Release the backend (NVML shutdown; nothing for the simulator)."""
        ...
