"""Preparing and unpreparing claims on this node: the :class:`ClaimPreparer` the kubelet layer calls.

One prepare, for one claim::

    check the identity -> already PrepareCompleted (and its spec on disk)? answer from
    the record: idempotent, the kubelet prepares again after it restarts
    -> GET the claim -> keep our results -> plan (devices, configs, CDI spec; pure)
    -> commit PrepareStarted (reserves the devices; refused if another claim holds one)
    -> write the CDI spec -> commit PrepareCompleted -> answer

Claims are independent: each runs in its own task, so one slow GET or a refused
device delays or fails only its own claim, and their checkpoint writes share fsyncs
(:mod:`dra_driver.node.journal`). Work on one claim is serialized by a per-claim
lock (the kubelet may retry a claim while the first attempt still runs), and
continues when the kubelet gives up waiting (its 45 s timeout cancels the RPC): the
retry then finds it done. A step that fails undoes the claim's earlier steps, so a
failed prepare leaves no spec and no record; if even the undo fails, the record
stays PrepareStarted, keeps the devices reserved, and the next prepare or unprepare
of the claim takes it over.

Across plugin instances (rolling update) the journal's file lock and conflict rules
keep devices exclusive. Two instances preparing the *same* claim at the same moment
are not coordinated beyond that: the kubelet sends a claim to one plugin at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Protocol, TypeVar

import structlog

from dra_driver.cdi.spec import CommonEdits
from dra_driver.cdi.store import SpecStore
from dra_driver.devices.types import Inventory
from dra_driver.node.checkpoint import Checkpoint, ClaimRecord, DeviceRecord, LoadedCheckpoint, read_boot_id
from dra_driver.node.claim_fetcher import ClaimFetcher, ClaimFetchError
from dra_driver.node.claims import ClaimRejected, allocated_claim, check_ref
from dra_driver.node.config import config_json
from dra_driver.node.journal import CheckpointWriteError, Journal
from dra_driver.node.plan import ClaimPlan, plan_claim
from dra_driver.node.recovery import starting_state
from dra_driver.node.state import Complete, MutationRejected, Release, Reserve
from dra_driver.node.types import ClaimError, ClaimRef, PreparedDevice, PrepareOutcome

log = structlog.get_logger(__name__)

_T = TypeVar("_T")
# Errors that are about the claim, or transient (I/O), reported to the kubelet as they are.
_CLAIM_ERRORS = (ClaimRejected, ClaimFetchError, MutationRejected, CheckpointWriteError, OSError)


class PrepareObserver(Protocol):
    """Where the app's metrics hear about every claim operation."""

    def prepare_done(self, seconds: float, ok: bool) -> None: ...

    def unprepare_done(self, seconds: float, ok: bool) -> None: ...


class NodePreparer:
    """Prepares claims allocated from pool ``node_name`` of driver ``driver_name``.

    ``inventory`` is called on the event loop for every claim it plans, so it must not
    block: pass the app's cached view of the backend, not a hardware read.
    """

    def __init__(
        self,
        *,
        driver_name: str,
        node_name: str,
        inventory: Callable[[], Inventory],
        claims: ClaimFetcher,
        specs: SpecStore,
        common_edits: CommonEdits,
        checkpoint_path: Path,
        boot_id_path: Path,
        observer: PrepareObserver | None = None,
    ) -> None:
        self._driver = driver_name
        self._pool = node_name
        self._inventory = inventory
        self._claims = claims
        self._specs = specs
        self._common = common_edits
        self._boot_id_path = boot_id_path
        self._observer = observer
        self._journal = Journal(checkpoint_path)
        self._locks = _ClaimLocks()

    async def start(self) -> None:
        """Load the checkpoint (repairing it after a reboot or damage); call once before serving."""
        boot_id = await asyncio.to_thread(read_boot_id, self._boot_id_path)
        await self._journal.open(boot_id, self._starting_state)
        log.info(
            "prepared claims loaded", claims=len(self._journal.state.claims), path=str(self._journal.path)
        )

    def _starting_state(self, loaded: LoadedCheckpoint) -> Checkpoint:
        return starting_state(loaded, self._specs, self._pool)

    @property
    def prepared_claims(self) -> int:
        """Claims recorded as prepared (or being prepared) on this node, for the metrics gauge."""
        return len(self._journal.state.claims)

    async def prepare(self, claims: Sequence[ClaimRef]) -> dict[str, PrepareOutcome]:
        report = self._observer.prepare_done if self._observer else None
        outcomes = await asyncio.gather(*(self._run(ref, "prepare", self._prepare, report) for ref in claims))
        return {ref.uid: outcome for ref, outcome in zip(claims, outcomes, strict=True)}

    async def unprepare(self, claims: Sequence[ClaimRef]) -> dict[str, ClaimError | None]:
        report = self._observer.unprepare_done if self._observer else None
        outcomes = await asyncio.gather(
            *(self._run(ref, "unprepare", self._unprepare, report) for ref in claims)
        )
        return {ref.uid: outcome for ref, outcome in zip(claims, outcomes, strict=True)}

    async def _run(
        self,
        ref: ClaimRef,
        operation: str,
        step: Callable[[ClaimRef], Awaitable[_T]],
        report: Callable[[float, bool], None] | None,
    ) -> _T | ClaimError:
        """Run one claim's operation to completion with the claim in every log line; never raises."""
        started = time.monotonic()
        with structlog.contextvars.bound_contextvars(
            claim_namespace=ref.namespace, claim_name=ref.name, claim_uid=ref.uid
        ):
            try:
                # Shielded: a cancelled RPC must not stop a claim half-way between its steps.
                outcome: _T | ClaimError = await asyncio.shield(step(ref))
            except _CLAIM_ERRORS as error:
                log.warning(f"{operation} failed", error=str(error))
                outcome = ClaimError(str(error))
            except Exception as error:
                log.exception(f"{operation} failed unexpectedly")
                outcome = ClaimError(f"internal error in the DRA driver: {error!r}; see the plugin's log")
            if report is not None:
                report(time.monotonic() - started, not isinstance(outcome, ClaimError))
            return outcome

    async def _prepare(self, ref: ClaimRef) -> tuple[PreparedDevice, ...]:
        check_ref(ref)
        async with self._locks.hold(ref.uid):
            existing = self._journal.state.claims.get(ref.uid)
            if existing is not None and existing.phase == "PrepareCompleted":
                if (existing.namespace, existing.name) != (ref.namespace, ref.name):
                    raise ClaimRejected(
                        f"uid {ref.uid} is prepared for claim {existing.namespace}/{existing.name}, "
                        f"not {ref.namespace}/{ref.name}"
                    )
                if await asyncio.to_thread(self._specs.path_for(ref.uid).exists):
                    log.info("claim already prepared")
                    return _prepared_devices(existing)
                log.warning("CDI spec of a prepared claim is missing; preparing it again")
            claim_json = await self._claims.get(ref.namespace, ref.name)
            if claim_json is None:
                raise ClaimRejected(
                    f"claim {ref.namespace}/{ref.name} not found: it was deleted; "
                    "the pod cannot start until the claim exists again"
                )
            claim = allocated_claim(ref, claim_json, self._driver, self._pool)
            plan = plan_claim(claim, self._inventory(), self._driver, self._common)
            record = ClaimRecord(
                namespace=ref.namespace,
                name=ref.name,
                phase="PrepareStarted",
                attempt=secrets.token_hex(8),
                devices=_device_records(plan),
            )
            await self._journal.commit(
                Reserve(ref.uid, record, replaces=existing.attempt if existing else None)
            )
            if existing is not None:
                log.info("replaced an earlier record of the claim", phase=existing.phase)
            completed = await self._complete(ref.uid, plan, record)
            log.info("claim prepared", devices=[d.device for d in completed.devices])
            return _prepared_devices(completed)

    async def _complete(self, uid: str, plan: ClaimPlan, reserved: ClaimRecord) -> ClaimRecord:
        """The side effects after the reservation; undone (spec and record) when one fails."""
        completed = reserved.model_copy(update={"phase": "PrepareCompleted"})
        try:
            await asyncio.to_thread(self._specs.write, uid, plan.cdi_spec)
            await self._journal.commit(Complete(uid, completed))
        except MutationRejected:
            raise  # the record is gone or another attempt's: its spec is not ours to remove
        except BaseException:
            await self._undo(uid, reserved.attempt)
            raise
        return completed

    async def _undo(self, uid: str, attempt: str) -> None:
        try:
            await asyncio.to_thread(self._specs.remove, uid)
            await self._journal.commit(Release(uid, attempt))
        except Exception as error:
            log.error("could not undo a failed prepare; the next prepare or unprepare will", error=str(error))

    async def _unprepare(self, ref: ClaimRef) -> None:
        check_ref(ref)
        async with self._locks.hold(ref.uid):
            # The spec goes first: as long as it exists, so does the record (see recovery).
            await asyncio.to_thread(self._specs.remove, ref.uid)
            # Committed even when this instance has no record: the other instance may have one.
            await self._journal.commit(Release(ref.uid))
            log.info("claim unprepared")


def _device_records(plan: ClaimPlan) -> tuple[DeviceRecord, ...]:
    return tuple(
        DeviceRecord(
            request=device.result.request,
            pool=device.result.pool,
            device=device.result.device,
            admin_access=device.result.admin_access,
            share_id=device.result.share_id,
            cdi_device_ids=(device.cdi_device_id,),
            config=config_json(device.config),
        )
        for device in plan.devices
    )


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
