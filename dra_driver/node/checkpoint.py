"""The checkpoint: which claims are prepared on this node, in a file that survives restarts.

Format (``checkpoint.json``)::

    {"schemaVersion": 2, "checksum": "sha256:<hex>", "payload": {"bootId": ..., "generation": ...,
     "claims": {"<uid>": {...}}}}

This is the snapshot; the changes since are in its log (:mod:`dra_driver.node.checkpoint_log`).

The checksum covers the canonical JSON of ``payload`` (sorted keys, no spaces), so a
torn or bit-flipped file is detected rather than half-believed. ``generation`` grows
by one with every write, whoever writes: two plugin instances share the file during
a rolling update and each notices the other's writes (see :mod:`dra_driver.node.journal`).
``bootId`` records the boot the state belongs to: after a reboot nothing prepared
survives (device nodes, MIG devices and ``/var/run/cdi`` are gone), so an old boot's
claims are reported as stale instead of believed.

A file that cannot be trusted (bad checksum, truncated, not JSON, unknown schema) is
moved aside, never deleted and never fatal: the driver would otherwise crash-loop on
it, which is what NVIDIA's driver does. The caller then rebuilds from the CDI specs.

Everything here blocks on the file system; the event loop calls it through
``asyncio.to_thread``.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import structlog
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.alias_generators import to_camel

from dra_driver import crashpoint

# 2: the snapshot is continued by a log (checkpoint_log); a version-1 reader must not believe it alone.
SCHEMA_VERSION = 2
_TEMP_SUFFIX = ".tmp"

log = structlog.get_logger(__name__)

Phase = Literal["PrepareStarted", "PrepareCompleted", "Recovered"]
"""PrepareStarted: devices reserved, side effects (MIG devices, CDI spec) may be
half done. PrepareCompleted: everything done; a repeated prepare returns it as is.
Recovered: rebuilt from a CDI spec after the checkpoint was lost; the devices are
known and stay reserved until the claim's unprepare, or until a repeated prepare
records the claim in full again."""


class _Record(BaseModel):
    # defer_build: the schemas are built when the first checkpoint is read, after the kubelet
    # sockets opened, not when the CLI imports this module for its errors.
    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        frozen=True,
        alias_generator=to_camel,
        validate_by_name=True,
        defer_build=True,
    )


class MigRecord(_Record):
    """The MIG device that prepare creates for a MIG placement (dynamic MIG) and unprepare destroys.

    It is recorded with PrepareStarted, before the device is created, and ``uuid`` is added
    once the device exists: after a crash in between, the placement still tells which live
    instance is ours (see :mod:`dra_driver.node.recovery`).
    """

    parent_uuid: str
    parent_device: str  # the full GPU's device name ("gpu-0"): not preparable while this exists
    profile_id: int  # the GPU-instance profile id, as the backend takes it
    placement_start: int
    placement_size: int
    uuid: str | None = None  # "MIG-...", once created


class DeviceRecord(_Record):
    """One prepared allocation result."""

    request: str  # "req" or "req/sub"; empty when recovered from a CDI spec
    pool: str
    device: str
    admin_access: bool = False
    share_id: str | None = None
    cdi_device_ids: tuple[str, ...]
    config: dict[str, Any] | None = None  # the effective opaque config, as the user would write it
    mig: MigRecord | None = None  # set when prepare creates the device (dynamic MIG)


class GpuPolicyRecord(_Record):
    """A full GPU whose compute mode and time slice the claim set, and what to put back.

    Recorded with PrepareStarted, before the GPU is changed: after a crash in between, the
    unprepare (or the next prepare) still knows what the GPU had.
    """

    gpu_uuid: str
    compute_mode: str  # a ComputeMode value: what the claim sets
    time_slice: str  # a TimeSlice value
    previous_compute_mode: str  # what the GPU had before the first claim that changed it
    previous_time_slice: str


class SharingRecord(_Record):
    """What sharing changed on the node for a claim: GPU settings and the MPS control daemon."""

    gpus: tuple[GpuPolicyRecord, ...] = ()
    mps_daemon: str | None = None  # the id of the claim's MPS control daemon


class ClaimRecord(_Record):
    namespace: str  # empty when recovered from a CDI spec
    name: str
    phase: Phase
    attempt: str  # unique per prepare attempt: tells a live attempt from a leftover
    devices: tuple[DeviceRecord, ...]
    # TimeSlicing or MPS applied on the GPU; left out of the file when none (most claims).
    sharing: SharingRecord | None = Field(default=None, exclude_if=lambda value: value is None)


class Checkpoint(_Record):
    boot_id: str
    generation: int = Field(default=0, ge=0)
    claims: dict[str, ClaimRecord] = Field(default_factory=dict)  # by claim uid


class CheckpointUnreadable(Exception):
    """The file exists but cannot be trusted."""


class CheckpointFromNewerDriver(CheckpointUnreadable):
    """The file was written by a newer schema: this driver must neither believe nor replace it.

    That is what rolling back an upgrade meets. Moving the file aside would drop the
    newer driver's records (its MIG devices among them), and writing over it would lose
    them for good, so the driver refuses to start and says what to do.
    """


class BootIdUnavailable(Exception):
    """Without the boot id, state from before a reboot would be believed: refuse to start."""


@dataclass(frozen=True)
class LoadedCheckpoint:
    """What :func:`load` found."""

    checkpoint: Checkpoint  # the state to start from
    stale: dict[str, ClaimRecord]  # claims prepared during an earlier boot: clean up their CDI specs
    moved_aside: Path | None  # where an untrustworthy file went: rebuild the state
    earlier_boot: bool = False  # the file was from an earlier boot (``stale`` may still be empty)


def canonical_json(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def encode(checkpoint: Checkpoint) -> bytes:
    payload = checkpoint.model_dump(mode="json", by_alias=True)
    digest = hashlib.sha256(canonical_json(payload)).hexdigest()
    document = {"schemaVersion": SCHEMA_VERSION, "checksum": f"sha256:{digest}", "payload": payload}
    return (json.dumps(document, indent=1, sort_keys=True) + "\n").encode()


def decode(data: bytes) -> Checkpoint:
    """Parse and verify a checkpoint file; :class:`CheckpointUnreadable` says what is wrong."""
    try:
        document = json.loads(data)
    except ValueError as error:  # includes UnicodeDecodeError
        raise CheckpointUnreadable(f"not JSON (truncated or damaged?): {error}") from None
    if not isinstance(document, dict) or set(document) != {"schemaVersion", "checksum", "payload"}:
        raise CheckpointUnreadable("not a checkpoint: expected exactly schemaVersion, checksum and payload")
    version = document["schemaVersion"]
    if isinstance(version, int) and not isinstance(version, bool) and version > SCHEMA_VERSION:
        raise CheckpointFromNewerDriver(
            f"it was written by a newer version of the driver (schema {version}; this version reads "
            f"{SCHEMA_VERSION}). Roll forward to that version, or drain the node's GPU pods and delete "
            "the file to start afresh"
        )
    if version != SCHEMA_VERSION:
        raise CheckpointUnreadable(
            f"schemaVersion {document['schemaVersion']!r} is not {SCHEMA_VERSION} "
            "(written by another version of the driver?)"
        )
    payload = canonical_json(document["payload"])
    if document["checksum"] != f"sha256:{hashlib.sha256(payload).hexdigest()}":
        raise CheckpointUnreadable("checksum mismatch: the payload was damaged after it was written")
    try:
        return Checkpoint.model_validate_json(payload)
    except ValidationError as error:
        raise CheckpointUnreadable(f"payload does not match schema {SCHEMA_VERSION}: {error}") from None


def read_boot_id(path: Path) -> str:
    """This boot's id; :class:`BootIdUnavailable` when it cannot be read.

    Stale-state detection rests on it: with no boot id, claims prepared before a reboot
    would be believed, and their devices (gone with the reboot) never handed out again.
    """
    try:
        boot_id = path.read_text().strip()
    except (OSError, UnicodeDecodeError) as error:
        reason = error.strerror if isinstance(error, OSError) else "not text"
        raise BootIdUnavailable(
            f"cannot read the boot id from {path}: {reason or error}; it tells prepared state "
            "from before a reboot, so the driver does not start without it (mount the host's /proc, "
            "or point --boot-id-file / DRA_BOOT_ID_FILE at a file that holds it)"
        ) from None
    if not boot_id:
        raise BootIdUnavailable(f"the boot id file {path} is empty; see --boot-id-file / DRA_BOOT_ID_FILE")
    return boot_id


def load(
    path: Path, boot_id: str, replay: Callable[[Checkpoint], Checkpoint] = lambda snapshot: snapshot
) -> LoadedCheckpoint:
    """Read the checkpoint for this boot; never raises for a bad file (see the module doc).

    ``replay`` brings the snapshot up to date (the journal applies its log) before the
    boot is checked, so the claims of an earlier boot include those only the log holds.
    """
    empty = Checkpoint(boot_id=boot_id)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return LoadedCheckpoint(empty, stale={}, moved_aside=None)
    try:
        checkpoint = decode(data)
    except CheckpointFromNewerDriver as error:
        raise CheckpointFromNewerDriver(f"checkpoint {path}: {error}") from None
    except CheckpointUnreadable as error:
        aside = path.with_name(f"{path.name}.corrupt-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}")
        aside = _unused(aside)
        os.replace(path, aside)
        log.error(
            "checkpoint unreadable; moved aside, rebuilding the prepared claims from the CDI specs",
            reason=str(error),
            moved_to=str(aside),
            what_to_do="nothing is needed to recover; keep the moved file for a bug report",
        )
        return LoadedCheckpoint(empty, stale={}, moved_aside=aside)
    checkpoint = replay(checkpoint)
    if boot_id and checkpoint.boot_id != boot_id:
        log.info(
            "checkpoint is from an earlier boot; its claims are no longer prepared",
            checkpoint_boot_id=checkpoint.boot_id,
            boot_id=boot_id,
            stale_claims=len(checkpoint.claims),
        )
        return LoadedCheckpoint(
            empty.model_copy(update={"generation": checkpoint.generation}),
            stale=dict(checkpoint.claims),
            moved_aside=None,
            earlier_boot=True,
        )
    return LoadedCheckpoint(checkpoint, stale={}, moved_aside=None)


def write(path: Path, checkpoint: Checkpoint) -> bytes:
    """Replace the checkpoint atomically and durably; returns the bytes written."""
    data = encode(checkpoint)
    write_atomically(path, data)
    return data


def write_atomically(path: Path, data: bytes) -> None:
    """Temp file in the same directory, fsync, rename over the old file, fsync the directory.

    After a crash the file is either the old version or the new one; at worst a
    temporary file is left behind (:func:`remove_leftover_temps` clears those).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=_TEMP_SUFFIX)
    try:
        with os.fdopen(fd, "wb") as temp:
            temp.write(data)
            temp.flush()
            os.fsync(temp.fileno())
        crashpoint.reached("datafile.before_rename")
        os.replace(temp_name, path)
    except BaseException:
        Path(temp_name).unlink(missing_ok=True)
        raise
    directory = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
    crashpoint.reached("datafile.after_write")


def remove_leftover_temps(path: Path) -> int:
    """Remove the temporary files that interrupted writes of ``path`` left; returns how many.

    Only for files written under the journal's lock, by a caller holding it: no write of
    them can be in progress.
    """
    removed = 0
    for temp in path.parent.glob(f".{glob.escape(path.name)}.*{_TEMP_SUFFIX}"):
        temp.unlink(missing_ok=True)
        removed += 1
    if removed:
        log.info("removed temporary files of interrupted writes", file=str(path), count=removed)
    return removed


def _unused(path: Path) -> Path:
    candidate, n = path, 1
    while candidate.exists():
        candidate, n = path.with_name(f"{path.name}.{n}"), n + 1
    return candidate
