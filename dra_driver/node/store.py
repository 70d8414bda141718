"""The node's state: one transactional store (sqlite3) for everything the node remembers.

``state.db`` in the plugin's data directory holds the prepared claims, what their devices
occupy, the MIG devices the driver created, what the claims' sharing set (each GPU's compute
mode and time slice to restore, each claim's MPS daemon: rows written with the claim's record,
so the sharing checks, a restore and ``dra-driver state`` read them in one query instead of
every record), and the GPU instances a failed MIG rollback left. Python's own ``sqlite3``, in
WAL mode with ``synchronous=NORMAL``: a commit appends to the write-ahead log without an
fsync, which a killed process cannot lose; an operating-system crash is a reboot, after which the boot id
(below) sends every record to clean-up anyway, since nothing prepared survives a reboot.

**The exclusivity rules are the schema.** Each record's devices become rows of ``holds``,
one per unit of hardware they occupy, under a unique index over (pool, GPU, unit), so the
database itself refuses a second holder, whichever plugin instance writes:

* an exclusive full GPU occupies all of its memory slices (``slice:0`` .. ``slice:7``: no
  GPU has more than 8), a MIG device the slices of its placement (the driver's own, whose
  placement is recorded) or its first slice (an administrator's: placements of existing
  devices never overlap, the hardware saw to that), so a full GPU and a MIG device on it
  exclude each other;
* a share of a GPU (consumable capacity, a share id) occupies ``share:<id>`` and its consumed
  memory; shares of a GPU and an exclusive hold of it exclude each other, and the shares of
  a GPU together fit its memory, which a unique index cannot say, so the same writing
  transaction checks both with one indexed query (the sum of the rows, never a cache);
* a passthrough device (``gpu-vfio-<index>``, the GPU on vfio-pci for a virtual machine)
  occupies all of its GPU's slices, as the full GPU does: the GPU cannot be passed through
  while a full-GPU, MIG or share claim holds it, nor be prepared any other way while passed
  through;
* an admin-access allocation occupies nothing: a monitoring pod never counts against a device.

**One step is one transaction**, ``BEGIN IMMEDIATE``, short and never across an API or an
NVML call. The two instances of a rolling update coordinate through the database's own lock:
a writer that finds the other one writing waits for it (the busy timeout) and then sees its
rows. A claim's record is replaced only by the attempt that saw it (``replaces``), so the
leftover of a crashed attempt can be taken over, while two live attempts cannot both win.
Reads are single statements, consistent by themselves; nothing is cached between them.

The commits run on the event loop: one is a few small inserts into pages already in memory,
which takes less time than a hop to a worker thread. The connection stays open and its
statements are prepared once (``sqlite3`` caches them by their text).

**What cannot be trusted is moved aside**, never deleted and never fatal: a file that is not
a database or fails ``quick_check`` goes to ``state.db.corrupt-<time>`` and the claims are
rebuilt from their CDI specs (:mod:`dra_driver.node.recovery`). A store written by a newer
schema is refused at start: rolling back an upgrade must not drop the newer driver's records.
Schema 2 was the ``checkpoint.json`` of earlier versions; its files are imported once
(:mod:`dra_driver.node.legacy`). Schema 3 lacked a share's memory and the sharing and orphan
tables; they are added in place, the sharing rows filled from the records. Schema 4 lacked the
compute-domain driver's table; it is added in place, and that driver imports the per-claim files
it kept before (:mod:`dra_driver.computedomain.node`).

**The compute-domain driver's claims** (``domain_claims``) are rows of the same store: each
channel or daemon claim, the device it holds (``channel-0``, ``daemon-0``), the ComputeDomain it
serves and, for a channel, its allocation mode. A unique index over the device is the rule, as
for the GPUs' units: NVIDIA's driver counts every channel claim as one of channel 0, whether its
allocationMode is ``Single`` (channel 0 in the container) or ``All`` (every channel of the node),
and refuses a second one while the first is prepared; the node publishes one channel and one
daemon device. So one claim holds each, an admin-access allocation too: the node's label and the
daemon's files that a claim brings are that claim's, and a second claim would take them away.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import sqlite3
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import structlog

from dra_driver import crashpoint
from dra_driver.node.records import (
    ClaimRecord,
    DeviceRecord,
    GpuPolicyRecord,
    MigRecord,
    MutationRejected,
    NodeState,
    Phase,
    SharingRecord,
    SharingState,
    StoreFromNewerDriver,
    StoreWriteError,
    describe,
    named,
)
from dra_driver.resources.device_names import PASSTHROUGH_PREFIX

log = structlog.get_logger(__name__)

STORE_FILE = "state.db"
SCHEMA_VERSION = 5  # 1, 2: checkpoint.json (legacy.py); 3: no sharing and orphan tables; 4: no domain_claims
GPU_SLICES = 8  # memory slices of the largest MIG-capable GPU: what a full GPU occupies
BUSY_TIMEOUT_S = 10.0  # the longest wait for the other instance's transaction; they take microseconds

_SINCE_4 = """
CREATE TABLE gpu_settings (  -- what a claim's sharing set on a full GPU, and what its last claim puts back
    gpu_uuid TEXT NOT NULL, uid TEXT NOT NULL, compute_mode TEXT NOT NULL, time_slice TEXT NOT NULL,
    previous_compute_mode TEXT NOT NULL, previous_time_slice TEXT NOT NULL, PRIMARY KEY (gpu_uuid, uid)
) STRICT, WITHOUT ROWID;
CREATE TABLE mps_daemons (
    daemon TEXT NOT NULL, uid TEXT NOT NULL, PRIMARY KEY (daemon, uid)
) STRICT, WITHOUT ROWID;
CREATE TABLE orphaned_gpu_instances (  -- left by a failed rollback (dra_driver.devices.nvml)
    gpu_uuid TEXT NOT NULL, profile_id INTEGER NOT NULL, start INTEGER NOT NULL, size INTEGER NOT NULL,
    PRIMARY KEY (gpu_uuid, profile_id, start, size)
) STRICT, WITHOUT ROWID;
"""

_SINCE_5 = """
CREATE TABLE domain_claims (  -- the compute-domain driver's claims (dra_driver.computedomain.node)
    uid TEXT PRIMARY KEY, namespace TEXT NOT NULL, name TEXT NOT NULL,
    kind TEXT NOT NULL CHECK (kind IN ('channel', 'daemon')), device TEXT NOT NULL,
    domain_uid TEXT NOT NULL,  -- '' for a channel rebuilt from its CDI spec, which does not name it
    allocation_mode TEXT,  -- a channel's: Single or All
    phase TEXT NOT NULL, attempt TEXT NOT NULL
) STRICT, WITHOUT ROWID;
CREATE UNIQUE INDEX domain_device_holder ON domain_claims (device);  -- one claim per device
"""

_SCHEMA = (
    """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL) STRICT;
CREATE TABLE claims (
    uid TEXT PRIMARY KEY, namespace TEXT NOT NULL, name TEXT NOT NULL, phase TEXT NOT NULL,
    attempt TEXT NOT NULL, record TEXT NOT NULL
) STRICT, WITHOUT ROWID;
CREATE TABLE holds (
    pool TEXT NOT NULL, gpu TEXT NOT NULL, unit TEXT NOT NULL, uid TEXT NOT NULL, device TEXT NOT NULL,
    shared INTEGER NOT NULL, mig_uuid TEXT,
    memory INTEGER,  -- a share's consumed memory (bytes)
    PRIMARY KEY (pool, gpu, unit)  -- one holder per unit of hardware: the exclusivity rule
) STRICT, WITHOUT ROWID;
CREATE INDEX holds_of_mig ON holds (mig_uuid) WHERE mig_uuid IS NOT NULL;
CREATE TABLE mig_devices (uuid TEXT PRIMARY KEY, record TEXT NOT NULL) STRICT, WITHOUT ROWID;
"""
    + _SINCE_4
    + _SINCE_5
)


Orphan = tuple[str, int, int, int]  # an orphaned GPU instance: GPU uuid, profile id, placement start, size

_MIG_NAME = re.compile(r"(gpu-\d+)-mig-.+-(\d+)")
_GPU_NAME = re.compile(r"(gpu-\d+)(?:-maintenance)?")


@dataclass(frozen=True)
class Reserve:
    """Record a claim, holding its devices (PrepareStarted, or PrepareCompleted in one step)."""

    uid: str
    record: ClaimRecord
    replaces: str | None = None  # attempt of the leftover record (PrepareStarted/Recovered) it takes over


@dataclass(frozen=True)
class Progress:
    """Replace an attempt's record with what it has done so far (a MIG uuid, PrepareCompleted)."""

    uid: str
    record: ClaimRecord


Complete = Progress


@dataclass(frozen=True)
class Release:
    """Forget a claim; only the given attempt's record when ``attempt`` is set."""

    uid: str
    attempt: str | None = None


Mutation = Reserve | Progress | Release


@dataclass(frozen=True)
class Opened:
    """What :func:`open_store` found."""

    store: Store
    stale: tuple[str, ...] = ()  # claims of an earlier boot, dropped: remove their CDI specs
    earlier_boot: bool = False
    moved_aside: Path | None = None  # an untrustworthy store went there: rebuild from the specs


DomainPhase = Phase | Literal["PreparingAhead", "PreparedAhead"]
"""A compute-domain claim's phase: the GPUs' (:data:`~dra_driver.node.records.Phase`), and two of a
channel prepared ahead of its pod's binding (binding conditions, :mod:`dra_driver.node.binding`):
PreparingAhead, the node labelled and its IMEX daemon awaited; PreparedAhead, ready and its CDI spec
written, not yet asked for by the kubelet, whose prepare takes it over (PrepareCompleted). The
column is plain text, so an older version reading these rows prepares such a claim again."""


@dataclass(frozen=True)
class DomainClaim:
    """A claim of the compute-domain driver: the device it holds and the ComputeDomain it serves."""

    uid: str
    namespace: str  # '' (and name) for a claim rebuilt from its CDI spec, until the kubelet's repeat
    name: str
    kind: str  # "channel" or "daemon"
    device: str
    domain_uid: str
    allocation_mode: str | None = None
    phase: DomainPhase = "PrepareStarted"
    attempt: str = ""

    @property
    def device_names(self) -> frozenset[str]:
        """The devices the claim holds (what the binding watcher compares with its allocation)."""
        return frozenset((self.device,))


DOMAIN_BOOT_KEY = "compute_domains_boot_id"  # the boot the compute-domain driver last started in


def units(device: DeviceRecord) -> list[tuple[str, str]]:
    """(GPU, unit) rows that ``device`` occupies (see the module doc); none for admin access.

    Part of the schema: a claim's rows are found again (and deleted) by the units its record
    gives, so a change here needs a new ``SCHEMA_VERSION``.
    """
    if device.admin_access:
        return []
    if device.share_id is not None:
        return [(device.device, f"share:{device.share_id}")]
    if device.passthrough is not None:
        return [(device.passthrough.parent_device, f"slice:{i}") for i in range(GPU_SLICES)]
    if device.mig is not None:
        start, size = device.mig.placement_start, device.mig.placement_size
        return [(device.mig.parent_device, f"slice:{i}") for i in range(start, start + size)]
    if match := _MIG_NAME.fullmatch(device.device):
        return [(match[1], f"slice:{match[2]}")]
    if match := _GPU_NAME.fullmatch(device.device):
        return [(match[1], f"slice:{i}") for i in range(GPU_SLICES)]
    return [(device.device, "whole")]  # a device of another kind (a channel): exclusive by its name


class Store:
    """One connection to the node's store; every method is one transaction or one statement."""

    def __init__(self, path: Path, db: sqlite3.Connection) -> None:
        self.path = path
        self._db = db
        self._commits = 0  # since the last checkpoint of the write-ahead log was started
        self._checkpointing: asyncio.Future[None] | None = None

    def close(self) -> None:
        self._db.close()

    def _checkpoint_soon(self) -> None:
        """Copy the write-ahead log into the file now and then, in a worker thread.

        sqlite would do it inside a commit (every 1,000 pages), with two fsyncs, on the event
        loop; so the serving connection leaves it to a backstop of 10,000 pages, and a connection
        of the worker thread's own runs a PASSIVE checkpoint, which never blocks a writer, every
        ``_CHECKPOINT_EVERY`` commits made on an event loop.
        """
        self._commits += 1
        if self._commits < _CHECKPOINT_EVERY or (self._checkpointing and not self._checkpointing.done()):
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._commits = 0
        self._checkpointing = loop.run_in_executor(None, _checkpoint, self.path)

    # --- reads -------------------------------------------------------------------------------

    def claim(self, uid: str) -> ClaimRecord | None:
        row = self._db.execute("SELECT record FROM claims WHERE uid = ?", (uid,)).fetchone()
        return ClaimRecord.model_validate_json(row[0]) if row else None

    def snapshot(self) -> NodeState:
        rows = self._db.execute("SELECT uid, record FROM claims ORDER BY uid").fetchall()
        (boot_id,) = self._db.execute("SELECT value FROM meta WHERE key = 'boot_id'").fetchone()
        claims = {uid: ClaimRecord.model_validate_json(record) for uid, record in rows}
        return NodeState(claims, boot_id, self.sharing())

    def sharing(self) -> SharingState:
        """What the claims' sharing set on the node, from its two tables in one query."""
        rows = self._db.execute(
            "SELECT g.uid, c.namespace, c.name, g.gpu_uuid, g.compute_mode, g.time_slice, "
            "g.previous_compute_mode, g.previous_time_slice FROM gpu_settings g JOIN claims c USING (uid) "
            "UNION ALL SELECT uid, '', '', daemon, NULL, NULL, NULL, NULL FROM mps_daemons ORDER BY 1"
        ).fetchall()
        state = SharingState()
        for uid, namespace, name, key, mode, time_slice, previous_mode, previous_time_slice in rows:
            if mode is None:
                state.daemons.setdefault(key, set()).add(uid)
                continue
            setting = GpuPolicyRecord(
                gpu_uuid=key,
                compute_mode=mode,
                time_slice=time_slice,
                previous_compute_mode=previous_mode,
                previous_time_slice=previous_time_slice,
            )
            state.gpus.setdefault(key, {})[uid] = (named(uid, namespace, name), setting)
        return state

    def orphans(self) -> list[Orphan]:
        """GPU instances a failed rollback left: (GPU uuid, profile id, placement start, size)."""
        return self._db.execute("SELECT * FROM orphaned_gpu_instances ORDER BY 1, 3").fetchall()

    def update_orphans(self, added: Iterable[Orphan], gone: Iterable[Orphan]) -> None:
        """Record GPU instances a failed rollback left, and forget those destroyed, in one transaction.

        Changes, not a replacement: the other instance of a rolling update keeps its rows.
        """
        with self._write() as db:
            db.executemany(
                "DELETE FROM orphaned_gpu_instances WHERE gpu_uuid = ? AND profile_id = ? "
                "AND start = ? AND size = ?",
                gone,
            )
            db.executemany("INSERT OR IGNORE INTO orphaned_gpu_instances VALUES (?, ?, ?, ?)", added)

    def count(self) -> int:
        return int(self._db.execute("SELECT count(*) FROM claims").fetchone()[0])

    def mig_holders(self) -> dict[str, str]:
        """MIG uuid -> uid of the claim the driver created it for."""
        rows = self._db.execute("SELECT DISTINCT mig_uuid, uid FROM holds WHERE mig_uuid IS NOT NULL")
        return dict(rows.fetchall())

    def mig_devices(self) -> dict[str, MigRecord]:
        """The MIG devices the driver created and has not destroyed, by uuid."""
        rows = self._db.execute("SELECT uuid, record FROM mig_devices ORDER BY uuid").fetchall()
        return {uuid: MigRecord.model_validate_json(record) for uuid, record in rows}

    # --- writes ------------------------------------------------------------------------------

    def commit(self, mutation: Mutation) -> None:
        """Apply one change in one transaction; :class:`MutationRejected` says why it cannot be."""
        with self._write() as db:
            existing = self._claim_in(db, mutation.uid)
            match mutation:
                case Reserve(uid=uid, record=record, replaces=replaces):
                    if existing is not None and existing.attempt != replaces:
                        raise MutationRejected(
                            f"claim {describe(uid, existing)} is being prepared concurrently "
                            "(by another plugin instance?); the kubelet will retry"
                        )
                    _put(db, uid, record, existing)
                case Progress(uid=uid, record=record):
                    if existing is None or existing.attempt != record.attempt:
                        raise MutationRejected(
                            f"claim {uid} was unprepared or taken over while it was being prepared; "
                            "the kubelet will retry"
                        )
                    _put(db, uid, record, existing)
                case Release(uid=uid, attempt=attempt):
                    if existing is not None and attempt in (None, existing.attempt):
                        _delete(db, uid, existing)

    def add_mig_device(self, mig: MigRecord) -> None:
        """Remember a MIG device the driver just created (``mig.uuid`` set)."""
        with self._write() as db:
            db.execute(
                "INSERT OR REPLACE INTO mig_devices VALUES (?, ?)",
                (mig.uuid, mig.model_dump_json(by_alias=True)),
            )

    def remove_mig_device(self, uuid: str) -> None:
        with self._write() as db:
            db.execute("DELETE FROM mig_devices WHERE uuid = ?", (uuid,))

    # --- the compute-domain driver's claims (domain_claims) ----------------------------------

    def domain_claim(self, uid: str) -> DomainClaim | None:
        row = self._db.execute("SELECT * FROM domain_claims WHERE uid = ?", (uid,)).fetchone()
        return _domain_claim(row) if row else None

    def domain_claims(self) -> list[DomainClaim]:
        return [_domain_claim(row) for row in self._db.execute("SELECT * FROM domain_claims ORDER BY uid")]

    def reserve_domain_claim(self, claim: DomainClaim) -> None:
        """Record ``claim`` (replacing an earlier attempt's record of it), holding its device.

        :class:`MutationRejected` names the claim that holds the device.
        """
        with self._write() as db:
            _put_domain_claim(db, claim)

    def complete_domain_claim(self, uid: str, attempt: str, phase: DomainPhase = "PrepareCompleted") -> None:
        """Mark the attempt's record prepared (``phase``: PreparedAhead for one made ahead of binding);
        :class:`MutationRejected` when it is gone or taken over."""
        with self._write() as db:
            changed = db.execute(
                "UPDATE domain_claims SET phase = ? WHERE uid = ? AND attempt = ?",
                (phase, uid, attempt),
            ).rowcount
            if not changed:
                raise MutationRejected(
                    f"claim {uid} was unprepared or taken over while it was being prepared; the kubelet "
                    "will retry"
                )

    def release_domain_claim(self, uid: str) -> None:
        with self._write() as db:
            db.execute("DELETE FROM domain_claims WHERE uid = ?", (uid,))

    def start_domain_claims(
        self, boot_id: str, recorded: Iterable[DomainClaim]
    ) -> tuple[bool, list[tuple[DomainClaim, MutationRejected]]]:
        """The compute-domain driver's start, one transaction: whether its rows are of an earlier boot,
        and the recorded claims the checks refused.

        The GPU driver's start has already moved the store to this boot (and dropped these rows);
        the boot the compute-domain driver last started in tells it that its CDI specs and
        configuration directories are stale too. None recorded (a new store) is this boot's: the
        specs are then the evidence, as for the GPUs. ``recorded`` (the claims of its files from
        before this store) are inserted through the checked path when current.
        """
        refused: list[tuple[DomainClaim, MutationRejected]] = []
        with self._write() as db:
            row = db.execute("SELECT value FROM meta WHERE key = ?", (DOMAIN_BOOT_KEY,)).fetchone()
            earlier = row is not None and row[0] != boot_id
            if earlier:
                db.execute("DELETE FROM domain_claims")
            else:
                for claim in recorded:
                    try:
                        _put_domain_claim(db, claim)
                    except MutationRejected as conflict:
                        refused.append((claim, conflict))
            db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (DOMAIN_BOOT_KEY, boot_id))
        return earlier, refused

    @contextlib.contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        try:
            self._db.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as error:
            raise self._write_error(error) from None
        try:
            yield self._db
            crashpoint.reached("store.before_commit")
        except BaseException as error:
            with contextlib.suppress(sqlite3.Error):
                self._db.execute("ROLLBACK")
            if isinstance(error, sqlite3.Error):  # an I/O error, a full disk: the change did not happen
                raise self._write_error(error) from None
            raise
        try:
            self._db.execute("COMMIT")
        except sqlite3.Error as error:
            with contextlib.suppress(sqlite3.Error):
                self._db.execute("ROLLBACK")
            raise self._write_error(error) from None
        crashpoint.reached("store.after_commit")
        self._checkpoint_soon()

    def _write_error(self, error: sqlite3.Error) -> StoreWriteError:
        # sqlite says "database or disk is full"; the user looks for the kernel's words.
        cause = (
            "No space left on device"
            if getattr(error, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL
            else error
        )
        return StoreWriteError(f"cannot write the node's store {self.path}: {cause}")

    @staticmethod
    def _claim_in(db: sqlite3.Connection, uid: str) -> ClaimRecord | None:
        row = db.execute("SELECT record FROM claims WHERE uid = ?", (uid,)).fetchone()
        return ClaimRecord.model_validate_json(row[0]) if row else None


def _delete(db: sqlite3.Connection, uid: str, existing: ClaimRecord | None) -> None:
    _release_holds(db, uid, existing)
    db.execute("DELETE FROM claims WHERE uid = ?", (uid,))


def _release_holds(db: sqlite3.Connection, uid: str, existing: ClaimRecord | None) -> None:
    """Delete the rows ``existing`` holds: they are found by their key, the units its devices occupy."""
    if existing is not None:
        rows = {(d.pool, gpu, unit, uid) for d in existing.devices for gpu, unit in units(d)}
        db.executemany("DELETE FROM holds WHERE pool = ? AND gpu = ? AND unit = ? AND uid = ?", rows)
        if existing.sharing is not None:  # most claims have none: no statement for them
            db.execute("DELETE FROM gpu_settings WHERE uid = ?", (uid,))
            db.execute("DELETE FROM mps_daemons WHERE uid = ?", (uid,))


def _put_sharing(db: sqlite3.Connection, uid: str, sharing: SharingRecord | None) -> None:
    """The rows of what the claim's sharing set: the GPUs' settings to restore, its MPS daemon."""
    if sharing is None:
        return
    db.executemany(
        "INSERT OR REPLACE INTO gpu_settings VALUES (?, ?, ?, ?, ?, ?)",
        [
            (g.gpu_uuid, uid, g.compute_mode, g.time_slice, g.previous_compute_mode, g.previous_time_slice)
            for g in sharing.gpus
        ],
    )
    if sharing.mps_daemon is not None:
        db.execute("INSERT OR REPLACE INTO mps_daemons VALUES (?, ?)", (sharing.mps_daemon, uid))


def _put(db: sqlite3.Connection, uid: str, record: ClaimRecord, existing: ClaimRecord | None) -> None:
    """Write ``record`` (replacing ``existing``) and its holds; :class:`MutationRejected` on a conflict."""
    _release_holds(db, uid, existing)
    rows: dict[tuple[str, str, str], DeviceRecord] = {}
    for device in record.devices:  # one claim's results may name one device twice: the first one's
        for gpu, unit in units(device):
            rows.setdefault((device.pool, gpu, unit), device)
    try:
        db.executemany(
            "INSERT INTO holds (pool, gpu, unit, uid, device, shared, mig_uuid, memory) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            [
                (*key, uid, d.device, d.share_id is not None, d.mig.uuid if d.mig else None, d.share_bytes)
                for key, d in rows.items()
            ],
        )
    except sqlite3.IntegrityError:  # the primary key: another claim holds one of the units
        for (pool, gpu, unit), device in rows.items():
            row = db.execute(
                "SELECT uid, device FROM holds WHERE pool = ? AND gpu = ? AND unit = ? AND uid != ?",
                (pool, gpu, unit, uid),
            ).fetchone()
            if row is not None:
                raise MutationRejected(_conflict(device, gpu, row[1], _holder(db, row[0])), row[0]) from None
        raise
    # A GPU's holds are all shares or none, and its shares fit its memory: one query per GPU.
    gpus = {(d.pool, gpu, d.share_id is not None): d for (_, gpu, _), d in rows.items()}
    for (pool, gpu, shared), device in gpus.items():
        other, used = db.execute(
            "SELECT (SELECT uid FROM holds WHERE pool = ?1 AND gpu = ?2 AND shared = ?3 AND uid != ?4 "
            "LIMIT 1), (SELECT total(memory) FROM holds WHERE pool = ?1 AND gpu = ?2 AND shared AND ?5)",
            (pool, gpu, not shared, uid, shared),
        ).fetchone()
        if other is not None:
            raise MutationRejected(_mixed(device, gpu, _holder(db, other)), other)
        if device.gpu_bytes is not None and used > device.gpu_bytes:
            raise MutationRejected(_overcommitted(db, pool, gpu, uid, used, device.gpu_bytes))
    _put_sharing(db, uid, record.sharing)
    db.execute(
        "INSERT OR REPLACE INTO claims VALUES (?, ?, ?, ?, ?, ?)",
        (
            uid,
            record.namespace,
            record.name,
            record.phase,
            record.attempt,
            record.model_dump_json(by_alias=True),
        ),
    )


def _domain_claim(row: tuple[Any, ...]) -> DomainClaim:
    return DomainClaim(*row)


def _put_domain_claim(db: sqlite3.Connection, claim: DomainClaim) -> None:
    db.execute("DELETE FROM domain_claims WHERE uid = ?", (claim.uid,))
    try:
        db.execute(
            "INSERT INTO domain_claims VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                claim.uid,
                claim.namespace,
                claim.name,
                claim.kind,
                claim.device,
                claim.domain_uid,
                claim.allocation_mode,
                claim.phase,
                claim.attempt,
            ),
        )
    except sqlite3.IntegrityError:  # the unique index: another claim holds the device
        row = db.execute("SELECT * FROM domain_claims WHERE device = ?", (claim.device,)).fetchone()
        if row is None:
            raise
        holder = _domain_claim(row)
        raise MutationRejected(
            f"device {claim.device} is already prepared for claim {_domain_name(holder)}; a node has one "
            f"{claim.kind} device, which serves one claim at a time (allocationMode All too). The "
            "scheduler allocated it from a stale ResourceSlice: the kubelet retries, and the device is "
            "free once that claim is unprepared",
            holder.uid,
        ) from None


def _domain_name(claim: DomainClaim) -> str:
    return f"{claim.namespace}/{claim.name} ({claim.uid})" if claim.namespace else claim.uid


def _holder(db: sqlite3.Connection, uid: str) -> str:
    record = Store._claim_in(db, uid)
    return describe(uid, record) if record else uid


_STALE = "The scheduler allocated it from a stale ResourceSlice: the kubelet retries"


def _conflict(device: DeviceRecord, gpu: str, theirs: str, holder: str) -> str:
    if device.passthrough is not None and theirs != device.device:
        return (
            f"GPU {gpu} cannot be passed through ({device.device}): claim {holder} holds {theirs} on it. "
            f"{_STALE}, and the GPU is free once that claim is unprepared"
        )
    if theirs.startswith(PASSTHROUGH_PREFIX) and theirs != device.device:
        return (
            f"device {device.device} cannot be prepared: its GPU {gpu} is passed through to a virtual "
            f"machine ({theirs}) for claim {holder}. {_STALE}, and the GPU is free once that claim is "
            "unprepared"
        )
    if theirs == device.device:
        return (
            f"device {device.device} is already prepared for claim {holder}; a device serves one claim "
            f"at a time unless an allocation has admin access. {_STALE}, and the claim needs a new "
            "allocation if the other claim keeps the device"
        )
    if theirs == gpu:
        return (
            f"MIG device {device.device} cannot be created: its GPU {gpu} is prepared whole for claim "
            f"{holder}. {_STALE}, and the placement is free once that claim is unprepared"
        )
    if device.device == gpu or _GPU_NAME.fullmatch(device.device):
        return (
            f"GPU {device.device} cannot be prepared whole: claim {holder} holds a MIG device on it "
            f"({theirs}). {_STALE}, and the GPU is free once that claim is unprepared"
        )
    return (
        f"device {device.device} overlaps MIG device {theirs}, prepared for claim {holder}. {_STALE}, "
        "and the placement is free once that claim is unprepared"
    )


def _mixed(device: DeviceRecord, gpu: str, holder: str) -> str:
    stale = (
        "The scheduler allocated it from a stale ResourceSlice (was --consumable-capacity switched?): the "
        "kubelet retries, and the device is free once that claim is unprepared"
    )
    if device.share_id is not None:
        return (
            f"a share of device {device.device} cannot be prepared: it is prepared exclusively for claim "
            f"{holder}. {stale}"
        )
    what = (
        f"MIG device {device.device} cannot be created"
        if device.mig is not None or _MIG_NAME.fullmatch(device.device)
        else f"device {device.device} cannot be prepared exclusively"
    )
    return f"{what}: claim {holder} holds a share of {gpu} (consumable capacity). {stale}"


def _overcommitted(db: sqlite3.Connection, pool: str, gpu: str, uid: str, used: float, capacity: int) -> str:
    holders = db.execute(
        "SELECT DISTINCT uid FROM holds WHERE pool = ? AND gpu = ? AND shared AND uid != ? ORDER BY uid",
        (pool, gpu, uid),
    ).fetchall()
    others = ", ".join(_holder(db, u) for (u,) in holders) or "none (this claim's own shares)"
    return (
        f"the shares of device {gpu} would use {used / 2**30:g}Gi of its {capacity / 2**30:g}Gi of memory; "
        f"its other shares are held by claims {others}. The scheduler "
        "allocated it from a stale ResourceSlice (or another scheduler shares the node): the kubelet "
        "retries, and the memory is free once one of those claims is unprepared"
    )


def open_store(path: Path, boot_id: str) -> Opened:
    """Open (or create) the store for this boot; blocks on the file system (see the module doc)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    moved_aside = None
    try:
        db = _connect(path)
    except sqlite3.DatabaseError as error:
        moved_aside = _move_aside(path, str(error))
        db = _connect(path)
    version = db.execute("PRAGMA user_version").fetchone()[0]
    if version > SCHEMA_VERSION:
        db.close()
        raise StoreFromNewerDriver(
            f"the node's store {path} was written by a newer version of the driver (schema {version}; "
            f"this version reads {SCHEMA_VERSION}). Roll forward to that version, or drain the node's GPU "
            "pods and delete the file to start afresh"
        )
    store = Store(path, db)
    from dra_driver.node import legacy  # reads only what earlier versions left

    with store._write():
        created = db.execute("PRAGMA user_version").fetchone()[0] == 0  # or the other instance made it
        if created:
            _run(db, _SCHEMA)
            db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            db.execute("INSERT INTO meta VALUES ('boot_id', ?)", (boot_id,))
            stale = legacy.import_into(db, path.parent, boot_id, lambda db, uid, r: _put(db, uid, r, None))
        else:
            if db.execute("PRAGMA user_version").fetchone()[0] == 3:
                _upgrade_from_3(db)
            if db.execute("PRAGMA user_version").fetchone()[0] == 4:
                _upgrade_from_4(db)
            (recorded,) = db.execute("SELECT value FROM meta WHERE key = 'boot_id'").fetchone()
            stale = None if recorded == boot_id else _forget_earlier_boot(db, recorded, boot_id)
    if created:
        legacy.move_aside(path.parent)
    return Opened(store, stale=stale or (), earlier_boot=stale is not None, moved_aside=moved_aside)


def _run(db: sqlite3.Connection, script: str) -> None:
    for statement in script.split(";"):
        if statement.strip():
            db.execute(statement)


def _upgrade_from_3(db: sqlite3.Connection) -> None:
    """Schema 3 lacked a share's memory and the sharing and orphan tables: added, filled from the records.

    The memory of a share recorded by schema 3 is unknown, and counts as none.
    """
    db.execute("ALTER TABLE holds ADD COLUMN memory INTEGER")
    _run(db, _SINCE_4)
    for uid, text in db.execute("SELECT uid, record FROM claims").fetchall():
        _put_sharing(db, uid, ClaimRecord.model_validate_json(text).sharing)
    db.execute("PRAGMA user_version = 4")


def _upgrade_from_4(db: sqlite3.Connection) -> None:
    """Schema 4 lacked the compute-domain driver's table: added, with the boot of the store's rows.

    That driver kept its claims in files of its own until now; it imports them at its start, and
    the boot recorded here tells it whether they are of this boot.
    """
    _run(db, _SINCE_5)
    db.execute("INSERT INTO meta SELECT ?, value FROM meta WHERE key = 'boot_id'", (DOMAIN_BOOT_KEY,))
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")


def _forget_earlier_boot(db: sqlite3.Connection, recorded: str, boot_id: str) -> tuple[str, ...]:
    stale = tuple(uid for (uid,) in db.execute("SELECT uid FROM claims ORDER BY uid"))
    log.info(
        "the node's store is from an earlier boot; its claims are no longer prepared",
        store_boot_id=recorded,
        boot_id=boot_id,
        stale_claims=len(stale),
    )
    # Nor do MIG devices, GPU settings, MPS daemons or compute-domain claims survive a reboot.
    tables = ("holds", "claims", "mig_devices", "gpu_settings", "mps_daemons", "orphaned_gpu_instances")
    for table in (*tables, "domain_claims"):
        db.execute(f"DELETE FROM {table}")
    db.execute("UPDATE meta SET value = ? WHERE key = 'boot_id'", (boot_id,))
    return stale


def open_read_only(path: Path) -> Store:
    """The store of a running or stopped driver, for reading (``dra-driver state``)."""
    db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=BUSY_TIMEOUT_S)
    version = db.execute("PRAGMA user_version").fetchone()[0]
    if version != SCHEMA_VERSION:
        db.close()
        raise sqlite3.DatabaseError(f"{path} has schema {version}; this version reads {SCHEMA_VERSION}")
    return Store(path, db)


_CHECKPOINT_EVERY = 200  # commits: a few hundred KiB of log at most


def _checkpoint(path: Path) -> None:
    try:
        db = sqlite3.connect(path, timeout=BUSY_TIMEOUT_S, isolation_level=None)
        try:
            db.execute("PRAGMA wal_checkpoint(PASSIVE)")
        finally:
            db.close()
    except sqlite3.Error as error:  # the next one tries again; the log only grows meanwhile
        log.warning("could not checkpoint the node's store", error=str(error))


def _connect(path: Path) -> sqlite3.Connection:
    # Autocommit (isolation_level None): the transactions are ours, BEGIN IMMEDIATE each. Used from
    # the start-up thread, then from the event loop: never from two threads at once.
    db = sqlite3.connect(path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False)
    try:
        db.execute("PRAGMA journal_mode = WAL")
        db.execute("PRAGMA synchronous = NORMAL")
        db.execute("PRAGMA wal_autocheckpoint = 10000")  # a backstop: see Store._checkpoint_soon
        (verdict,) = db.execute("PRAGMA quick_check").fetchone()
        if verdict != "ok":
            raise sqlite3.DatabaseError(f"quick_check: {verdict}")
    except BaseException:
        db.close()
        raise
    return db


def _move_aside(path: Path, reason: str) -> Path:
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    aside, n = path.with_name(f"{path.name}.corrupt-{stamp}"), 1
    while aside.exists():
        aside, n = path.with_name(f"{path.name}.corrupt-{stamp}.{n}"), n + 1
    path.replace(aside)
    for suffix in ("-wal", "-shm"):  # they belong to the damaged file
        companion = path.with_name(path.name + suffix)
        if companion.exists():
            companion.replace(aside.with_name(aside.name + suffix))
    log.error(
        "the node's store is unreadable; moved aside, rebuilding the prepared claims from the CDI specs",
        reason=reason,
        moved_to=str(aside),
        what_to_do="nothing is needed to recover; keep the moved file for a bug report",
    )
    return aside
