"""Turning what the checkpoint load found into the state to start from.

After a reboot nothing prepared survives, so the claims of the old boot are dropped
and every CDI spec of ours is removed (``/etc/cdi`` would keep them across a reboot).

After the checkpoint was lost or damaged the CDI specs on disk are the evidence: a
spec exists from the moment a prepare starts writing until its unprepare succeeds,
because unprepare removes the spec *before* it answers the kubelet. And the kubelet
unprepares every claim it ever asked us to prepare (it keeps its own checkpoint and
retries from a 60 s reconcile loop). So each spec on disk is a claim the kubelet
still considers prepared, and will unprepare. Each is re-recorded as ``Recovered``
with the devices the spec names, which keeps those devices reserved until the
kubelet's unprepare (or a repeated prepare) replaces the record. No API call is
needed, nor possible: the spec's file name holds only the claim uid, and asking the
API server cannot tell more than the kubelet will. A spec that cannot be read is
removed: no runtime could use it either.

Runs under the checkpoint's file lock, in a worker thread: these are blocking calls.
"""

from __future__ import annotations

import secrets

import structlog

from dra_driver.cdi.store import SpecStore
from dra_driver.node.checkpoint import Checkpoint, ClaimRecord, DeviceRecord, LoadedCheckpoint

log = structlog.get_logger(__name__)


def starting_state(loaded: LoadedCheckpoint, specs: SpecStore, pool: str) -> Checkpoint:
    if loaded.stale:
        for uid in sorted(set(loaded.stale) | specs.claim_uids()):
            specs.remove(uid)
        log.info("cleared the claims of an earlier boot", claims=len(loaded.stale))
        return loaded.checkpoint
    if loaded.moved_aside is None:
        return loaded.checkpoint
    claims = dict(loaded.checkpoint.claims)
    for uid in sorted(specs.claim_uids() - set(claims)):
        record = _recovered(uid, specs, pool)
        if record is None:
            specs.remove(uid)
            continue
        claims[uid] = record
        log.info(
            "recovered a prepared claim from its CDI spec",
            claim_uid=uid,
            devices=[d.device for d in record.devices],
        )
    return loaded.checkpoint.model_copy(update={"claims": claims})


def _recovered(uid: str, specs: SpecStore, pool: str) -> ClaimRecord | None:
    """The claim as its spec describes it; None (after logging why) when the spec is unusable."""
    try:
        spec = specs.read(uid)
    except (ValueError, OSError) as error:
        log.warning("removing an unreadable CDI spec", claim_uid=uid, error=str(error))
        return None
    kind = spec.get("kind") if spec else None
    entries = spec.get("devices") if spec else None
    prefix = f"{uid}-"
    names = [e.get("name") for e in entries if isinstance(e, dict)] if isinstance(entries, list) else []
    devices = tuple(
        DeviceRecord(request="", pool=pool, device=name[len(prefix) :], cdi_device_ids=(f"{kind}={name}",))
        for name in names
        if isinstance(name, str) and name.startswith(prefix)
    )
    if not isinstance(kind, str) or not devices:
        log.warning("removing a CDI spec that names no device of its claim", claim_uid=uid)
        return None
    return ClaimRecord(
        namespace="", name="", phase="Recovered", attempt=secrets.token_hex(8), devices=devices
    )
