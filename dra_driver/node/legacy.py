"""Read-only import of the state of earlier versions: schema 2, ``checkpoint.json`` and its files.

Those versions kept a snapshot (``checkpoint.json``: ``{"schemaVersion": 2, "checksum":
"sha256:<hex>", "payload": {"bootId", "generation", "claims"}}``), a log of the changes since
(``checkpoint.json.log``: a header line ``{"base", "epoch"}``, then one checksummed entry per
commit, ``{"generation", "set", "delete"}``, each continuing the generation before it), and one
file per MIG device they created (``mig-devices/<uuid>.json``), and the GPU instances a failed
rollback left (``nvml-orphaned-gpu-instances.json``). The first start of this version
reads them once, inside the transaction that creates the store, inserts each claim through the
store's constraint-checked path, and then moves the files aside (``*.imported``): a node keeps
its prepared claims across the upgrade. A claim the checks refuse is logged with both claims'
names and left to the CDI-spec recovery, which reports it again. A snapshot from a newer schema
is refused, as it always was; one that cannot be trusted is left where it is and the claims are
rebuilt from the CDI specs.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog
from pydantic import ValidationError

from dra_driver.node.records import ClaimRecord, MigRecord, MutationRejected, StoreFromNewerDriver

log = structlog.get_logger(__name__)

CHECKPOINT_FILE = "checkpoint.json"
MIG_LEDGER_DIR = "mig-devices"
ORPHANS_FILE = "nvml-orphaned-gpu-instances.json"
_FILES = (CHECKPOINT_FILE, f"{CHECKPOINT_FILE}.log", MIG_LEDGER_DIR, ORPHANS_FILE)


def canonical_json(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def import_into(
    db: sqlite3.Connection,
    directory: Path,
    boot_id: str,
    put: Callable[[sqlite3.Connection, str, ClaimRecord], None],
) -> tuple[str, ...] | None:
    """Import the schema-2 files of ``directory``; the claims of an earlier boot, or None when current.

    Runs inside the store's creating transaction; raises ``StoreFromNewerDriver`` for a newer schema.
    """
    db.executemany(
        "INSERT OR IGNORE INTO orphaned_gpu_instances VALUES (?, ?, ?, ?)",
        _orphans(directory / ORPHANS_FILE, boot_id),
    )
    snapshot = directory / CHECKPOINT_FILE
    if not snapshot.exists():
        return None
    try:
        file_boot, claims = _read(snapshot)
    except ValueError as error:
        log.error(
            "the checkpoint of the earlier version is unreadable; rebuilding from the CDI specs",
            file=str(snapshot),
            reason=str(error),
        )
        return None
    if file_boot != boot_id:
        log.info("the earlier version's checkpoint is from an earlier boot", stale_claims=len(claims))
        return tuple(sorted(claims))
    for uid, record in sorted(claims.items()):
        try:
            put(db, uid, record)
        except MutationRejected as conflict:
            log.error(
                "a claim of the earlier version's checkpoint conflicts", claim_uid=uid, error=str(conflict)
            )
    for mig in _ledger(directory / MIG_LEDGER_DIR).values():
        db.execute(
            "INSERT OR REPLACE INTO mig_devices VALUES (?, ?)", (mig.uuid, mig.model_dump_json(by_alias=True))
        )
    log.info("imported the earlier version's checkpoint", claims=len(claims), file=str(snapshot))
    return None


def move_aside(directory: Path) -> None:
    """Move the imported files out of the way (after the store's transaction committed)."""
    for name in _FILES:
        old = directory / name
        if old.exists():
            old.replace(directory / f"{name}.imported")


def _read(snapshot: Path) -> tuple[str, dict[str, ClaimRecord]]:
    try:
        document = json.loads(snapshot.read_bytes())
        version, checksum, payload = document["schemaVersion"], document["checksum"], document["payload"]
    except (OSError, ValueError, TypeError, KeyError) as error:
        raise ValueError(f"not a checkpoint: {error}") from None
    if isinstance(version, int) and version > 2:
        raise StoreFromNewerDriver(
            f"checkpoint {snapshot}: it was written by a newer version of the driver (schema {version}; "
            "this version reads 2 and 3). Roll forward to that version, or drain the node's GPU pods and "
            "delete the file to start afresh"
        )
    if version != 2 or checksum != f"sha256:{hashlib.sha256(canonical_json(payload)).hexdigest()}":
        raise ValueError(f"schema {version!r} or its checksum is not that of schema 2")
    try:
        claims = {uid: ClaimRecord.model_validate(r, strict=False) for uid, r in payload["claims"].items()}
        boot_id, generation = str(payload["bootId"]), int(payload["generation"])
    except (ValidationError, ValueError, TypeError, KeyError, AttributeError) as error:
        raise ValueError(f"payload does not match schema 2: {error}") from None
    return boot_id, _replayed(snapshot.with_name(f"{snapshot.name}.log"), generation, claims)


def _replayed(path: Path, generation: int, claims: dict[str, ClaimRecord]) -> dict[str, ClaimRecord]:
    """The claims with the log's entries applied, up to the first torn or out-of-sequence one."""
    try:
        lines = path.read_bytes().split(b"\n")
    except FileNotFoundError:
        return claims
    try:
        header = json.loads(lines[0])
        if header["base"] != generation:
            return claims  # the log continues another snapshot: a compaction's leftover
    except (ValueError, TypeError, KeyError):
        return claims
    for line in lines[1:]:
        try:
            document = json.loads(line)
            body = document["entry"]
            if document["checksum"] != f"sha256:{hashlib.sha256(canonical_json(body)).hexdigest()}":
                break
            if body["generation"] != generation + 1:
                break
            updates = {uid: ClaimRecord.model_validate(r, strict=False) for uid, r in body["set"].items()}
            deleted = [uid for uid in body["delete"] if isinstance(uid, str)]
        except (ValueError, TypeError, KeyError, AttributeError, ValidationError):
            break
        for uid in deleted:
            claims.pop(uid, None)
        claims.update(updates)
        generation += 1
    return claims


def _ledger(directory: Path) -> dict[str, MigRecord]:
    found: dict[str, MigRecord] = {}
    for entry in sorted(directory.glob("MIG-*.json")) if directory.is_dir() else []:
        try:
            mig = MigRecord.model_validate_json(entry.read_bytes())
        except (OSError, ValidationError) as error:
            log.warning("skipping an unreadable MIG ledger entry", file=entry.name, error=str(error))
            continue
        if mig.uuid == entry.name.removesuffix(".json"):
            found[mig.uuid] = mig
    return found


def _orphans(path: Path, boot_id: str) -> list[tuple[str, int, int, int]]:
    """The GPU instances a failed rollback left, of this boot: ``{"bootId", "instances": [{"gpu",
    "profileId", "start", "size"}]}``."""
    try:
        document = json.loads(path.read_bytes())
        if document.get("bootId") != boot_id:
            return []  # MIG instances do not survive a reboot
        return [
            (str(e["gpu"]), int(e["profileId"]), int(e["start"]), int(e["size"]))
            for e in document["instances"]
        ]
    except FileNotFoundError:
        return []
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as error:
        log.warning(
            "skipping the unreadable record of orphaned GPU instances", file=str(path), error=str(error)
        )
        return []
