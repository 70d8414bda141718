"""The checkpoint: which claims are prepared on this node, in a file that survives restarts.

Format (``checkpoint.json``)::

    {"schemaVersion": 1, "checksum": "sha256:<hex>", "payload": {"bootId": ..., "generation": ...,
     "claims": {"<uid>": {...}}}}

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

import hashlib
import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import structlog
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.alias_generators import to_camel

from dra_driver import crashpoint

SCHEMA_VERSION = 1

log = structlog.get_logger(__name__)

Phase = Literal["PrepareStarted", "PrepareCompleted", "Recovered"]
"""PrepareStarted: devices reserved, side effects (MIG devices, CDI spec) may be
half done. PrepareCompleted: everything done; a repeated prepare returns it as is.
Recovered: rebuilt from a CDI spec after the checkpoint was lost; the devices are
known and stay reserved until the claim's unprepare, or until a repeated prepare
records the claim in full again."""


class _Record(BaseModel):
    model_config = ConfigDict(
        extra="forbid", strict=True, frozen=True, alias_generator=to_camel, validate_by_name=True
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


class ClaimRecord(_Record):
    namespace: str  # empty when recovered from a CDI spec
    name: str
    phase: Phase
    attempt: str  # unique per prepare attempt: tells a live attempt from a leftover
    devices: tuple[DeviceRecord, ...]


class Checkpoint(_Record):
    boot_id: str
    generation: int = Field(default=0, ge=0)
    claims: dict[str, ClaimRecord] = Field(default_factory=dict)  # by claim uid


class CheckpointUnreadable(Exception):
    """The file exists but cannot be trusted."""


@dataclass(frozen=True)
class LoadedCheckpoint:
    """What :func:`load` found."""

    checkpoint: Checkpoint  # the state to start from
    stale: dict[str, ClaimRecord]  # claims prepared during an earlier boot: clean up their CDI specs
    moved_aside: Path | None  # where an untrustworthy file went: rebuild the state


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
    if document["schemaVersion"] != SCHEMA_VERSION:
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
    """This boot's id; empty (stale state cannot be told apart) when the file is missing."""
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        log.warning("boot id unavailable: state from before a reboot cannot be detected", path=str(path))
        return ""


def load(path: Path, boot_id: str) -> LoadedCheckpoint:
    """Read the checkpoint for this boot; never raises for a bad file (see the module doc)."""
    empty = Checkpoint(boot_id=boot_id)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return LoadedCheckpoint(empty, stale={}, moved_aside=None)
    try:
        checkpoint = decode(data)
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
        )
    return LoadedCheckpoint(checkpoint, stale={}, moved_aside=None)


def write(path: Path, checkpoint: Checkpoint) -> bytes:
    """Replace the checkpoint atomically and durably; returns the bytes written.

    Temp file in the same directory, fsync, rename over the old file, fsync the
    directory: after a crash the file is either the old version or the new one.
    """
    data = encode(checkpoint)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as temp:
            temp.write(data)
            temp.flush()
            os.fsync(temp.fileno())
        crashpoint.reached("checkpoint.before_rename")
        os.replace(temp_name, path)
    except BaseException:
        Path(temp_name).unlink(missing_ok=True)
        raise
    directory = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
    crashpoint.reached("checkpoint.after_write")
    return data


def _unused(path: Path) -> Path:
    candidate, n = path, 1
    while candidate.exists():
        candidate, n = path.with_name(f"{path.name}.{n}"), n + 1
    return candidate
