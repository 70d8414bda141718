"""Creating and destroying the MIG devices of claims, and telling the app the GPUs changed.

NVML's MIG operations on one GPU must not interleave (creating a GPU instance and its
compute instance is two calls, and switching MIG mode on must finish first), and a
create takes a noticeable time on real hardware. So operations are serialized per GPU
by an asyncio lock and run in a worker thread, while different GPUs proceed in
parallel and the event loop keeps serving other claims.

After every change the node's inventory is read again and handed to
``on_inventory_changed``: the app republishes the ResourceSlices (the full GPU
disappears while MIG mode is on) and plans later claims against the fresh view.
Reads are serialized, so the last one delivered is never older than a change that
completed before it started; and a read that started after a change serves it too,
so a burst of changes (seven MIG devices on one GPU) costs a few reads, not seven.

Each device created is also entered in the store's table of MIG devices the driver
made, and leaves it when it is destroyed, so the driver still knows its own devices
after losing a claim's record. The GPU instances a failed rollback left, which the
backend reports, are kept in step with the store's table of them after every MIG
operation and inventory read (:meth:`Partitioner.remember_orphans`), so that the next
start hands them back to the backend to destroy.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import structlog

from dra_driver import crashpoint
from dra_driver.devices.backend import Backend, DeviceError, DeviceInUseError, PlacementUnavailableError
from dra_driver.devices.types import Inventory, MigDevice, OrphanedGpuInstance, Placement
from dra_driver.node.records import MigRecord, StoreWriteError
from dra_driver.node.store import Orphan, Store

log = structlog.get_logger(__name__)


class PartitionError(Exception):
    """A MIG device could not be created or destroyed; the message is for the user."""


def _create_failed(device: str, error: DeviceError) -> PartitionError:
    if isinstance(error, PlacementUnavailableError):
        return PartitionError(
            f"cannot create MIG device {device}: {error}. The claim was allocated from a stale "
            "ResourceSlice; the kubelet retries, and if this persists delete the pod so that "
            "the claim is allocated again"
        )
    if isinstance(error, DeviceInUseError):
        return PartitionError(f"cannot create MIG device {device} yet: {error}")
    return PartitionError(f"cannot create MIG device {device}: {error}")


class Partitioner:
    """The MIG operations of one node's backend, one at a time per GPU."""

    def __init__(
        self,
        backend: Backend,
        store: Callable[[], Store],
        on_inventory_changed: Callable[[Inventory], None] | None,
    ) -> None:
        self._backend = backend
        self._store = store  # the node's store, once the preparer has opened it
        self._on_inventory_changed = on_inventory_changed
        self._gpu_locks: dict[str, asyncio.Lock] = {}
        self._reading = asyncio.Lock()
        self._changes = 0  # changes reported so far
        self._delivered = 0  # changes the last delivered inventory includes
        self._orphans: frozenset[OrphanedGpuInstance] = frozenset()  # as the store has them

    async def create(self, device: str, mig: MigRecord) -> MigDevice:
        """Create the MIG device ``mig`` describes (named ``device`` in the slices)."""
        placement = Placement(mig.placement_start, mig.placement_size)
        async with self._gpu_lock(mig.parent_uuid):
            crashpoint.reached("mig.before_create")
            try:
                created = await asyncio.to_thread(
                    self._backend.create_mig_device, mig.parent_uuid, mig.profile_id, placement
                )
            except DeviceError as error:
                self.remember_orphans()  # a failed rollback may have left a GPU instance
                raise _create_failed(device, error) from error
            crashpoint.reached("mig.after_create")
            try:
                self._store().add_mig_device(mig.model_copy(update={"uuid": created.uuid}))
            except StoreWriteError as error:
                # Unrecorded, it would outlive a lost record as a static device: take it back.
                await asyncio.to_thread(self._backend.destroy_mig_device, mig.parent_uuid, created.uuid)
                raise PartitionError(
                    f"cannot create MIG device {device}: recording it failed ({error}); the kubelet retries"
                ) from error
        log.info("MIG device created", device=device, mig_uuid=created.uuid, gpu_uuid=mig.parent_uuid)
        return created

    async def destroy(self, device: str, parent_uuid: str, mig_uuid: str) -> None:
        """Destroy a MIG device; one that is already gone is not an error."""
        async with self._gpu_lock(parent_uuid):
            crashpoint.reached("mig.before_destroy")
            try:
                await asyncio.to_thread(self._backend.destroy_mig_device, parent_uuid, mig_uuid)
            except DeviceInUseError as error:
                raise PartitionError(
                    f"cannot destroy MIG device {device} ({mig_uuid}) yet: {error}; the kubelet retries"
                ) from error
            except DeviceError as error:
                raise PartitionError(f"cannot destroy MIG device {device} ({mig_uuid}): {error}") from error
            crashpoint.reached("mig.after_destroy")
        try:
            self._store().remove_mig_device(mig_uuid)
        except StoreWriteError as error:  # harmless: start-up forgets entries of devices that are gone
            log.warning("could not remove a destroyed MIG device from the store", error=str(error))
        log.info("MIG device destroyed", device=device, mig_uuid=mig_uuid, gpu_uuid=parent_uuid)

    async def changed(self) -> None:
        """Read the inventory after a change and hand it on; a failed read only delays the news."""
        if self._on_inventory_changed is None:
            return
        self._changes += 1
        change = self._changes
        async with self._reading:
            if self._delivered >= change:
                return  # a read that started after this change was delivered meanwhile
            covered = self._changes
            try:
                latest = await asyncio.to_thread(self._backend.inventory)
            except DeviceError as error:
                log.warning("re-reading the GPUs after a MIG change failed", error=str(error))
                return
            self._delivered = covered
            self.remember_orphans()  # the read destroys those NVML lets go now
            try:
                self._on_inventory_changed(latest)
            except Exception:  # publishing is the app's business; it must not undo a done prepare
                log.exception("handing on the inventory after a MIG change failed")

    def adopt_orphans(self) -> bool:
        """Hand the backend the orphaned GPU instances the store remembers (blocking: NVML destroys
        those it can at once); whether there were any."""
        self._orphans = frozenset(
            OrphanedGpuInstance(gpu, profile, Placement(start, size))
            for gpu, profile, start, size in self._store().orphans()
        )
        if self._orphans:
            self._backend.adopt_orphaned_gpu_instances(self._orphans)
            self.remember_orphans()
        return bool(self._orphans)

    def remember_orphans(self) -> None:
        """Write the backend's orphaned GPU instances to the store, when they changed since the last write."""
        orphans = self._backend.orphaned_gpu_instances()
        if orphans == self._orphans:
            return

        def rows(changed: frozenset[OrphanedGpuInstance]) -> list[Orphan]:
            return sorted((o.gpu_uuid, o.profile_id, o.placement.start, o.placement.size) for o in changed)

        try:
            self._store().update_orphans(rows(orphans - self._orphans), rows(self._orphans - orphans))
        except StoreWriteError as error:  # the next MIG operation or inventory read tries again
            log.warning("could not record the GPU instances a failed rollback left", error=str(error))
            return
        self._orphans = orphans

    def _gpu_lock(self, gpu_uuid: str) -> asyncio.Lock:
        return self._gpu_locks.setdefault(gpu_uuid, asyncio.Lock())
