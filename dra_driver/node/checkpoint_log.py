"""The checkpoint's log: what changed since the snapshot, one line per group commit.

Rewriting the whole checkpoint for every commit made a prepare cost more the more
claims the node held (a node with 200 prepared claims rewrote about 100 KB per
claim). So the snapshot (``checkpoint.json``) is written only now and then, and each
commit appends the records it changed to ``checkpoint.json.log``::

    {"base": 41, "epoch": "9f2c..."}                                 <- header
    {"checksum": "sha256:...", "entry": {"generation": 42, "set": {"<uid>": {...}}, "delete": []}}
    {"checksum": "sha256:...", "entry": {"generation": 43, "set": {}, "delete": ["<uid>"]}}

The header names the snapshot's generation (``base``) the entries continue, and a random
``epoch`` that changes whenever the log is started afresh: a plugin instance that finds
another epoch knows the other instance compacted, and reads both files again. Entries
must continue the generations without a gap, and each has a checksum, so a torn last
line (a write cut short by a full disk or a power loss) ends the log instead of being
half believed; the next writer cuts it off before it appends.

Appends are not fsynced, and that is no weaker than an fsync per commit: a killed
process loses nothing the kernel already has, and an operating-system crash is a
reboot, after which nothing prepared survives (device nodes, MIG devices and
``/run/cdi`` are gone) and the boot id in the snapshot, which *is* fsynced, sends every
record to clean-up. See :mod:`dra_driver.node.checkpoint` for that rule.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import secrets
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import ValidationError

from dra_driver import crashpoint
from dra_driver.node.checkpoint import Checkpoint, ClaimRecord, canonical_json, decode, write_atomically

LOG_SUFFIX = ".log"
_HEADER_MAX = 256  # bytes; a longer first line is not a header of ours


def log_path(checkpoint: Path) -> Path:
    return checkpoint.with_name(checkpoint.name + LOG_SUFFIX)


@dataclass(frozen=True)
class LogEntry:
    """One group commit: the records it set and the claims it removed, and the generation after it."""

    generation: int
    set: dict[str, ClaimRecord] = field(default_factory=dict)
    delete: tuple[str, ...] = ()

    def applied_to(self, state: Checkpoint) -> Checkpoint:
        claims = dict(state.claims)
        for uid in self.delete:
            claims.pop(uid, None)
        claims.update(self.set)
        return state.model_copy(update={"claims": claims, "generation": self.generation})


@dataclass(frozen=True)
class LogPosition:
    """How far a reader has followed the log: its epoch and the end of the last valid entry.

    ``snapshot`` identifies the snapshot file the log continues (inode, size, mtime): a
    rewrite always creates a new inode while the old file still exists, so a snapshot
    rewritten by anyone, a newer driver version that keeps no log included, is noticed.
    """

    epoch: str
    end: int
    snapshot: tuple[int, int, int]


def snapshot_identity(path: Path) -> tuple[int, int, int]:
    status = os.stat(path)
    return status.st_ino, status.st_size, status.st_mtime_ns


def header(base: int, epoch: str) -> bytes:
    return json.dumps({"base": base, "epoch": epoch}, sort_keys=True).encode() + b"\n"


def parse_header(line: bytes) -> tuple[int, str] | None:
    """``(base, epoch)`` of a header line, or None when it is not one."""
    if len(line) > _HEADER_MAX or not line.endswith(b"\n"):
        return None
    try:
        document = json.loads(line)
    except ValueError:
        return None
    if not isinstance(document, dict) or set(document) != {"base", "epoch"}:
        return None
    base, epoch = document["base"], document["epoch"]
    if not isinstance(base, int) or isinstance(base, bool) or not isinstance(epoch, str):
        return None
    return base, epoch


def encode_entry(entry: LogEntry) -> bytes:
    body = {
        "generation": entry.generation,
        "set": {uid: record.model_dump(mode="json", by_alias=True) for uid, record in entry.set.items()},
        "delete": list(entry.delete),
    }
    digest = hashlib.sha256(canonical_json(body)).hexdigest()
    return canonical_json({"checksum": f"sha256:{digest}", "entry": body}) + b"\n"


def parse_entries(data: bytes, generation: int) -> tuple[list[LogEntry], int]:
    """The valid entries at the start of ``data`` that continue ``generation``, and their length in bytes.

    Parsing stops at the first line that is incomplete, damaged or out of sequence:
    everything after it is a torn write, never to be believed.
    """
    entries: list[LogEntry] = []
    end = 0
    while (newline := data.find(b"\n", end)) != -1:
        entry = _entry(data[end : newline + 1], generation + 1)
        if entry is None:
            break
        entries.append(entry)
        generation = entry.generation
        end = newline + 1
    return entries, end


def _entry(line: bytes, generation: int) -> LogEntry | None:
    try:
        document = json.loads(line)
        body = document["entry"]
        if document["checksum"] != f"sha256:{hashlib.sha256(canonical_json(body)).hexdigest()}":
            return None
        if body["generation"] != generation:
            return None
        # Lax: JSON has lists where the records have tuples; the checksum vouches for the content.
        records = {
            uid: ClaimRecord.model_validate(record, strict=False) for uid, record in body["set"].items()
        }
        deleted = tuple(body["delete"])
    except (ValueError, TypeError, KeyError, AttributeError, ValidationError):
        return None
    if not all(isinstance(uid, str) for uid in deleted):
        return None
    return LogEntry(generation=generation, set=records, delete=deleted)


def append(path: Path, data: bytes, at: int) -> int:
    """Write ``data`` at offset ``at`` (cutting off a torn tail first); returns the new end.

    A write that fails half way (a full disk) is cut off again, so the log never keeps
    a torn line of ours.
    """
    crashpoint.reached("journal.before_append")
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        if os.fstat(fd).st_size != at:
            os.ftruncate(fd, at)
        try:
            # A write the disk has room for only in part returns short; writing the rest then
            # fails with the reason (ENOSPC), which is what the user must read.
            done = 0
            while done < len(data):
                done += os.pwrite(fd, data[done:], at + done)
        except BaseException:
            os.ftruncate(fd, at)
            raise
    finally:
        os.close(fd)
    crashpoint.reached("journal.after_append")
    return at + len(data)


@dataclass(frozen=True)
class Replayed:
    """What :func:`replay` found: the state, and where the log's valid part ends (None: no usable log)."""

    state: Checkpoint
    position: LogPosition | None
    size: int  # of the log file; more than ``position.end`` when its last write was torn

    @property
    def damaged(self) -> bool:
        """Bytes follow the last valid entry: a torn write, or damage that hid later entries."""
        return self.position is not None and self.size > self.position.end


def replay(path: Path, snapshot: Checkpoint) -> Replayed:
    """``snapshot`` with the log's entries applied, when the log continues that snapshot."""
    try:
        data = log_path(path).read_bytes()
    except FileNotFoundError:
        return Replayed(snapshot, None, 0)
    first = data.find(b"\n") + 1
    parsed = parse_header(data[:first]) if first else None
    if parsed is None or parsed[0] != snapshot.generation:
        return Replayed(snapshot, None, len(data))  # a log of an older snapshot: compacted already
    entries, length = parse_entries(data[first:], snapshot.generation)
    state = snapshot
    for entry in entries:
        state = entry.applied_to(state)
    return Replayed(state, LogPosition(parsed[1], first + length, snapshot_identity(path)), len(data))


def read_state(path: Path) -> Checkpoint:
    """The state the files at ``path`` hold (for tools and tests; the journal follows them itself)."""
    return replay(path, decode(path.read_bytes())).state


def follow(path: Path, state: Checkpoint, position: LogPosition) -> Replayed | None:
    """``state`` brought up to date with what was appended after ``position``.

    None when the log was started afresh (another instance compacted) or cut short:
    then the snapshot and the whole log have to be read again.
    """
    try:
        if snapshot_identity(path) != position.snapshot:
            return None
        with open(log_path(path), "rb") as log:
            parsed = parse_header(log.readline(_HEADER_MAX + 1))
            size = os.fstat(log.fileno()).st_size
            if parsed is None or parsed[1] != position.epoch or size < position.end:
                return None
            if size == position.end:
                return Replayed(state, position, size)
            log.seek(position.end)
            entries, length = parse_entries(log.read(), state.generation)
    except FileNotFoundError:
        return None
    for entry in entries:
        state = entry.applied_to(state)
    return Replayed(state, dataclasses.replace(position, end=position.end + length), size)


def keep_damaged(path: Path) -> Path:
    """Copy the log of the checkpoint at ``path`` aside for a bug report; returns the copy."""
    source = log_path(path)
    aside = source.with_name(f"{source.name}.corrupt-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}")
    shutil.copyfile(source, aside)
    return aside


def start(path: Path, base: int) -> LogPosition:
    """Begin a new, empty log after a snapshot of generation ``base`` (atomically replacing the old)."""
    epoch = secrets.token_hex(8)
    data = header(base, epoch)
    write_atomically(log_path(path), data)
    return LogPosition(epoch, len(data), snapshot_identity(path))
