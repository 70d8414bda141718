"""Binding conditions (KEP-5007): the node makes a claim's MIG devices, or starts the MPS daemon of its
GPU shares, before the scheduler binds its pod.

Without them, the scheduler binds a pod as soon as it allocated a MIG placement, and the MIG
device is created only when the kubelet prepares the claim: a creation that fails then (the
placement was taken meanwhile, the GPU is in use, the hardware refuses) leaves the pod stuck on
the node in ContainerCreating. With them, the placements the driver publishes say
``bindingConditions: [Ready]`` and ``bindingFailureConditions: [PrepareFailed]``
(:mod:`dra_driver.resources.devices`), and the scheduler, after it allocated one, waits in
PreBind until the claim's ``status.devices`` entry for it has one of the two::

    scheduler: allocate, reserve for the pod, wait (polls every 5 s, gives up after its
               bindingTimeout, 10 min by default)
    this node: sees the claim allocated from its pool with binding conditions (a watch of the
               claims), prepares it as the kubelet would -- creates the MIG device, writes the CDI
               spec, records it in the store marked "ahead of binding" -- and sets the devices'
               condition Ready=True, or PrepareFailed=True with the error as its message
    scheduler: Ready -> binds the pod; PrepareFailed or timeout -> takes the allocation back and
               schedules the pod again (the failure is in the pod's events)
    kubelet:   prepares the claim: the store has it done, the kubelet takes it over and its
               unprepare undoes it as usual

A claim prepared ahead whose pod never comes -- the binding failed or timed out after the device
was made, the claim was deleted or allocated anew -- is unprepared here: on the watch event, and
at every listing (which covers what happened while the plugin was down). The store's mark says
which claims are the watcher's to undo; once the kubelet asked for a claim, only the kubelet's
unprepare undoes it. A crash half-way is the store's usual recovery: the next prepare, ahead or the
kubelet's, takes the leftover record over.

The conditions are written by server-side apply under a field manager of their own
(``<driver>/binding``), so the entries' health and data, which :mod:`dra_driver.node.claim_status`
writes, are not touched, nor these by it. The write is the same one the plugin already makes, to
the devices of its own pool of a claim allocated to its node (RBAC ``associated-node:patch``, the
chart's admission policy). Which claims carry binding conditions is read from the claim alone, so
another kind of device uses this watcher by publishing its own binding conditions and preparing
through its own ``prepare_ahead``: a shareable GPU (consumable capacity, with
``--share-binding-conditions``), whose share's prepare starts the GPU's MPS control daemon and waits
until it serves clients; and a ComputeDomain's channel, a watcher of its own for the compute-domain
driver on the same watch of the claims, whose prepare labels the node for the domain and waits until
the domain's IMEX daemon there is Ready (:mod:`dra_driver.computedomain.node`).

On where the API server is 1.36 or newer (``--binding-conditions=auto``, the default). Kubernetes
refuses every status write of a claim whose opaque config was not sent as kubectl sends it
(docs/binding-conditions.md); the pod of such a claim waits out the scheduler's timeout, and the
warning says why (:func:`dra_driver.node.claim_status.refusal_reason`).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

import structlog

from dra_driver.node.claim_status import ClaimStatusApi, StatusWriteError, refusal_reason
from dra_driver.node.types import ClaimError, ClaimRef, PreparedDevice
from dra_driver.resources.devices import FAILED_CONDITION, READY_CONDITION

log = structlog.get_logger(__name__)

CLAIMS_PATH = "/apis/resource.k8s.io/v1/resourceclaims"
# The watch is listed again this often (and after any failure of it): a missed event is repaired
# within it. Every node lists every claim of the cluster then, so not often.
RESYNC_S = 300.0
_WRITE_ATTEMPTS = 6
_NOT_RETRIED = {404, 409, 422}  # the claim is gone or changed, or the content refused
_MESSAGE_MAX = 1024  # a condition's message may hold 32 KiB; the pod's event shows it whole


@dataclass(frozen=True)
class WaitingDevice:
    """An allocated device of ours that the scheduler waits on (its result has binding conditions)."""

    pool: str
    device: str
    share_id: str | None
    conditions: tuple[str, ...]  # bindingConditions
    failure_conditions: tuple[str, ...]  # bindingFailureConditions


def waiting_devices(claim: Mapping[str, Any], driver: str, pool: str) -> tuple[WaitingDevice, ...]:
    """The results of ``claim``'s allocation from ``driver``'s ``pool`` that carry binding conditions."""
    results = ((claim.get("status") or {}).get("allocation") or {}).get("devices", {}).get("results") or ()
    return tuple(
        WaitingDevice(
            pool=str(result["pool"]),
            device=str(result["device"]),
            share_id=result.get("shareID"),
            conditions=tuple(result.get("bindingConditions") or ()),
            failure_conditions=tuple(result.get("bindingFailureConditions") or ()),
        )
        for result in results
        if result.get("driver") == driver and result.get("pool") == pool and result.get("bindingConditions")
    )


def answered(claim: Mapping[str, Any], driver: str, devices: Sequence[WaitingDevice]) -> bool:
    """Whether every device already has its answer in the claim's status: Ready, or a failure."""
    entries = (claim.get("status") or {}).get("devices") or ()

    def true_conditions(device: WaitingDevice) -> set[str]:
        for entry in entries:
            if (entry.get("driver"), entry.get("pool"), entry.get("device"), entry.get("shareID")) == (
                driver,
                device.pool,
                device.device,
                device.share_id,
            ):
                return {c.get("type") for c in entry.get("conditions") or () if c.get("status") == "True"}
        return set()

    def done(device: WaitingDevice) -> bool:
        found = true_conditions(device)
        return set(device.conditions) <= found or bool(found & set(device.failure_conditions))

    return all(done(device) for device in devices)


def condition_entries(
    driver: str, devices: Sequence[WaitingDevice], outcome: object, now: datetime
) -> list[dict[str, Any]]:
    """The ``status.devices`` entries answering the scheduler: every binding condition True, or
    the first failure condition True with ``outcome`` (a :class:`ClaimError`) as its message."""
    since = now.strftime("%Y-%m-%dT%H:%M:%SZ")
    entries = []
    for device in devices:
        if isinstance(outcome, ClaimError):
            conditions = [
                {
                    "type": device.failure_conditions[0] if device.failure_conditions else FAILED_CONDITION,
                    "status": "True",
                    "reason": "PrepareFailed",
                    "message": outcome.message[:_MESSAGE_MAX],
                    "lastTransitionTime": since,
                }
            ]
        else:
            conditions = [
                {
                    "type": condition,
                    "status": "True",
                    "reason": "Prepared",
                    "message": "the device is prepared on the node"
                    if condition == READY_CONDITION
                    else "prepared",
                    "lastTransitionTime": since,
                }
                for condition in device.conditions
            ]
        entry: dict[str, Any] = {"driver": driver, "pool": device.pool, "device": device.device}
        if device.share_id is not None:
            entry["shareID"] = device.share_id
        entry["conditions"] = conditions
        entries.append(entry)
    return entries


class AheadRecord(Protocol):
    """What the watcher reads of a claim's record prepared ahead of binding."""

    @property
    def namespace(self) -> str: ...

    @property
    def name(self) -> str: ...

    @property
    def device_names(self) -> frozenset[str]: ...


class AheadPreparer(Protocol):
    """What the watcher needs of a driver's preparer: :class:`dra_driver.node.preparer.NodePreparer`,
    or the compute-domain driver's :class:`dra_driver.computedomain.node.ComputeDomainPreparer`."""

    async def prepare_ahead(self, ref: ClaimRef) -> tuple[PreparedDevice, ...] | ClaimError: ...

    def ahead_of_binding(self) -> Mapping[str, AheadRecord]: ...

    def prepared_ahead(self, uid: str) -> AheadRecord | None: ...

    async def unprepare(self, claims: Sequence[ClaimRef]) -> dict[str, ClaimError | None]: ...


class BindingWatcher:
    """Follows the claims allocated from this node's pool and answers their binding conditions.

    Feed it the claims' watch (:meth:`on_event`, :meth:`on_listed` of
    :func:`dra_driver.apiserver.informer.list_and_watch`); each claim's work runs in a task of its own, one
    at a time per claim, so a slow MIG creation holds up neither the watch nor other claims.
    """

    def __init__(
        self,
        preparer: AheadPreparer,
        status: ClaimStatusApi,
        *,
        driver_name: str,
        pool: str,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        retry_initial: float = 0.5,
    ) -> None:
        self._preparer = preparer
        self._status = status
        self._driver = driver_name
        self._pool = pool
        self._clock = clock
        self._retry_initial = retry_initial
        self._field_manager = f"{driver_name}/binding"
        self._busy: dict[str, asyncio.Task[None]] = {}  # claim uid -> its work in progress
        self._again: dict[str, Mapping[str, Any] | None] = {}  # newer state seen while it worked

    async def on_event(self, kind: str, claim: Mapping[str, Any]) -> None:
        """A claim was listed, added, changed or deleted (``kind`` as the watch says it)."""
        uid = str((claim.get("metadata") or {}).get("uid") or "")
        if not uid:
            return
        # Most claims of the cluster are other nodes' (every node watches them all): nothing to do
        # for a claim not allocated from this pool and not prepared ahead here, which settling
        # would find too, at the cost of a task per event. A claim whose work runs takes every
        # event: the work may be preparing it ahead right now.
        idle = uid not in self._busy
        if idle and not self._allocated(claim) and self._preparer.prepared_ahead(uid) is None:
            return
        self._submit(uid, None if kind == "DELETED" else claim)

    def on_listed(self, claims: list[dict[str, Any]]) -> None:
        """A full listing: claims prepared ahead that are gone from it are undone."""
        listed = {str((c.get("metadata") or {}).get("uid")) for c in claims}
        for uid in self._preparer.ahead_of_binding():
            if uid not in listed:
                self._submit(uid, None)

    async def idle(self) -> None:
        """Return once no claim's work runs, work queued meanwhile included."""
        while self._busy:
            await asyncio.gather(*self._busy.values(), return_exceptions=True)

    async def stop(self) -> None:
        """Cancel the claims' work (the preparer shields what must not stop half-way)."""
        for task in list(self._busy.values()):
            task.cancel()
        await asyncio.gather(*self._busy.values(), return_exceptions=True)

    def _submit(self, uid: str, claim: Mapping[str, Any] | None) -> None:
        """Work on ``uid`` with its latest state; ``None``: the claim is gone."""
        if uid in self._busy:
            self._again[uid] = claim  # taken up when the running work ends
            return
        task = asyncio.create_task(self._work(uid, claim), name=f"binding conditions of claim {uid}")
        self._busy[uid] = task
        task.add_done_callback(lambda _: self._done(uid))

    def _done(self, uid: str) -> None:
        del self._busy[uid]
        if uid in self._again:
            self._submit(uid, self._again.pop(uid))

    async def _work(self, uid: str, claim: Mapping[str, Any] | None) -> None:
        try:
            await self._settle(uid, claim)
        except asyncio.CancelledError:
            raise
        except Exception:  # one claim's trouble must not end the watch of every other claim
            log.exception("binding conditions of a claim not handled", claim_uid=uid)

    async def _settle(self, uid: str, claim: Mapping[str, Any] | None) -> None:
        devices = waiting_devices(claim, self._driver, self._pool) if claim is not None else ()
        ahead = self._preparer.prepared_ahead(uid)
        if ahead is not None and ahead.device_names != self._allocated(claim):
            # The pod will not come for what was made: the claim is gone, or its allocation was
            # taken back (a failed or timed-out binding) or is another one now.
            await self._undo(ClaimRef(ahead.namespace, ahead.name, uid))
        if claim is None or not devices or answered(claim, self._driver, devices):
            return
        metadata = claim["metadata"]
        ref = ClaimRef(str(metadata["namespace"]), str(metadata["name"]), uid)
        with structlog.contextvars.bound_contextvars(
            claim_namespace=ref.namespace, claim_name=ref.name, claim_uid=uid
        ):
            log.info("preparing ahead of the pod's binding", devices=[d.device for d in devices])
            outcome = await self._preparer.prepare_ahead(ref)
            await self._answer(ref, devices, outcome)

    def _allocated(self, claim: Mapping[str, Any] | None) -> set[str]:
        """The devices of ours the claim is allocated now, waited on or not (a claim prepared ahead
        may hold a full GPU beside its MIG device)."""
        if claim is None:
            return set()
        results = ((claim.get("status") or {}).get("allocation") or {}).get("devices", {}).get("results")
        return {
            str(r["device"])
            for r in results or ()
            if r.get("driver") == self._driver and r.get("pool") == self._pool
        }

    async def _undo(self, ref: ClaimRef) -> None:
        outcome = (await self._preparer.unprepare([ref]))[ref.uid]
        if outcome is None:
            log.info("claim prepared ahead of a binding that did not happen: unprepared", claim_uid=ref.uid)
        else:  # a MIG device still in use: the next listing tries again
            log.warning(
                "claim prepared ahead of binding not unprepared", claim_uid=ref.uid, error=outcome.message
            )

    async def _answer(self, ref: ClaimRef, devices: Sequence[WaitingDevice], outcome: object) -> None:
        entries = condition_entries(self._driver, devices, outcome, self._clock())
        for attempt in range(1, _WRITE_ATTEMPTS + 1):
            try:
                await self._status.apply_status(ref, entries, self._field_manager)
            except StatusWriteError as error:
                if error.status in _NOT_RETRIED or attempt == _WRITE_ATTEMPTS:
                    reason = refusal_reason(error)  # the pod waits out the scheduler's bindingTimeout
                    log.warning(
                        "binding conditions not written",
                        error=str(error),
                        attempts=attempt,
                        **({"reason": reason} if reason else {}),
                    )
                    return
                delay = self._retry_initial * 2 ** (attempt - 1)
                await asyncio.sleep(random.uniform(delay / 2, delay))  # a backoff, not a synchronisation
                continue
            ready = not isinstance(outcome, ClaimError)
            log.info(
                "binding conditions written"
                if ready
                else "binding failure written: the pod is scheduled again",
                condition=READY_CONDITION if ready else FAILED_CONDITION,
            )
            return
