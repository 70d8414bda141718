"""The rules for changing the prepared state: pure functions on a :class:`Checkpoint`.

Every change is a mutation applied by the journal's single writer, in order, to the
freshest state on disk, so the rules here are the one place that decides conflicts:

* a device is given to one claim at a time. A second claim for a device that is
  already prepared is refused, unless either allocation has admin access: an
  admin-access allocation (a monitoring or maintenance pod) never counts against a
  device. Allocations with a share id (``allowMultipleAllocations`` devices) hold
  only their share, so the key is (pool, device, share id).
* shares of a device and an exclusive allocation of it exclude each other: a device
  is not prepared exclusively (no share id) while another claim holds a share of it,
  nor a share while another claim holds it exclusively, nor a MIG device created on a
  GPU another claim holds a share of. (The scheduler's arithmetic forbids this while
  consumable capacity stays on; the rule catches allocations from before it was
  switched off or on.)
* a full GPU and the MIG devices the driver creates on it exclude each other: a
  full GPU is not given to a claim while another claim holds a MIG placement of it,
  nor the other way round. (The scheduler's counters forbid this too; the rule
  catches an allocation made from a stale ResourceSlice.) Whether placements
  overlap is the hardware's to refuse, when the MIG device is created.
* a claim's record is replaced only by the attempt that saw it (``replaces``), so a
  leftover of a crashed attempt can be taken over, while two live attempts cannot
  both win.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from dra_driver.node.checkpoint import Checkpoint, ClaimRecord, DeviceRecord

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
class Progress:
    """Replace an attempt's record with what it has done so far (e.g. a created MIG device's uuid)."""

    uid: str
    record: ClaimRecord


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


Mutation = Reserve | Progress | Complete | Release


def describe(uid: str, record: ClaimRecord) -> str:
    if record.namespace:
        return f"{record.namespace}/{record.name} ({uid})"
    return f"{uid} (recovered from its CDI spec)"


def apply(
    checkpoint: Checkpoint, mutations: Sequence[Mutation]
) -> tuple[Checkpoint, list[MutationRejected | None]]:
    """Apply ``mutations`` in order; a rejected one changes nothing and gets its reason."""
    claims = dict(checkpoint.claims)
    holders = _index.take(checkpoint) or _Holders(claims)
    outcomes: list[MutationRejected | None] = []
    changed = False
    for mutation in mutations:
        try:
            changed = _apply_one(claims, holders, mutation) or changed
        except MutationRejected as rejected:
            outcomes.append(rejected)
        else:
            outcomes.append(None)
    if not changed:
        _index.keep(checkpoint, holders)
        return checkpoint, outcomes
    result = checkpoint.model_copy(update={"claims": claims, "generation": checkpoint.generation + 1})
    _index.keep(result, holders)
    return result, outcomes


def _apply_one(claims: dict[str, ClaimRecord], holders: _Holders, mutation: Mutation) -> bool:
    """Apply one mutation; whether it changed anything."""
    existing = claims.get(mutation.uid)
    match mutation:
        case Reserve(uid=uid, record=record, replaces=replaces):
            if existing is not None and existing.attempt != replaces:
                raise MutationRejected(
                    f"claim {describe(uid, existing)} is being prepared concurrently "
                    f"(by another plugin instance?); the kubelet will retry"
                )
            holders.check(uid, record, claims)
            _replace(claims, holders, uid, record)
            return True
        case Progress(uid=uid, record=record) | Complete(uid=uid, record=record):
            if existing is None or existing.attempt != record.attempt:
                raise MutationRejected(
                    f"claim {uid} was unprepared or taken over while it was being prepared; "
                    "the kubelet will retry"
                )
            _replace(claims, holders, uid, record)
            return True
        case Release(uid=uid, attempt=attempt):
            if existing is not None and attempt in (None, existing.attempt):
                _replace(claims, holders, uid, None)
                return True
    return False


def _replace(claims: dict[str, ClaimRecord], holders: _Holders, uid: str, record: ClaimRecord | None) -> None:
    old = claims.pop(uid, None)
    if old is not None:
        holders.remove(uid, old)
    if record is not None:
        claims[uid] = record
        holders.add(uid, record)


_GpuKey = tuple[str, str]  # pool, full GPU device name


class _Holders:
    """Which claim holds each device, and which claims hold MIG placements of each full GPU."""

    def __init__(self, claims: Mapping[str, ClaimRecord]) -> None:
        self._devices: dict[_DeviceKey, str] = {}
        self._partitioned: dict[_GpuKey, set[str]] = {}
        self._shared: dict[_GpuKey, set[str]] = {}  # claims holding a share of each device
        for uid, record in claims.items():
            self.add(uid, record)

    def check(self, uid: str, record: ClaimRecord, claims: Mapping[str, ClaimRecord]) -> None:
        """Raise MutationRejected when another claim holds what ``record`` would take."""

        def holder_of(key: _DeviceKey) -> str | None:
            holder = self._devices.get(key)
            return describe(holder, claims[holder]) if holder not in (None, uid) else None

        for device in _exclusive(record):
            if holder := holder_of(_key(device)):
                raise MutationRejected(
                    f"device {device.device} is already prepared for claim {holder}; a device serves "
                    "one claim at a time unless an allocation has admin access. "
                    "The scheduler allocated it from a stale ResourceSlice: the kubelet retries, and "
                    "the claim needs a new allocation if the other claim keeps the device"
                )
            self._check_sharing(uid, device, claims, holder_of)
            partitioning = sorted(self._partitioned.get((device.pool, device.device), set()) - {uid})
            if partitioning:
                raise MutationRejected(
                    f"GPU {device.device} cannot be prepared whole: claim "
                    f"{describe(partitioning[0], claims[partitioning[0]])} holds a MIG device on it. The "
                    "scheduler allocated it from a stale ResourceSlice: the kubelet retries, and the GPU "
                    "is free once that claim is unprepared"
                )
            if device.mig is not None and (
                holder := holder_of((device.pool, device.mig.parent_device, None))
            ):
                raise MutationRejected(
                    f"MIG device {device.device} cannot be created: its GPU {device.mig.parent_device} is "
                    f"prepared whole for claim {holder}. The scheduler allocated it from a stale "
                    "ResourceSlice: the kubelet retries, and the placement is free once that claim is "
                    "unprepared"
                )

    def _check_sharing(
        self,
        uid: str,
        device: DeviceRecord,
        claims: Mapping[str, ClaimRecord],
        holder_of: Callable[[_DeviceKey], str | None],
    ) -> None:
        """Refuse to mix shares of a device with an exclusive allocation of it (see the module doc)."""
        stale = (
            "The scheduler allocated it from a stale ResourceSlice (was --consumable-capacity switched?): "
            "the kubelet retries, and the device is free once that claim is unprepared"
        )
        gpu = (device.pool, device.mig.parent_device if device.mig is not None else device.device)
        sharing = sorted(self._shared.get(gpu, set()) - {uid})
        if device.share_id is None and sharing:
            what = (
                f"MIG device {device.device} cannot be created"
                if device.mig is not None
                else f"device {device.device} cannot be prepared exclusively"
            )
            raise MutationRejected(
                f"{what}: claim {describe(sharing[0], claims[sharing[0]])} holds a share of "
                f"{gpu[1]} (consumable capacity). {stale}"
            )
        if device.share_id is not None and (holder := holder_of((device.pool, device.device, None))):
            raise MutationRejected(
                f"a share of device {device.device} cannot be prepared: it is prepared exclusively for claim "
                f"{holder}. {stale}"
            )

    def add(self, uid: str, record: ClaimRecord) -> None:
        for device in _exclusive(record):
            self._devices[_key(device)] = uid
            if device.mig is not None:
                self._partitioned.setdefault((device.pool, device.mig.parent_device), set()).add(uid)
            if device.share_id is not None:
                self._shared.setdefault((device.pool, device.device), set()).add(uid)

    def remove(self, uid: str, record: ClaimRecord) -> None:
        for device in _exclusive(record):
            if self._devices.get(_key(device)) == uid:
                del self._devices[_key(device)]
            if device.mig is not None:
                self._partitioned.get((device.pool, device.mig.parent_device), set()).discard(uid)
            if device.share_id is not None:
                self._shared.get((device.pool, device.device), set()).discard(uid)


class _HolderIndex:
    """The holders of the checkpoint :func:`apply` returned last, so the next apply need not rebuild them.

    Building them walks every claim, which made each commit cost more the more claims the node
    held. The journal applies its mutations to the very checkpoint the previous apply returned,
    so that one's holders are kept, keyed by the object's identity: any other checkpoint (one
    read from the file, the other instance's) gets its holders built afresh. :meth:`take` hands
    them out once, since the caller changes them in place, and :meth:`keep` stores them under
    the checkpoint they now describe; a lock makes the pair one step for callers in several threads.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._checkpoint: Checkpoint | None = None
        self._holders: _Holders | None = None

    def take(self, checkpoint: Checkpoint) -> _Holders | None:
        with self._lock:
            holders = self._holders if self._checkpoint is checkpoint else None
            self._checkpoint = self._holders = None
            return holders

    def keep(self, checkpoint: Checkpoint, holders: _Holders) -> None:
        with self._lock:
            self._checkpoint, self._holders = checkpoint, holders


_index = _HolderIndex()


def _exclusive(record: ClaimRecord) -> list[DeviceRecord]:
    """The devices a record holds: all but those allocated with admin access."""
    return [device for device in record.devices if not device.admin_access]


def _key(device: DeviceRecord) -> _DeviceKey:
    return (device.pool, device.device, device.share_id)
