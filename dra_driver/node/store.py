"""The node's state: one transactional store (sqlite3) for everything the node remembers.

``state.db`` in the plugin's data directory holds the prepared claims, what their devices
occupy, and the MIG devices the driver created. Python's own ``sqlite3``, in WAL mode with
``synchronous=NORMAL``: a commit appends to the write-ahead log without an fsync, which a
killed process cannot lose; an operating-system crash is a reboot, after which the boot id
(below) sends every record to clean-up anyway, since nothing prepared survives a reboot.

**The exclusivity rules are the schema.** Each record's devices become rows of ``holds``,
one per unit of hardware they occupy, under a unique index over (pool, GPU, unit), so the
database itself refuses a second holder, whichever plugin instance writes:

* an exclusive full GPU occupies all of its memory slices (``slice:0`` .. ``slice:7``: no
  GPU has more than 8), a MIG device the slices of its placement (the driver's own, whose
  placement is recorded) or its first slice (an administrator's: placements of existing
  devices never overlap, the hardware saw to that), so a full GPU and a MIG device on it
  exclude each other;
* a share of a GPU (consumable capacity, a share id) occupies ``share:<id>``; shares of a
  GPU and an exclusive hold of it exclude each other, which a unique index cannot say, so
  the same writing transaction checks it with one indexed query;
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
(:mod:`dra_driver.node.legacy`).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import sqlite3
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import structlog

from dra_driver import crashpoint
from dra_driver.node.records import ClaimRecord, DeviceRecord, MigRecord, NodeState, describe
from dra_driver.resources.naming import PASSTHROUGH_PREFIX

log = structlog.get_logger(__name__)

STORE_FILE = "state.db"
SCHEMA_VERSION = 3  # 1 and 2: checkpoint.json (see legacy.py)
GPU_SLICES = 8  # memory slices of the largest MIG-capable GPU: what a full GPU occupies
BUSY_TIMEOUT_S = 10.0  # the longest wait for the other instance's transaction; they take microseconds

_SCHEMA = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL) STRICT;
CREATE TABLE claims (
    uid TEXT PRIMARY KEY, namespace TEXT NOT NULL, name TEXT NOT NULL, phase TEXT NOT NULL,
    attempt TEXT NOT NULL, record TEXT NOT NULL
) STRICT, WITHOUT ROWID;
CREATE TABLE holds (
    pool TEXT NOT NULL, gpu TEXT NOT NULL, unit TEXT NOT NULL, uid TEXT NOT NULL, device TEXT NOT NULL,
    shared INTEGER NOT NULL, mig_uuid TEXT,
    PRIMARY KEY (pool, gpu, unit)  -- one holder per unit of hardware: the exclusivity rule
) STRICT, WITHOUT ROWID;
CREATE INDEX holds_of_mig ON holds (mig_uuid) WHERE mig_uuid IS NOT NULL;
CREATE TABLE mig_devices (uuid TEXT PRIMARY KEY, record TEXT NOT NULL) STRICT, WITHOUT ROWID;
"""

_MIG_NAME = re.compile(r"(gpu-\d+)-mig-.+-(\d+)")
_GPU_NAME = re.compile(r"(gpu-\d+)(?:-maintenance)?")


class MutationRejected(Exception):
    """The change contradicts the store; the message is for the user."""


class StoreWriteError(Exception):
    """The store could not be written (disk full, I/O error); the change did not happen."""


class StoreFromNewerDriver(Exception):
    """The store was written by a newer schema: this driver must neither believe nor replace it."""


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
        return NodeState({uid: ClaimRecord.model_validate_json(record) for uid, record in rows}, boot_id)

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


def _put(db: sqlite3.Connection, uid: str, record: ClaimRecord, existing: ClaimRecord | None) -> None:
    """Write ``record`` (replacing ``existing``) and its holds; :class:`MutationRejected` on a conflict."""
    _release_holds(db, uid, existing)
    rows: dict[tuple[str, str, str], tuple[DeviceRecord, bool, str | None]] = {}
    for device in record.devices:  # one claim's results may name one device twice: the first one's
        for gpu, unit in units(device):
            mig_uuid = device.mig.uuid if device.mig is not None else None
            rows.setdefault((device.pool, gpu, unit), (device, device.share_id is not None, mig_uuid))
    try:
        db.executemany(
            "INSERT INTO holds VALUES (?, ?, ?, ?, ?, ?, ?)",
            [(*key, uid, device.device, shared, mig) for key, (device, shared, mig) in rows.items()],
        )
    except sqlite3.IntegrityError:  # the primary key: another claim holds one of the units
        for (pool, gpu, unit), (device, _, _) in rows.items():
            row = db.execute(
                "SELECT uid, device FROM holds WHERE pool = ? AND gpu = ? AND unit = ? AND uid != ?",
                (pool, gpu, unit, uid),
            ).fetchone()
            if row is not None:
                raise MutationRejected(_conflict(device, gpu, row[1], _holder(db, row[0]))) from None
        raise
    kinds = {(p, g, s): d for (p, g, _), (d, s, _) in rows.items()}  # a GPU's holds are all shares or none
    for (pool, gpu, shared), device in kinds.items():
        row = db.execute(
            "SELECT uid, device FROM holds WHERE pool = ? AND gpu = ? AND shared = ? AND uid != ? LIMIT 1",
            (pool, gpu, not shared, uid),
        ).fetchone()
        if row is not None:
            raise MutationRejected(_mixed(device, gpu, _holder(db, row[0])))
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
            for statement in _SCHEMA.split(";"):
                if statement.strip():
                    db.execute(statement)
            db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            db.execute("INSERT INTO meta VALUES ('boot_id', ?)", (boot_id,))
            stale = legacy.import_into(db, path.parent, boot_id, lambda db, uid, r: _put(db, uid, r, None))
        else:
            (recorded,) = db.execute("SELECT value FROM meta WHERE key = 'boot_id'").fetchone()
            stale = None if recorded == boot_id else _forget_earlier_boot(db, recorded, boot_id)
    if created:
        legacy.move_aside(path.parent)
    return Opened(store, stale=stale or (), earlier_boot=stale is not None, moved_aside=moved_aside)


def _forget_earlier_boot(db: sqlite3.Connection, recorded: str, boot_id: str) -> tuple[str, ...]:
    stale = tuple(uid for (uid,) in db.execute("SELECT uid FROM claims ORDER BY uid"))
    log.info(
        "the node's store is from an earlier boot; its claims are no longer prepared",
        store_boot_id=recorded,
        boot_id=boot_id,
        stale_claims=len(stale),
    )
    for table in ("holds", "claims", "mig_devices"):  # MIG devices do not survive a reboot either
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
