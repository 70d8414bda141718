"""``dra-driver state``: what the node's store holds, for an operator, read-only.

It opens ``state.db`` in the plugin's data directory read-only, so it works beside a running
plugin (the store's write-ahead log lets a reader see the last committed state without
waiting for, or blocking, a writer) and on a stopped one. It prints the prepared claims and
their devices, the MIG devices the driver created, the MPS control daemons the claims use,
the GPU compute modes and time slices that their unprepare puts back, the GPU instances a
failed rollback left, and the compute-domain driver's channel and daemon claims (each a table
of the store, read in one query): as tables, or as one JSON document with ``-o json`` (for
scripts and bug reports).
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

from dra_driver.errors import StartupError
from dra_driver.node.records import ClaimRecord, MigRecord
from dra_driver.node.store import STORE_FILE, open_read_only


def read(data_dir: Path) -> dict[str, Any]:
    """The store's content as a JSON-ready document; :class:`StartupError` when there is none."""
    path = data_dir / STORE_FILE
    if not path.exists():
        raise StartupError(
            f"no store at {path}: the plugin has not started on this node, or --data-dir / DRA_DATA_DIR "
            "points elsewhere"
        )
    try:
        store = open_read_only(path)
        try:
            state, migs, orphans = store.snapshot(), store.mig_devices(), store.orphans()
            domain_claims = store.domain_claims()
        finally:
            store.close()
    except sqlite3.Error as error:
        raise StartupError(f"cannot read the store {path}: {error}") from None
    return {
        "store": str(path),
        "bootId": state.boot_id,
        "claims": [_claim(uid, record) for uid, record in state.claims.items()],
        "migDevices": [_mig(mig) for mig in migs.values()],
        "mpsDaemons": [
            {"id": d, "claims": sorted(uids)} for d, uids in sorted(state.sharing.daemons.items())
        ],
        "computeModesToRestore": [
            {
                "gpuUuid": gpu,
                "computeMode": next(iter(claims.values()))[1].previous_compute_mode,
                "timeSlice": next(iter(claims.values()))[1].previous_time_slice,
                "claims": list(claims),
            }
            for gpu, claims in sorted(state.sharing.gpus.items())
        ],
        "orphanedGpuInstances": [
            {"gpuUuid": gpu, "profileId": profile, "placementStart": start, "placementSize": size}
            for gpu, profile, start, size in orphans
        ],
        "computeDomainClaims": [
            {
                "uid": c.uid,
                "namespace": c.namespace,
                "name": c.name,
                "phase": c.phase,
                "kind": c.kind,
                "device": c.device,
                "computeDomainUid": c.domain_uid,
                "allocationMode": c.allocation_mode,
            }
            for c in domain_claims
        ],
    }


def render(document: dict[str, Any], output: str) -> str:
    if output == "json":
        return json.dumps(document, indent=2, sort_keys=True)
    parts = [f"store {document['store']} (boot {document['bootId']})"]
    parts.append(
        _table(
            ("CLAIM", "UID", "PHASE", "DEVICES"),
            [
                (
                    f"{c['namespace']}/{c['name']}" if c["namespace"] else "(recovered from its CDI spec)",
                    c["uid"],
                    c["phase"] + (" (ahead of binding)" if c["aheadOfBinding"] else ""),
                    ", ".join(_device_text(d) for d in c["devices"]),
                )
                for c in document["claims"]
            ],
            "no prepared claims",
        )
    )
    parts.append(
        _table(
            ("MIG DEVICE (CREATED BY THE DRIVER)", "GPU", "PROFILE ID", "PLACEMENT"),
            [
                (
                    m["uuid"],
                    m["parentDevice"],
                    str(m["profileId"]),
                    f"{m['placementStart']}+{m['placementSize']}",
                )
                for m in document["migDevices"]
            ],
            "no MIG devices created by the driver",
        )
    )
    parts.append(
        _table(
            ("MPS DAEMON", "CLAIMS"),
            [(d["id"], ", ".join(d["claims"])) for d in document["mpsDaemons"]],
            "no MPS daemons",
        )
    )
    parts.append(
        _table(
            ("GPU", "RESTORE COMPUTE MODE", "RESTORE TIME SLICE", "SET BY CLAIMS"),
            [
                (r["gpuUuid"], r["computeMode"], r["timeSlice"], ", ".join(r["claims"]))
                for r in document["computeModesToRestore"]
            ],
            "no compute modes to restore",
        )
    )
    parts.append(
        _table(
            ("GPU INSTANCE LEFT BY A FAILED ROLLBACK", "PROFILE ID", "PLACEMENT"),
            [
                (o["gpuUuid"], str(o["profileId"]), f"{o['placementStart']}+{o['placementSize']}")
                for o in document["orphanedGpuInstances"]
            ],
            "no GPU instances left by a failed rollback",
        )
    )
    parts.append(
        _table(
            ("COMPUTE-DOMAIN CLAIM", "UID", "PHASE", "DEVICE", "COMPUTE DOMAIN"),
            [
                (
                    f"{c['namespace']}/{c['name']}" if c["namespace"] else "(recovered from its CDI spec)",
                    c["uid"],
                    c["phase"],
                    c["device"] + (f" (allocationMode {c['allocationMode']})" if c["allocationMode"] else ""),
                    c["computeDomainUid"] or "(unknown: recovered)",
                )
                for c in document["computeDomainClaims"]
            ],
            "no compute-domain claims",
        )
    )
    return "\n\n".join(parts)


def _claim(uid: str, record: ClaimRecord) -> dict[str, Any]:
    return {
        "uid": uid,
        "namespace": record.namespace,
        "name": record.name,
        "phase": record.phase,
        # Prepared before its pod was bound (binding conditions); the kubelet has not asked yet.
        "aheadOfBinding": record.ahead_of_binding,
        "devices": [
            d.model_dump(mode="json", by_alias=True, exclude={"cdi_device_ids"}) for d in record.devices
        ],
    }


def _mig(mig: MigRecord) -> dict[str, Any]:
    return mig.model_dump(mode="json", by_alias=True)


def _device_text(device: dict[str, Any]) -> str:
    notes = []
    if device.get("adminAccess"):
        notes.append("admin access")
    if device.get("shareId"):
        notes.append(f"share {device['shareId']}")
    if mig := device.get("mig"):
        notes.append(f"created {mig['uuid']}" if mig.get("uuid") else "to be created")
    return f"{device['device']} ({', '.join(notes)})" if notes else device["device"]


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]], empty: str) -> str:
    if not rows:
        return empty
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in [header, *rows]
    )
