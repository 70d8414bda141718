"""Files of the schema-2 checkpoint that versions before the store wrote, for the upgrade tests."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from dra_driver.node.legacy import canonical_json
from dra_driver.node.records import ClaimRecord, MigRecord


def write_checkpoint(
    path: Path, boot_id: str, claims: dict[str, ClaimRecord], *, generation: int = 1, version: int = 2
) -> None:
    """``checkpoint.json`` as schema 2 wrote it: checksummed payload, records by their JSON aliases."""
    payload = {
        "bootId": boot_id,
        "generation": generation,
        "claims": {
            uid: r.model_dump(mode="json", by_alias=True, exclude_none=False) for uid, r in claims.items()
        },
    }
    digest = hashlib.sha256(canonical_json(payload)).hexdigest()
    document = {"schemaVersion": version, "checksum": f"sha256:{digest}", "payload": payload}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=1, sort_keys=True) + "\n")


def append_log(path: Path, base: int, entries: list[tuple[dict[str, ClaimRecord], list[str]]]) -> None:
    """``checkpoint.json.log``: a header, then one checksummed entry per commit after ``base``."""
    lines = [json.dumps({"base": base, "epoch": "e0"}, sort_keys=True).encode()]
    for generation, (changed, deleted) in enumerate(entries, start=base + 1):
        body = {
            "generation": generation,
            "set": {uid: r.model_dump(mode="json", by_alias=True) for uid, r in changed.items()},
            "delete": deleted,
        }
        digest = hashlib.sha256(canonical_json(body)).hexdigest()
        lines.append(canonical_json({"checksum": f"sha256:{digest}", "entry": body}))
    path.with_name(path.name + ".log").write_bytes(b"\n".join(lines) + b"\n")


def write_ledger_entry(state_dir: Path, mig: MigRecord) -> None:
    """``mig-devices/<uuid>.json``: one MIG device the driver created."""
    (state_dir / "mig-devices").mkdir(parents=True, exist_ok=True)
    (state_dir / "mig-devices" / f"{mig.uuid}.json").write_text(mig.model_dump_json(by_alias=True))
