"""Preparing and unpreparing claims on this node: the :class:`ClaimPreparer` the kubelet layer calls.

One prepare, for one claim::

    check the identity -> already PrepareCompleted (and its spec on disk)? answer from
    the record: idempotent, the kubelet prepares again after it restarts
    -> GET the claim -> keep our results -> plan (devices, configs, CDI spec; pure)
    -> nothing to create (full GPUs, existing MIG devices): write the CDI spec, then
       commit PrepareCompleted in one step (refused if another claim holds a device:
       the spec goes again) -> answer
    -> MIG devices to create, or sharing to apply (TimeSlicing, MPS): commit
       PrepareStarted first (reserves the devices, records the MIG devices to create
       and what each GPU's compute mode and time slice are now; refused if another
       claim holds one)
    -> create each MIG device, committing its uuid as soon as it exists
    -> apply the sharing: compute mode and time slice, the claim's MPS control daemon
       started and waited for (:mod:`dra_driver.node.sharing.applier`)
    -> write the CDI spec -> commit PrepareCompleted -> answer

With binding conditions (:mod:`dra_driver.node.binding`) the same prepare runs earlier, started
by the claim's watch before the pod is bound (:meth:`NodePreparer.prepare_ahead`); its record says
so until the kubelet's prepare finds it done and takes it over.

The one-step commit is safe because a spec on disk without a record is what recovery
already treats as a prepared claim (:mod:`dra_driver.node.recovery`): after a crash
between the two, the devices stay reserved until the kubelet's retry or unprepare. It
halves the store's writes of the common prepare. The spec stays locked until its
record is committed, so that a second instance starting meanwhile (a rolling update)
does not take a live prepare for a crashed one.

A passthrough claim (a GPU for a virtual machine) takes steps too: after PrepareStarted is
committed (the GPU and its MIG placements reserved, the GPU recorded), its CDI spec is written,
and held locked until the record is complete; then each GPU is checked idle (no processes; no
other function of its IOMMU group on a host driver) and moved to vfio-pci
(:mod:`dra_driver.devices.pci`, which binds it back to nvidia when a step fails). So a GPU this
driver moved off nvidia is always named by a spec, which rebuilds its claim after a lost store,
and the next start gives back to nvidia a GPU whose prepare died before its record was complete
(:func:`dra_driver.node.recovery.repair_passthrough`). Its unprepare, and the undo of a failed
prepare, bind it back to nvidia before the spec and the record go. A later attempt that finds an
earlier one's record binds that one's GPUs back first, then starts afresh; a repeated prepare of a
completed claim whose GPU is not on vfio-pci (an unprepare died half-way) prepares it again.

Unprepare stops the claim's MPS daemon and puts back each GPU's compute mode and time
slice (unless another prepared claim still shares that GPU), then destroys the claim's
MIG devices: while one cannot be destroyed (in use), the claim keeps its record and
spec and the kubelet retries. Only then are the spec and the record removed.

Claims are independent: each runs in its own task, so one slow GET or a refused
device delays or fails only its own claim. Every change of the claim's record is one
short transaction of the node's store (:mod:`dra_driver.node.store`), whose schema refuses
a device to a second claim. Work on one claim is serialized by a per-claim
lock (the kubelet may retry a claim while the first attempt still runs), and
continues when the kubelet gives up waiting (its 45 s timeout cancels the RPC): the
retry then finds it done, and shutdown waits for it (:meth:`NodePreparer.drain`). A
step that fails undoes the claim's earlier steps, so a failed prepare leaves no spec,
no record and no MIG device; if even the undo fails,
the record stays PrepareStarted, keeps the devices reserved, and the next prepare
or unprepare of the claim takes it over.

The CDI spec is written and removed on the event loop, not in a worker thread: it is a
file of a few KiB in a local directory (a tmpfs by default), renamed into place and never
fsynced (:mod:`dra_driver.cdi.store`), which takes less time than a thread hop and the
wake-up after it. The store's commits run on the event loop too, for the same reason
(:mod:`dra_driver.node.store`). Only NVML calls (MIG devices) go to worker threads.

Across plugin instances (rolling update) the store's locking and its unique index
keep devices exclusive. Two instances preparing the *same* claim at the same moment
are not coordinated beyond that: the kubelet sends a claim to one plugin at a time. A
claim the other instance completed after this one read its record (it stopped before
it answered, and the kubelet asks again here) is answered from that instance's record.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import secrets
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

import structlog

from dra_driver import crashpoint
from dra_driver.cdi.metadata import MetadataFiles
from dra_driver.cdi.spec import CommonEdits
from dra_driver.cdi.store import SpecStore
from dra_driver.devices.backend import Backend, DeviceError
from dra_driver.devices.pci import VFIO_PCI, PassthroughGpu, PciError
from dra_driver.devices.types import Gpu, Inventory, MigDevice
from dra_driver.node.claim_fetcher import ClaimFetcher, ClaimFetchError
from dra_driver.node.claims import AllocatedClaim, ClaimRejected, allocated_claim, check_ref
from dra_driver.node.config import config_json
from dra_driver.node.partitioner import Partitioner, PartitionError
from dra_driver.node.plan import ClaimPlan, MetadataSource, MigPlacement, PlannedDevice, plan_claim
from dra_driver.node.records import (
    ClaimRecord,
    DeviceRecord,
    MigRecord,
    MutationRejected,
    NodeState,
    PassthroughRecord,
    SharingRecord,
    SharingState,
    StoreWriteError,
    read_boot_id,
)
from dra_driver.node.recovery import Conflict, recover, repair_passthrough
from dra_driver.node.sharing.applier import SharingApplier, SharingError
from dra_driver.node.sharing.mps import MpsDaemonError, MpsDaemons
from dra_driver.node.sharing.policy import NO_SHARING, SharingPlan, sharing_plan
from dra_driver.node.store import (
    Complete,
    Progress,
    Release,
    Reserve,
    Store,
    open_store,
)
from dra_driver.node.types import ClaimError, ClaimRef, PreparedDevice, PrepareOutcome
from dra_driver.resources.capacity import MEMORY
from dra_driver.resources.device_names import gpu_device_name
from dra_driver.resources.devices import PartitionPolicy, partition_all

log = structlog.get_logger(__name__)

_T = TypeVar("_T")
# Errors that are about the claim, or transient (I/O), reported to the kubelet as they are.
_CLAIM_ERRORS = (
    ClaimRejected,
    ClaimFetchError,
    MutationRejected,
    StoreWriteError,
    PartitionError,
    SharingError,
    MpsDaemonError,
    DeviceError,
    PciError,
    OSError,
)


class PrepareObserver(Protocol):
    """Where the app's metrics hear about every claim operation."""

    def prepare_done(self, seconds: float, ok: bool) -> None: ...

    def unprepare_done(self, seconds: float, ok: bool) -> None: ...


class NodePreparer:
    """Prepares claims allocated from pool ``node_name`` of driver ``driver_name``.

    ``inventory`` is called on the event loop for every claim it plans, so it must not
    block: pass the app's cached view of the backend, not a hardware read. After every
    MIG device it creates or destroys, the preparer reads ``backend`` again and passes
    the result to ``on_inventory_changed``, which must make ``inventory`` return it
    (and republish). ``partition`` is the policy that publishes MIG placements: only
    GPUs it selects get MIG devices created. ``consumable`` says whether full GPUs are
    published as shareable (consumable capacity): only then are shares of them prepared.
    ``on_prepared`` and ``on_unprepared`` hear of every claim prepared (also again) and
    unprepared; they must not block. ``on_idle`` hears when the last running claim operation
    has finished (see :mod:`dra_driver.gpu_plugin.tuning`). With ``metadata`` every prepared claim gets the
    device metadata file of each request (KEP-5304, :mod:`dra_driver.cdi.metadata`), written
    before the spec that mounts it and removed after it.
    """

    def __init__(
        self,
        *,
        driver_name: str,
        node_name: str,
        backend: Backend,
        inventory: Callable[[], Inventory],
        claims: ClaimFetcher,
        specs: SpecStore,
        common_edits: CommonEdits,
        store_path: Path,
        boot_id_path: Path,
        partition: PartitionPolicy = partition_all,
        consumable: bool = False,
        on_inventory_changed: Callable[[Inventory], None] | None = None,
        observer: PrepareObserver | None = None,
        on_prepared: Callable[[ClaimRef, tuple[PreparedDevice, ...]], None] | None = None,
        on_unprepared: Callable[[ClaimRef], None] | None = None,
        on_idle: Callable[[], None] | None = None,
        mps: MpsDaemons | None = None,
        metadata: MetadataFiles | None = None,
        passthrough: Mapping[str, PassthroughGpu] | None = None,
    ) -> None:
        self._driver = driver_name
        self._pool = node_name
        self._backend = backend
        self._inventory = inventory
        self._claims = claims
        self._specs = specs
        self._common = common_edits
        self._boot_id_path = boot_id_path
        self._partition = partition
        self._consumable = consumable
        self._observer = observer
        self._on_prepared = on_prepared
        self._on_unprepared = on_unprepared
        self._on_idle = on_idle
        self._store_path = store_path
        self._store: Store | None = None  # opened by start()
        # Claims the start's recovery could not record (another claim held their device).
        self.recovery_conflicts: list[Conflict] = []
        self._repaired_gpus = 0  # GPUs the start gave back to nvidia (recovery.repair_passthrough)
        self._locks = _ClaimLocks()
        self._partitioner = Partitioner(backend, self._state, on_inventory_changed)
        self._in_flight: set[asyncio.Task[Any]] = set()  # claim operations still running
        self._sharing = SharingApplier(backend, mps)
        self._metadata = metadata
        self._passthrough = passthrough  # by PCI address; None: --passthrough is off

    async def start(self) -> None:
        """Open the store (repairing it after a reboot, damage or a crash); call once before serving."""
        self._store = await asyncio.to_thread(self._open)
        if await asyncio.to_thread(self._partitioner.adopt_orphans) or self._repaired_gpus:
            # Their slices are reserved, or free again; GPUs back on nvidia are published again.
            await self._partitioner.changed()
        await self._sharing.stop_leftover_daemons(self._fresh_state)
        log.info("prepared claims loaded", claims=self._store.count(), path=str(self._store.path))

    def _open(self) -> Store:
        opened = open_store(self._store_path, read_boot_id(self._boot_id_path))
        if opened.earlier_boot and self._metadata is not None:
            self._metadata.remove_all()  # the claims of an earlier boot are prepared no more
        self.recovery_conflicts = recover(opened, self._specs, self._pool, self._live_mig_devices)
        if not opened.earlier_boot:  # after a reboot every GPU is on nvidia
            self._repaired_gpus = repair_passthrough(opened.store, self._specs, self._backend.pci)
        return opened.store

    def remember_orphans(self) -> None:
        """Record the GPU instances failed rollbacks left, as the last inventory read found them."""
        if self._store is not None:
            self._partitioner.remember_orphans()

    def close(self) -> None:
        """Close the store's connection (a stopped plugin, a test's preparer)."""
        if self._store is not None:
            self._store.close()
            self._store = None

    def _state(self) -> Store:
        if self._store is None:
            raise RuntimeError("the preparer serves claims only after start()")
        return self._store

    async def _fresh_state(self) -> NodeState:
        return self._state().snapshot()

    def _live_mig_devices(self) -> list[MigDevice]:
        return [mig for gpu in self._backend.inventory().gpus for mig in gpu.mig_devices]

    @property
    def prepared_claims(self) -> int:
        """Claims recorded as prepared (or being prepared) on this node, for the metrics gauge."""
        return self._store.count() if self._store is not None else 0

    def prepared(self) -> list[tuple[ClaimRef, tuple[PreparedDevice, ...]]]:
        """The claims the store holds as completely prepared, with their devices."""
        return [
            (ClaimRef(record.namespace, record.name, uid), _prepared_devices(record))
            for uid, record in self._state().snapshot().claims.items()
            if record.phase == "PrepareCompleted" and record.namespace
        ]

    def owned_mig_uuids(self) -> frozenset[str]:
        """The MIG devices this driver created for claims; every other MIG device is static."""
        return frozenset(self._state().mig_holders())

    async def drain(self, grace: float) -> None:
        """Wait up to ``grace`` seconds for the claim operations still running; call once no RPC comes.

        They are shielded from their RPC's cancellation, so they outlive the kubelet sockets:
        closing the backend or the API client under one would break it between a MIG device
        created and its uuid recorded. What is still running after ``grace`` is logged and left
        to the store's recovery at the next start, which takes over or undoes it.
        """
        if not self._in_flight:
            return
        log.info("waiting for claim operations to finish", operations=len(self._in_flight))
        _, running = await asyncio.wait(set(self._in_flight), timeout=grace)
        if running:
            log.warning(
                "claim operations still running at shutdown; the next start of the plugin recovers them",
                operations=sorted(task.get_name() for task in running),
                waited_seconds=grace,
            )

    async def prepare(self, claims: Sequence[ClaimRef]) -> dict[str, PrepareOutcome]:
        report = self._observer.prepare_done if self._observer else None
        outcomes = await _together([self._run(ref, "prepare", self._prepare, report) for ref in claims])
        if self._on_prepared is not None:
            for ref, outcome in zip(claims, outcomes, strict=True):
                if not isinstance(outcome, ClaimError):
                    self._on_prepared(ref, outcome)
        self._maybe_idle()
        return {ref.uid: outcome for ref, outcome in zip(claims, outcomes, strict=True)}

    async def prepare_ahead(self, ref: ClaimRef) -> tuple[PreparedDevice, ...] | ClaimError:
        """Prepare ``ref`` before its pod is bound (binding conditions, :mod:`dra_driver.node.binding`).

        The same prepare as the kubelet's, recorded as done ahead of binding: the kubelet's prepare
        then finds it done and takes it over, and until then :meth:`ahead_of_binding` lists it, for
        the watcher to unprepare should the pod never come (its binding failed or timed out).
        """
        report = self._observer.prepare_done if self._observer else None
        outcome = await self._run(ref, "prepare ahead of binding", self._prepare_ahead, report)
        if self._on_prepared is not None and not isinstance(outcome, ClaimError):
            self._on_prepared(ref, outcome)
        self._maybe_idle()
        return outcome

    def ahead_of_binding(self) -> dict[str, ClaimRecord]:
        """The claims prepared ahead of binding that the kubelet has not asked for yet, by uid."""
        return {uid: r for uid, r in self._state().snapshot().claims.items() if r.ahead_of_binding}

    def prepared_ahead(self, uid: str) -> ClaimRecord | None:
        """``uid``'s record if it was prepared ahead of binding and the kubelet has not asked for it.

        One row: the binding watcher asks on every claim event of the cluster, and a snapshot
        decodes every record of the node (a status write of each of 200 prepared claims then
        decoded 200 records per event).
        """
        record = self._state().claim(uid)
        return record if record is not None and record.ahead_of_binding else None

    async def unprepare(self, claims: Sequence[ClaimRef]) -> dict[str, ClaimError | None]:
        report = self._observer.unprepare_done if self._observer else None
        outcomes = await _together([self._run(ref, "unprepare", self._unprepare, report) for ref in claims])
        if self._on_unprepared is not None:
            for ref, outcome in zip(claims, outcomes, strict=True):
                if outcome is None:
                    self._on_unprepared(ref)
        self._maybe_idle()
        return {ref.uid: outcome for ref, outcome in zip(claims, outcomes, strict=True)}

    @property
    def busy(self) -> bool:
        """Whether a claim operation is running."""
        return bool(self._in_flight)

    def _maybe_idle(self) -> None:
        if self._on_idle is not None and not self._in_flight:
            self._on_idle()

    async def _run(
        self,
        ref: ClaimRef,
        operation: str,
        step: Callable[[ClaimRef], Coroutine[Any, Any, _T]],
        report: Callable[[float, bool], None] | None,
    ) -> _T | ClaimError:
        """Run one claim's operation to completion with the claim in every log line; never raises."""
        started = time.monotonic()
        with structlog.contextvars.bound_contextvars(
            claim_namespace=ref.namespace, claim_name=ref.name, claim_uid=ref.uid
        ):
            # A task of its own, shielded: a cancelled RPC must not stop a claim half-way between
            # its steps. It is tracked so that shutdown can wait for it (drain).
            work = asyncio.create_task(step(ref), name=f"{operation} {ref.namespace}/{ref.name} ({ref.uid})")
            self._in_flight.add(work)
            work.add_done_callback(self._in_flight.discard)
            try:
                outcome: _T | ClaimError = await asyncio.shield(work)
            except _CLAIM_ERRORS as error:
                log.warning(f"{operation} failed", error=str(error))
                outcome = ClaimError(str(error))
            except Exception as error:
                log.exception(f"{operation} failed unexpectedly")
                outcome = ClaimError(f"internal error in the DRA driver: {error!r}; see the plugin's log")
            if report is not None:
                report(time.monotonic() - started, not isinstance(outcome, ClaimError))
            return outcome

    async def _prepare_ahead(self, ref: ClaimRef) -> tuple[PreparedDevice, ...]:
        return await self._prepare(ref, ahead=True)

    async def _prepare(self, ref: ClaimRef, ahead: bool = False) -> tuple[PreparedDevice, ...]:
        check_ref(ref)
        async with self._locks.hold(ref.uid):
            store = self._state()
            existing = store.claim(ref.uid)
            if existing is not None and existing.phase == "PrepareCompleted":
                if (existing.namespace, existing.name) != (ref.namespace, ref.name):
                    raise ClaimRejected(
                        f"uid {ref.uid} is prepared for claim {existing.namespace}/{existing.name}, "
                        f"not {ref.namespace}/{ref.name}"
                    )
                if not self._passed_through(existing):
                    # An unprepare gave the GPU back to nvidia and died before its spec and record
                    # went: not prepared any more, whatever the record says.
                    log.warning("the GPU of a prepared passthrough claim is off vfio-pci; preparing it again")
                elif self._specs.path_for(ref.uid).exists():
                    if existing.ahead_of_binding and not ahead:
                        # The pod is bound and the kubelet asks: from now on its unprepare undoes it.
                        store.commit(
                            Progress(ref.uid, existing.model_copy(update={"ahead_of_binding": False}))
                        )
                        log.info("claim prepared ahead of binding; the kubelet takes it over")
                        return _prepared_devices(existing)
                    log.info("claim already prepared")
                    return _prepared_devices(existing)
                else:
                    log.warning("CDI spec of a prepared claim is missing; preparing it again")
            elif existing is not None:
                # Its MIG device is the claim's (created by an earlier attempt), not a static one.
                adopted = await self._with_created_before_a_crash(existing)
                if adopted is not existing:
                    store.commit(Progress(ref.uid, adopted))
                    existing = adopted
            claim_json = await self._claims.get(ref.namespace, ref.name)
            if claim_json is None:
                raise ClaimRejected(
                    f"claim {ref.namespace}/{ref.name} not found: it was deleted; "
                    "the pod cannot start until the claim exists again"
                )
            claim = allocated_claim(ref, claim_json, self._driver, self._pool)
            if existing is not None and (taken := self._recovered_admin_claim(existing, claim)) is not None:
                store.commit(Progress(ref.uid, taken))
                log.info("claim rebuilt from its CDI spec taken as prepared")
                return _prepared_devices(taken)
            if existing is not None and _passthrough_of(existing):
                # An earlier attempt's GPUs on vfio-pci go back to nvidia: this one starts afresh.
                await self._bind_back(existing)
            inventory = self._inventory()
            plan = plan_claim(
                claim,
                inventory,
                self._driver,
                # The control nodes of the current inventory: nvidia-uvm and nvidia-modeset appear
                # when their kernel modules load, possibly after the plugin started.
                dataclasses.replace(self._common, device_nodes=inventory.control_nodes),
                partition=self._partition,
                mig_holders=store.mig_holders(),
                consumable=self._consumable,
                metadata=MetadataSource(self._metadata.plugin_dir, inventory) if self._metadata else None,
                passthrough=self._passthrough,
            )
            sharing = sharing_plan(plan)
            # Sharing, MIG devices to create and GPUs to pass through take steps, each recorded first.
            in_steps = bool(plan.to_create) or sharing.changes_anything or bool(plan.passthrough)
            # Only claims that change a GPU's settings take turns (see SharingApplier.lock): the
            # others' commits must stay concurrent, so that they share fsyncs.
            guard: contextlib.AbstractAsyncContextManager[object] = (
                self._sharing.lock if sharing.changes_anything else contextlib.nullcontext()
            )
            async with guard:
                record = ClaimRecord(
                    namespace=ref.namespace,
                    name=ref.name,
                    phase="PrepareStarted" if in_steps else "PrepareCompleted",
                    attempt=secrets.token_hex(8),
                    ahead_of_binding=ahead,
                    devices=_device_records(plan),
                    sharing=await self._sharing.record(
                        ref.uid,
                        plan,
                        sharing,
                        existing,
                        store.sharing() if sharing.changes_anything else SharingState(),
                    ),
                )
                reserve = Reserve(ref.uid, record, replaces=existing.attempt if existing else None)
                try:
                    if in_steps:
                        store.commit(reserve)
                    else:
                        self._write_spec_and_commit(ref.uid, plan, reserve)
                except MutationRejected:
                    if (theirs := self._completed_elsewhere(ref, existing)) is None:
                        raise
                    log.info("claim already prepared by another plugin instance")
                    return _prepared_devices(theirs)
            if existing is not None:
                log.info("replaced an earlier record of the claim", phase=existing.phase)
                await self._destroy_replaced(existing, record)
                await self._undo_replaced_sharing(ref.uid, existing, record)
            completed = await self._complete(ref.uid, plan, record, sharing) if in_steps else record
            log.info("claim prepared", devices=[d.device for d in completed.devices])
            return _prepared_devices(completed)

    def _recovered_admin_claim(self, record: ClaimRecord, claim: AllocatedClaim) -> ClaimRecord | None:
        """A claim of admin access alone, rebuilt from its spec, as prepared; None for any other.

        Planned afresh, it could now be refused where it was prepared before: admin access holds
        nothing, so the GPU may have gone into MIG mode since (a MIG device of another claim), and
        a full GPU in MIG mode is not planned. Its spec and the allocation naming the same devices
        is all such a claim is: it is taken as it stands, with the requests the allocation gives.
        """
        if record.phase != "Recovered" or not self._specs.path_for(claim.ref.uid).exists():
            return None
        by_device = {(r.device, r.share_id): r for r in claim.results}
        recorded = {(d.device, d.share_id): d for d in record.devices}
        if (
            len(by_device) != len(claim.results)
            or by_device.keys() != recorded.keys()
            or not all(r.admin_access and recorded[key].admin_access for key, r in by_device.items())
        ):
            return None
        devices = tuple(
            d.model_copy(update={"request": by_device[key].request}) for key, d in recorded.items()
        )
        return record.model_copy(
            update={
                "namespace": claim.ref.namespace,
                "name": claim.ref.name,
                "phase": "PrepareCompleted",
                "devices": devices,
            }
        )

    def _completed_elsewhere(self, ref: ClaimRef, seen: ClaimRecord | None) -> ClaimRecord | None:
        """The claim's record if another instance completed it since ``seen`` was read, else None.

        The refused commit read the store afresh: the other instance of a rolling update may
        have prepared the claim after this one started, then stopped before it answered the
        kubelet, which now asks here. That prepare stands, as a repeated one would on its instance.
        """
        record = self._state().claim(ref.uid)
        if record is None or record.phase != "PrepareCompleted" or (seen and record.attempt == seen.attempt):
            return None
        if (record.namespace, record.name) != (ref.namespace, ref.name):
            return None
        return record if self._specs.path_for(ref.uid).exists() else None

    def _write_spec_and_commit(self, uid: str, plan: ClaimPlan, reserve: Reserve) -> None:
        """The one-step prepare: the spec, then the completed record; no spec stays if it is refused."""
        self._write_metadata(plan)
        try:
            # Held until the record is committed: another instance starting meanwhile leaves it alone.
            with self._specs.write_held(uid, plan.cdi_spec):
                try:
                    self._state().commit(reserve)
                except BaseException:
                    # Another attempt's record of this claim (another instance) keeps the spec: theirs too.
                    if self._state().claim(uid) is None:
                        self._specs.remove(uid)
                    raise
        except BaseException:
            if self._state().claim(uid) is None:  # the metadata too, as the spec
                self._remove_metadata(plan.claim.ref)
            raise

    def _write_metadata(self, plan: ClaimPlan) -> None:
        if self._metadata is not None:
            self._metadata.write(plan.metadata_files)

    def _remove_metadata(self, ref: ClaimRef) -> None:
        if self._metadata is not None:
            self._metadata.remove(ref.namespace, ref.name)

    async def _destroy_replaced(self, old: ClaimRecord, new: ClaimRecord) -> None:
        """Destroy the MIG devices an earlier attempt created that the new record does not use."""
        kept = {d.mig.uuid for d in new.devices if d.mig is not None}
        replaced = {
            d.mig.uuid: (d.device, d.mig.parent_uuid)
            for d in old.devices
            if d.mig is not None and d.mig.uuid is not None and d.mig.uuid not in kept
        }
        for mig_uuid, (name, parent_uuid) in replaced.items():
            try:
                await self._partitioner.destroy(name, parent_uuid, mig_uuid)
            except PartitionError as error:
                log.error(
                    "a MIG device an earlier attempt created is no longer recorded and could not be "
                    "destroyed",
                    error=str(error),
                    what_to_do="destroy it by hand once no process uses it (nvidia-smi mig -dci, -dgi)",
                )
        if replaced:
            await self._partitioner.changed()

    async def _undo_replaced_sharing(self, uid: str, old: ClaimRecord, new: ClaimRecord) -> None:
        """Undo the sharing an earlier attempt applied that the new record does not hold."""
        if old.sharing is None:
            return
        kept = {g.gpu_uuid for g in new.sharing.gpus} if new.sharing else set()
        daemon = new.sharing.mps_daemon if new.sharing else None
        replaced = SharingRecord(
            gpus=tuple(g for g in old.sharing.gpus if g.gpu_uuid not in kept),
            mps_daemon=old.sharing.mps_daemon if old.sharing.mps_daemon != daemon else None,
        )
        try:
            await self._sharing.undo(uid, replaced, self._state().sharing())
        except SharingError as error:
            log.error("sharing an earlier attempt applied could not be undone", error=str(error))

    async def _complete(
        self, uid: str, plan: ClaimPlan, reserved: ClaimRecord, sharing: SharingPlan = NO_SHARING
    ) -> ClaimRecord:
        """The side effects after the reservation; undone (sharing, MIG devices, spec, record) on failure."""
        record = reserved
        created: list[tuple[str, MigDevice]] = []  # by this attempt, oldest first
        recorded = 0  # how many of them the record on disk names
        # PCI addresses of the GPUs this attempt moves to vfio-pci, each listed before its move: a
        # move whose rollback failed too leaves its GPU unbound, and the undo tries nvidia again.
        bound: list[str] = []
        # A passthrough claim's spec is written before its GPUs leave nvidia, and held locked until
        # the record is complete: a GPU this driver moved off nvidia is always named by a spec, so
        # that after a crash and a lost store the spec's claim still binds it back (recovery), and
        # a plugin instance starting meanwhile leaves a live prepare's GPUs alone.
        held = contextlib.ExitStack()
        try:
            if plan.passthrough:
                held.enter_context(self._specs.write_held(uid, plan.before_binding().cdi_spec))
            for device in plan.passthrough:
                assert device.target.passthrough is not None
                bound.append(device.target.passthrough.address)
                cdev = await self._pass_through(device)
                if device.iommufd:
                    plan = plan.with_cdev(device.result.device, cdev)
            if bound:
                await self._partitioner.changed()  # the GPUs left NVML's view: republish
            for name, (gpu, placement) in plan.to_create.items():
                mig = await self._partitioner.create(name, _mig_record(gpu, placement))
                created.append((name, mig))
                plan = plan.with_created(name, mig)
                record = _with_mig_uuid(record, name, mig.uuid)
                self._state().commit(Progress(uid, record))
                recorded += 1
            if created:
                await self._partitioner.changed()
            plan = await self._sharing.apply(plan, sharing, record.sharing)
            self._write_metadata(plan)
            if plan.passthrough:  # complete now (an IOMMUFD cdev is named once the GPU is on vfio-pci)
                held.enter_context(self._specs.write_held(uid, plan.cdi_spec))
            else:
                self._specs.write(uid, plan.cdi_spec)
            completed = record.model_copy(update={"phase": "PrepareCompleted"})
            self._state().commit(Complete(uid, completed))
        except MutationRejected:
            # The record is gone or another attempt's: its spec is not ours to remove, and the MIG
            # devices it names are that attempt's to use. Only the unrecorded ones are ours alone,
            # and the GPUs passed through when no record names them any more.
            await self._destroy_created(created[recorded:])
            if self._state().claim(uid) is None:
                await self._unbind(bound)
            raise
        except BaseException:
            await self._undo(uid, reserved.attempt, created, reserved.sharing, bound)
            self._remove_metadata(plan.claim.ref)
            raise
        finally:
            held.close()
        return completed

    async def _pass_through(self, device: PlannedDevice) -> str:
        """Check that the GPU is idle and alone in use in its IOMMU group, then move it to vfio-pci;
        the path of its IOMMUFD cdev where the kernel has one, else ""."""
        gpu, place = device.target.gpu, device.target.passthrough
        assert place is not None
        name = device.result.device

        def move() -> str:
            processes = self._backend.processes(gpu.uuid)
            if processes:
                raise ClaimRejected(
                    f"GPU {gpu_device_name(gpu.minor)} ({place.address}) has {processes} process(es) "
                    f"running, so it cannot be passed through ({name}); the kubelet retries once they end"
                )
            busy = self._backend.pci().busy_group_members(place.address)
            if busy:
                users = ", ".join(f"{address} ({driver})" for address, driver in busy.items())
                raise ClaimRejected(
                    f"GPU {place.address} cannot be passed through ({name}): its IOMMU group "
                    f"{place.iommu_group} also holds {users}, in use by the host, and a virtual machine "
                    "gets the whole group; bind those to vfio-pci, or pass through another GPU"
                )
            crashpoint.reached("vfio.before_bind")
            self._backend.pci().bind_vfio(place.address)
            crashpoint.reached("vfio.after_bind")
            cdev = self._backend.pci().vfio_cdev(place.address)
            if device.iommufd and cdev is None:
                raise PciError(f"GPU {place.address} is on vfio-pci but has no IOMMUFD cdev (vfio-dev)")
            return cdev.path if cdev else ""

        cdev = await asyncio.to_thread(move)
        log.info(
            "GPU bound to vfio-pci", device=name, pci_bus_id=place.address, iommu_group=place.iommu_group
        )
        return cdev

    async def _unbind(self, addresses: Sequence[str]) -> None:
        """Give GPUs back to nvidia, newest first; PciError when one cannot go back (the kubelet retries)."""

        def move(address: str) -> None:
            crashpoint.reached("vfio.before_unbind")
            self._backend.pci().bind_nvidia(address)
            crashpoint.reached("vfio.after_unbind")

        for address in reversed(addresses):
            await asyncio.to_thread(move, address)
            log.info("GPU bound back to nvidia", pci_bus_id=address)
        if addresses:
            await self._partitioner.changed()

    def _passed_through(self, record: ClaimRecord) -> bool:
        """Whether every GPU ``record`` passes through is on vfio-pci (true of a claim with none)."""
        addresses = [p.pci_bus_id for p in _passthrough_of(record)]
        return not addresses or all(self._backend.pci().driver(a) == VFIO_PCI for a in addresses)

    async def _bind_back(self, record: ClaimRecord) -> None:
        """The GPUs ``record`` passed through, back on nvidia (idempotent: a GPU there stays)."""
        await self._unbind([p.pci_bus_id for p in _passthrough_of(record)])

    async def _undo(
        self,
        uid: str,
        attempt: str,
        created: Sequence[tuple[str, MigDevice]],
        sharing: SharingRecord | None = None,
        bound: Sequence[str] = (),
    ) -> None:
        try:
            if sharing is not None:
                await self._sharing.undo(uid, sharing, self._state().sharing())
            all_destroyed = await self._destroy_created(created)
            # Back on nvidia before the spec goes (a GPU off nvidia is named by a spec); one that
            # cannot go back keeps the spec and the record, for the next try.
            await self._unbind(bound)
            self._specs.remove(uid)
            if all_destroyed:
                self._state().commit(Release(uid, attempt))
        except Exception as error:
            log.error("could not undo a failed prepare; the next prepare or unprepare will", error=str(error))

    async def _destroy_created(self, created: Sequence[tuple[str, MigDevice]]) -> bool:
        """Destroy the MIG devices of a failed attempt, newest first; False when one has to stay."""
        try:
            for name, mig in reversed(created):
                await self._partitioner.destroy(name, mig.parent_uuid, mig.uuid)
        except PartitionError as error:
            log.error(
                "a MIG device of a failed prepare stays until the claim is unprepared", error=str(error)
            )
            return False
        finally:
            if created:
                await self._partitioner.changed()
        return True

    async def _unprepare(self, ref: ClaimRef) -> None:
        check_ref(ref)
        async with self._locks.hold(ref.uid):
            # From the store: during a rolling update the other instance may have prepared it.
            store = self._state()
            record = store.claim(ref.uid)
            recovered = record if record is not None and record.phase == "Recovered" else None
            if record is None or recovered is not None:
                # The record of its daemons was lost.
                await self._sharing.stop_daemons_of(ref.uid, store.snapshot())
            if record is not None and record.sharing is not None:
                record = await self._undo_sharing(ref.uid)
            if record is not None:
                record = await self._with_created_before_a_crash(record)
                await self._destroy_recorded(ref.uid, record)
                # Raises while a GPU cannot go back: the kubelet retries. The spec held meanwhile
                # tells a plugin instance starting now that this GPU is in a live unprepare's hands.
                with self._specs.held(ref.uid) if _passthrough_of(record) else contextlib.nullcontext():
                    await self._bind_back(record)
            # The spec goes first: as long as it exists, so does the record (see recovery).
            self._specs.remove(ref.uid)
            self._remove_metadata(ref)
            # Committed even when this instance has no record: the other instance may have one.
            store.commit(Release(ref.uid))
            if recovered is not None:
                await self._sharing.stop_shared_daemons_after(recovered, store.snapshot())
            log.info("claim unprepared")

    async def _with_created_before_a_crash(self, record: ClaimRecord) -> ClaimRecord:
        """``record`` naming the MIG devices an attempt created but died before recording.

        Recovery adopts them at start-up; during a rolling update the other instance may have
        died so, and this one never recovers: the claim's next prepare or unprepare adopts them by
        the same rule. A live device at exactly the placement of a device the record has no uuid
        for, named by no claim's record, is that device (the reservation keeps the placement the
        claim's alone). Without it, an unprepare would leave the device, and a prepare take it
        for an administrator's, which its unprepare leaves too.
        """
        if all(d.mig is None or d.mig.uuid is not None for d in record.devices):
            return record
        live = await asyncio.to_thread(self._live_mig_devices)
        state = self._state().snapshot()
        named = {d.mig.uuid for r in state.claims.values() for d in r.devices if d.mig and d.mig.uuid}
        for device in record.devices:
            mig = device.mig
            if mig is None or mig.uuid is not None:
                continue
            found = next(
                (
                    m
                    for m in live
                    if m.uuid not in named
                    and m.parent_uuid == mig.parent_uuid
                    and m.profile_id == mig.profile_id
                    and (m.placement.start, m.placement.size) == (mig.placement_start, mig.placement_size)
                ),
                None,
            )
            if found is not None:
                log.info(
                    "adopted a MIG device created before a crash", device=device.device, mig_uuid=found.uuid
                )
                named.add(found.uuid)
                record = _with_mig_uuid(record, device.device, found.uuid)
        return record

    async def _undo_sharing(self, uid: str) -> ClaimRecord | None:
        """Undo the claim's sharing and record that it holds none; the claim's record after it.

        Under the applier's lock, against the freshest state: shares of one GPU unprepared at once
        (a Deployment scaled down) must see each other go, or none would be the last one out to
        stop the GPU's daemon and restore its compute mode.
        """
        async with self._sharing.lock:
            record = self._state().claim(uid)
            if record is None or record.sharing is None:
                return record
            await self._sharing.undo(uid, record.sharing, self._state().sharing())
            record = record.model_copy(update={"sharing": None})
            self._state().commit(Progress(uid, record))
            return record

    async def _destroy_recorded(self, uid: str, record: ClaimRecord) -> None:
        """Destroy the claim's MIG devices; when one cannot go, record which did and raise (retry)."""
        recorded = {
            device.device: (device.mig.parent_uuid, device.mig.uuid)
            for device in record.devices
            if device.mig is not None and device.mig.uuid is not None
        }
        remaining = record
        try:
            for name, (parent_uuid, mig_uuid) in recorded.items():
                await self._partitioner.destroy(name, parent_uuid, mig_uuid)
                remaining = _with_mig_uuid(remaining, name, None)
        except PartitionError:
            if remaining is not record:
                # No longer complete: a repeated prepare must create again what is gone.
                unfinished = remaining.model_copy(update={"phase": "PrepareStarted"})
                self._state().commit(Progress(uid, unfinished))
            raise
        finally:
            if remaining is not record:
                await self._partitioner.changed()


def _device_records(plan: ClaimPlan) -> tuple[DeviceRecord, ...]:
    return tuple(
        DeviceRecord(
            request=device.result.request,
            pool=device.result.pool,
            device=device.result.device,
            admin_access=device.result.admin_access,
            share_id=device.result.share_id,
            share_bytes=device.result.consumed_capacity.get(MEMORY) if device.share else None,
            gpu_bytes=device.target.gpu.memory_bytes if device.share else None,
            cdi_device_ids=(device.cdi_device_id,),
            config=config_json(device.vfio or device.config),
            mig=_mig_record(device.target.gpu, device.target.create, device.target.mig)
            if device.target.create
            else None,
            passthrough=PassthroughRecord(
                parent_device=gpu_device_name(device.target.gpu.minor),
                pci_bus_id=device.target.passthrough.address,
            )
            if device.target.passthrough is not None
            else None,
        )
        for device in plan.devices
    )


def _passthrough_of(record: ClaimRecord) -> list[PassthroughRecord]:
    return [d.passthrough for d in record.devices if d.passthrough is not None]


def _mig_record(gpu: Gpu, create: MigPlacement, existing: MigDevice | None = None) -> MigRecord:
    """What the store keeps of a MIG device the driver creates (``existing``: made earlier)."""
    return MigRecord(
        parent_uuid=gpu.uuid,
        parent_device=gpu_device_name(gpu.minor),
        profile_id=create.profile.profile_id,
        placement_start=create.placement.start,
        placement_size=create.placement.size,
        uuid=existing.uuid if existing else None,
    )


def _with_mig_uuid(record: ClaimRecord, device: str, mig_uuid: str | None) -> ClaimRecord:
    """``record`` with the uuid of the MIG device created for ``device`` set (or cleared)."""
    return record.model_copy(
        update={
            "devices": tuple(
                d.model_copy(update={"mig": d.mig.model_copy(update={"uuid": mig_uuid})})
                if d.device == device and d.mig is not None
                else d
                for d in record.devices
            )
        }
    )


async def _together(runs: Sequence[Coroutine[Any, Any, _T]]) -> Sequence[_T]:
    """The outcomes of ``runs``, run concurrently (:meth:`NodePreparer._run` never raises).

    A pod of one claim, the usual call, is awaited as it is: ``gather`` would wrap it in one more
    task (its cost: docs/performance.md), and the claim's work already runs in a task of its own,
    shielded from the call's cancellation (``_run``).
    """
    if len(runs) == 1:
        return [await runs[0]]
    return await asyncio.gather(*runs)


def _prepared_devices(record: ClaimRecord) -> tuple[PreparedDevice, ...]:
    return tuple(
        PreparedDevice(
            requests=(device.request.partition("/")[0],),
            pool=device.pool,
            device=device.device,
            cdi_device_ids=device.cdi_device_ids,
            share_id=device.share_id,
        )
        for device in record.devices
    )


class _ClaimLocks:
    """One asyncio lock per claim uid, dropped when nobody holds or waits for it."""

    def __init__(self) -> None:
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}

    @contextlib.asynccontextmanager
    async def hold(self, uid: str) -> AsyncIterator[None]:
        lock, users = self._locks.get(uid, (asyncio.Lock(), 0))
        self._locks[uid] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[uid]
            if users == 1:
                del self._locks[uid]
            else:
                self._locks[uid] = (lock, users - 1)
