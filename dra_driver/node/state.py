"""The rules for changing the prepared state: pure functions on a :class:`Checkpoint`.

Every change is a mutation applied by the journal's single writer, in order, to the
freshest state on disk, so the rules here are the one place that decides conflicts:

* a device is given to one claim at a time. A second claim for a device that is
  already prepared is refused, unless either allocation has admin access: an
  admin-access allocation (a monitoring or maintenance pod) never counts against a
  device. Allocations with a share id (``allowMultipleAllocations`` devices) hold
  only their share, so the key is (pool, device, share id).
* a claim's record is replaced only by the attempt that saw it (``replaces``), so a
  leftover of a crashed attempt can be taken over, while two live attempts cannot
  both win.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from dra_driver.node.checkpoint import Checkpoint, ClaimRecord

_DeviceKey = tuple[str, str, str | None]  # pool, device, share id


class MutationRejected(Exception):
    """The mutation contradicts the current state; the message is for the user."""


@dataclass(frozen=True)
class Reserve:
    """Record a claim as PrepareStarted, holding its devices."""

    uid: str
    record: ClaimRecord
    replaces: str | None = None  # attempt of the leftover record (PrepareStarted/Recovered) it takes over


@dataclass(frozen=True)
class Complete:
    """Mark an attempt's record PrepareCompleted, with what it created (e.g. MIG uuids)."""

    uid: str
    record: ClaimRecord


@dataclass(frozen=True)
class Release:
    """Forget a claim; only the given attempt's record when ``attempt`` is set."""

    uid: str
    attempt: str | None = None


Mutation = Reserve | Complete | Release


def describe(uid: str, record: ClaimRecord) -> str:
    if record.namespace:
        return f"{record.namespace}/{record.name} ({uid})"
    return f"{uid} (recovered from its CDI spec)"


def apply(
    checkpoint: Checkpoint, mutations: Sequence[Mutation]
) -> tuple[Checkpoint, list[MutationRejected | None]]:
    """Apply ``mutations`` in order; a rejected one changes nothing and gets its reason."""
    claims = dict(checkpoint.claims)
    holders = _holders(claims)
    outcomes: list[MutationRejected | None] = []
    for mutation in mutations:
        try:
            _apply_one(claims, holders, mutation)
        except MutationRejected as rejected:
            outcomes.append(rejected)
        else:
            outcomes.append(None)
    if claims == checkpoint.claims:
        return checkpoint, outcomes
    return checkpoint.model_copy(update={"claims": claims, "generation": checkpoint.generation + 1}), outcomes


def _apply_one(claims: dict[str, ClaimRecord], holders: dict[_DeviceKey, str], mutation: Mutation) -> None:
    existing = claims.get(mutation.uid)
    match mutation:
        case Reserve(uid=uid, record=record, replaces=replaces):
            if existing is not None and existing.attempt != replaces:
                raise MutationRejected(
                    f"claim {describe(uid, existing)} is being prepared concurrently "
                    f"(by another plugin instance?); the kubelet will retry"
                )
            for key in _exclusive_keys(record):
                holder = holders.get(key)
                if holder is not None and holder != uid:
                    raise MutationRejected(
                        f"device {key[1]} is already prepared for claim {describe(holder, claims[holder])}; "
                        "a device serves one claim at a time unless an allocation has admin access. "
                        "The scheduler allocated it from a stale ResourceSlice: the kubelet retries, and "
                        "the claim needs a new allocation if the other claim keeps the device"
                    )
            _replace(claims, holders, uid, record)
        case Complete(uid=uid, record=record):
            if existing is None or existing.attempt != record.attempt:
                raise MutationRejected(
                    f"claim {uid} was unprepared or taken over while it was being prepared; "
                    "the kubelet will retry"
                )
            _replace(claims, holders, uid, record)
        case Release(uid=uid, attempt=attempt):
            if existing is not None and attempt in (None, existing.attempt):
                _replace(claims, holders, uid, None)


def _replace(
    claims: dict[str, ClaimRecord], holders: dict[_DeviceKey, str], uid: str, record: ClaimRecord | None
) -> None:
    old = claims.pop(uid, None)
    if old is not None:
        for key in _exclusive_keys(old):
            if holders.get(key) == uid:
                del holders[key]
    if record is not None:
        claims[uid] = record
        holders.update(dict.fromkeys(_exclusive_keys(record), uid))


def _holders(claims: Mapping[str, ClaimRecord]) -> dict[_DeviceKey, str]:
    return {key: uid for uid, record in claims.items() for key in _exclusive_keys(record)}


def _exclusive_keys(record: ClaimRecord) -> Iterable[_DeviceKey]:
    return [(d.pool, d.device, d.share_id) for d in record.devices if not d.admin_access]
