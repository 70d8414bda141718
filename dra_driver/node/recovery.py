"""Bringing the node's store up to date with what is on the node, at every start.

After a reboot nothing prepared survives, so the claims of the old boot are dropped
and every CDI spec of ours is removed (``/etc/cdi`` would keep them across a reboot).

After the store was lost or damaged the CDI specs on disk are the evidence: a
spec exists from the moment a prepare starts writing until its unprepare succeeds,
because unprepare removes the spec *before* it answers the kubelet. And the kubelet
unprepares every claim it ever asked us to prepare (it keeps its own checkpoint and
retries from a 60 s reconcile loop). So each spec on disk is a claim the kubelet
still considers prepared, and will unprepare. Each is re-recorded as ``Recovered``
with all that its prepare recorded and the spec tells (each device, its share id, its
admin access: ``DRA_GPU_ADMIN_ACCESS_<DEVICE>=true``, the MIG device the driver made
for it), which keeps those devices reserved until the kubelet's unprepare (or a
repeated prepare) replaces the record. It is inserted through the store's
constraint-checked path, like a prepare, oldest spec first: two specs that claim one
device are a conflict, logged naming both claims and reported as a Warning Event on
the Node (:mod:`dra_driver.node.events`), and the younger is not recorded, never
written over the older. No API call is
needed, nor possible: the spec's file name holds only the claim uid, and asking the
API server cannot tell more than the kubelet will. A spec that cannot be read is
removed: no runtime could use it either. A spec another plugin instance holds locked
(a rolling update: its prepare has written the spec and not yet committed the record)
is that instance's, and is left to it.

MIG devices the driver created for claims (dynamic MIG) are compared with the ones
alive on the GPUs, which survive a restart of the plugin but not a reboot:

* a record that names a MIG device the GPU no longer has (an administrator destroyed
  it, or reset the GPU) is not repaired by creating a new one behind the
  administrator's back: the record goes back to PrepareStarted without the uuid and
  its CDI spec is removed (it names a device that is gone). The claim keeps its
  reservation; the kubelet's next prepare of it creates the device afresh, its
  unprepare has nothing to destroy.
* a record in PrepareStarted whose MIG device has no uuid yet is what a crash
  between creating the device and recording it leaves. A live device of exactly that
  profile at exactly that placement on that GPU, recorded for no claim, is that
  device: it is adopted (its uuid recorded), so the kubelet's next prepare uses it and
  its unprepare destroys it. Nothing is destroyed at start: an instance recorded for
  no claim and at no recorded placement was made by an administrator (static MIG).

After a lost record the store's table of MIG devices tells which live ones the driver
created. A claim rebuilt from its CDI spec gets the MIG data of each of its devices the
table names (the spec names the MIG uuid in ``DRA_GPU_UUID_<DEVICE>``), so the full
GPU stays excluded while the claim holds a partition of it, and the claim's unprepare
destroys the device. A MIG device that neither the table names, nor a record, is an
administrator's (static MIG) and is never destroyed. The table forgets devices that
are gone, and devices a record names but the table lacks are added. A lost store
loses the table too: then the spec itself says which MIG devices the driver made for
the claim (``DRA_GPU_MIG_CREATED_<DEVICE>=true``), and the live device with the spec's
uuid is recorded as the claim's again, so its unprepare still destroys it.

A passthrough device's spec names its GPU and PCI address
(``DRA_GPU_PASSTHROUGH_<DEVICE>=gpu-0,0000:3b:00.0``): the rebuilt record holds the GPU and
its MIG placements as the prepare did, and the claim's unprepare binds the GPU back to nvidia.
Prepare writes that spec before the GPU leaves nvidia, so a lost store forgets no GPU the driver
moved. Then :func:`repair_passthrough` gives back to nvidia each GPU that no prepared claim has
on vfio-pci: what a prepare that died between the move and its completed record leaves, or an
unprepare that died half-way through the move back.

Temporary files that crashed writes left in the CDI directory are removed here too.

Runs in a worker thread at start-up, before the kubelet's calls are served: these
are blocking calls. Each change is one transaction of its own.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import structlog

from dra_driver.cdi.spec import device_of_cdi_name, uuid_env_name
from dra_driver.cdi.store import SpecStore
from dra_driver.devices.pci import NVIDIA, VFIO_PCI, PciBus, PciError
from dra_driver.devices.types import MigDevice
from dra_driver.node.plan import admin_access_env, mig_created_env, passthrough_env_name
from dra_driver.node.records import ClaimRecord, DeviceRecord, MigRecord, MutationRejected, PassthroughRecord
from dra_driver.node.store import Opened, Progress, Reserve, Store

log = structlog.get_logger(__name__)


CONFLICT_ADVICE = "delete the pod of one of the two claims; its unprepare removes its spec"


@dataclass(frozen=True)
class Conflict:
    """A claim rebuilt from its CDI spec that the store refused: ``holder`` holds its device."""

    uid: str
    holder: str
    reason: str


def recover(
    opened: Opened, specs: SpecStore, pool: str, live_mig_devices: Callable[[], Sequence[MigDevice]]
) -> list[Conflict]:
    """Bring the store up to date; ``live_mig_devices`` reads the MIG devices the GPUs have now.

    The conflicts are for an operator: the caller reports each as a Kubernetes Event.
    """
    store = opened.store
    conflicts: list[Conflict] = []
    specs.remove_leftover_temps()
    if opened.earlier_boot:
        for uid in sorted(set(opened.stale) | specs.claim_uids()):
            specs.remove(uid)
        log.info("cleared the claims of an earlier boot", claims=len(opened.stale))
        return conflicts
    state = store.snapshot()
    recorded_mig = any(device.mig for record in state.claims.values() for device in record.devices)
    # Reading the GPUs costs a little; a node that never created a MIG device need not.
    entries = store.mig_devices()
    unrecorded_specs = specs.claim_uids() - set(state.claims)
    live = live_mig_devices() if recorded_mig or entries or unrecorded_specs else ()
    alive = {m.uuid for m in live}
    for uuid in set(entries) - alive:
        store.remove_mig_device(uuid)
    ours = {uuid: mig for uuid, mig in entries.items() if uuid in alive}
    if recorded_mig:
        _repair_mig_devices(store, state.claims, live, specs)
        for record in store.snapshot().claims.values():
            for device in record.devices:
                if device.mig is not None and device.mig.uuid is not None and device.mig.uuid not in ours:
                    store.add_mig_device(device.mig)
                    ours[device.mig.uuid] = device.mig
    # A spec without a record: the store was lost or damaged, or a crash came between the two.
    # Oldest spec first: should two hold one device, the claim prepared first keeps it.
    for uid in sorted(unrecorded_specs, key=lambda u: (_written(specs, u), u)):
        if specs.held_by_a_writer(uid) or store.claim(uid) is not None:
            # Another instance (rolling update) is between the spec and its record, or has just
            # committed it: not a crash's.
            log.info("left the CDI spec of a live prepare to its plugin instance", claim_uid=uid)
            continue
        rebuilt = _recovered(uid, specs, pool, ours, live)
        if rebuilt is None:
            specs.remove(uid)
            continue
        try:
            store.commit(Reserve(uid, rebuilt))
        except MutationRejected as refused:
            log.error(
                "two claims hold one device; the younger one is not recorded",
                claim_uid=uid,
                held_by=refused.holder,
                conflict=str(refused),
                what_to_do=CONFLICT_ADVICE,
            )
            conflicts.append(Conflict(uid, refused.holder or "", str(refused)))
            continue
        for device in rebuilt.devices:
            if device.mig is not None and device.mig.uuid is not None and device.mig.uuid not in ours:
                store.add_mig_device(device.mig)
                ours[device.mig.uuid] = device.mig
        log.info(
            "recovered a prepared claim from its CDI spec",
            claim_uid=uid,
            devices=[d.device for d in rebuilt.devices],
            admin_access=[d.device for d in rebuilt.devices if d.admin_access],
        )
    claimed = {d.mig.uuid for r in store.snapshot().claims.values() for d in r.devices if d.mig is not None}
    if unclaimed := sorted(set(ours) - claimed):
        log.warning(
            "MIG devices the driver created for prepares that never finished are kept as static devices",
            mig_uuids=unclaimed,
            what_to_do="destroy those no workload uses (nvidia-smi mig -dci, -dgi)",
        )
    return conflicts


def _written(specs: SpecStore, uid: str) -> int:
    try:
        return specs.path_for(uid).stat().st_mtime_ns
    except OSError:
        return 0


def _recovered(
    uid: str, specs: SpecStore, pool: str, ours: dict[str, MigRecord], live: Sequence[MigDevice]
) -> ClaimRecord | None:
    """The claim as its spec describes it; None (after logging why) when the spec is unusable."""
    try:
        spec = specs.read(uid)
    except (ValueError, OSError) as error:
        log.warning("removing an unreadable CDI spec", claim_uid=uid, error=str(error))
        return None
    kind = spec.get("kind") if spec else None
    entries = spec.get("devices") if spec else None
    named = [e for e in entries if isinstance(e, dict)] if isinstance(entries, list) else []
    devices = tuple(
        DeviceRecord(
            request="",
            pool=pool,
            device=device,
            admin_access=_env(entry, admin_access_env(device)[0][0]) == "true",
            share_id=share_id,  # a share keeps only its share reserved
            cdi_device_ids=(f"{kind}={name}",),
            mig=ours.get(uuid := _env(entry, uuid_env_name(device)))
            or _created_for_the_claim(entry, device, uuid, live),
            passthrough=_passed_through(entry, device),
        )
        for entry in named
        if isinstance(name := entry.get("name"), str)
        and (parsed := device_of_cdi_name(uid, name)) is not None
        for device, share_id in [parsed]
    )
    if not isinstance(kind, str) or not devices:
        log.warning("removing a CDI spec that names no device of its claim", claim_uid=uid)
        return None
    return ClaimRecord(
        namespace="", name="", phase="Recovered", attempt=secrets.token_hex(8), devices=devices
    )


def _created_for_the_claim(
    entry: dict[str, object], device: str, uuid: str, live: Sequence[MigDevice]
) -> MigRecord | None:
    """The MIG device the driver made for the claim, when its table was lost with the store.

    The spec says the driver created it (``DRA_GPU_MIG_CREATED_<DEVICE>``); the live device
    with the spec's uuid gives the rest, so the claim's unprepare destroys it.
    """
    if _env(entry, mig_created_env(device)[0][0]) != "true":
        return None
    made = next((m for m in live if m.uuid == uuid), None)
    if made is None:
        return None
    return MigRecord(
        parent_uuid=made.parent_uuid,
        parent_device=device.split("-mig-")[0],
        profile_id=made.profile_id,
        placement_start=made.placement.start,
        placement_size=made.placement.size,
        uuid=made.uuid,
    )


def _passed_through(entry: dict[str, object], device: str) -> PassthroughRecord | None:
    """The GPU a passthrough device's spec names (``DRA_GPU_PASSTHROUGH_<DEVICE>=<gpu>,<address>``)."""
    parent, _, address = _env(entry, passthrough_env_name(device)).partition(",")
    if not (parent and address):
        return None
    return PassthroughRecord(parent_device=parent, pci_bus_id=address)


def _env(entry: dict[str, object], name: str) -> str:
    """The value the spec gives the container for ``name``, or ""."""
    edits = entry.get("containerEdits")
    env = edits.get("env") if isinstance(edits, dict) else None
    wanted = name + "="
    for variable in env if isinstance(env, list) else []:
        if isinstance(variable, str) and variable.startswith(wanted):
            return variable[len(wanted) :]
    return ""


def _repair_mig_devices(
    store: Store, claims: dict[str, ClaimRecord], live: Sequence[MigDevice], specs: SpecStore
) -> None:
    """The records repaired against the MIG devices alive now (see the module doc)."""
    alive = {m.uuid for m in live}
    recorded = {d.mig.uuid for r in claims.values() for d in r.devices if d.mig and d.mig.uuid}
    unrecorded = [m for m in live if m.uuid not in recorded]
    for uid, record in claims.items():
        devices: list[DeviceRecord] = []
        adopted: dict[str, str] = {}  # device name -> uuid; results that share a device share it
        lost = False
        for device in record.devices:
            mig = device.mig
            if mig is not None and mig.uuid is not None and mig.uuid not in alive:
                log.warning(
                    "a recorded MIG device is gone", claim_uid=uid, device=device.device, mig_uuid=mig.uuid
                )
                mig, lost = mig.model_copy(update={"uuid": None}), True
            elif mig is not None and mig.uuid is None:
                if device.device not in adopted and (found := _at_placement(unrecorded, mig)):
                    unrecorded.remove(found)
                    adopted[device.device] = found.uuid
                    log.info(
                        "adopted a MIG device created before a crash",
                        claim_uid=uid,
                        device=device.device,
                        mig_uuid=found.uuid,
                    )
                if device.device in adopted:
                    mig = mig.model_copy(update={"uuid": adopted[device.device]})
            devices.append(device.model_copy(update={"mig": mig}))
        update: dict[str, object] = {"devices": tuple(devices)}
        if lost:
            specs.remove(uid)
            update["phase"] = "PrepareStarted"
        repaired = record.model_copy(update=update)
        if repaired != record:
            store.commit(Progress(uid, repaired))


def _at_placement(candidates: Sequence[MigDevice], mig: MigRecord) -> MigDevice | None:
    return next(
        (
            m
            for m in candidates
            if m.parent_uuid == mig.parent_uuid
            and m.profile_id == mig.profile_id
            and (m.placement.start, m.placement.size) == (mig.placement_start, mig.placement_size)
        ),
        None,
    )


def repair_passthrough(store: Store, specs: SpecStore, pci: Callable[[], PciBus]) -> int:
    """Bind back to nvidia the GPUs that claims hold off it but are not prepared on; how many went.

    A GPU on vfio-pci under a record in PrepareStarted (its prepare died after the move, before the
    record was complete: no container was given it), or bound to no driver at all (a move died
    half-way), serves nobody and is gone from NVML's view: back on nvidia it is published again,
    while the record keeps it reserved for the kubelet's retry (which moves it again) or unprepare.
    A GPU on vfio-pci whose claim is prepared, or rebuilt from its spec (the kubelet may have been
    told), stays. One whose spec a live plugin instance holds (a rolling update: its prepare or
    unprepare is under way) is left to that instance. A GPU no record names is an administrator's.
    """
    held = {
        uid: [d.passthrough.pci_bus_id for d in record.devices if d.passthrough is not None]
        for uid, record in store.snapshot().claims.items()
    }
    if not any(held.values()):
        return 0  # the PCI bus is not read on a node that passes nothing through
    bus = pci()
    repaired = 0
    for uid, addresses in held.items():
        record = store.claim(uid)
        if record is None or not addresses or specs.held_by_a_writer(uid):
            continue
        prepared = record.phase in ("PrepareCompleted", "Recovered")
        for address in addresses:
            driver = bus.driver(address)
            if driver == NVIDIA or (driver == VFIO_PCI and prepared):
                continue
            try:
                bus.bind_nvidia(address)
            except PciError as error:
                log.error(
                    "a GPU no prepared claim uses could not be given back to nvidia",
                    claim_uid=uid,
                    pci_bus_id=address,
                    error=str(error),
                    what_to_do="the claim's unprepare tries again; or bind it by hand "
                    f"(echo {address} > /sys/bus/pci/drivers/{NVIDIA}/bind)",
                )
                continue
            repaired += 1
            log.info(
                "gave back to nvidia a GPU that a prepare or unprepare left off it",
                claim_uid=uid,
                pci_bus_id=address,
                was_on=driver or "no driver",
                phase=record.phase,
            )
    return repaired
