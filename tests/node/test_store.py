"""The node's store: its schema refuses a second exclusive holder, whichever instance writes;
an earlier boot, a damaged file, a newer schema and the files of schema 2 are handled at open."""

from __future__ import annotations

import json
import sqlite3
import threading
from pathlib import Path

import pytest

from dra_driver.node.records import (
    BootIdUnavailable,
    ClaimRecord,
    DeviceRecord,
    GpuPolicyRecord,
    MigRecord,
    PassthroughRecord,
    Phase,
    SharingRecord,
    SharingState,
    read_boot_id,
)
from dra_driver.node.store import (
    STORE_FILE,
    MutationRejected,
    Progress,
    Release,
    Reserve,
    Store,
    StoreFromNewerDriver,
    StoreWriteError,
    open_store,
)

from .legacy_files import append_log, write_checkpoint, write_ledger_entry

BOOT = "boot-1"


def device(
    name: str, *, admin: bool = False, share: str | None = None, mig: MigRecord | None = None
) -> DeviceRecord:
    return DeviceRecord(
        request="gpu",
        pool="node-a",
        device=name,
        admin_access=admin,
        share_id=share,
        cdi_device_ids=(f"k/c={name}",),
        mig=mig,
    )


def record(attempt: str, *devices: DeviceRecord | str, phase: Phase = "PrepareCompleted") -> ClaimRecord:
    return ClaimRecord(
        namespace="ns",
        name=f"claim-{attempt}",
        phase=phase,
        attempt=attempt,
        devices=tuple(device(d) if isinstance(d, str) else d for d in devices),
    )


def placement(start: int, size: int, parent: str = "gpu-0") -> MigRecord:
    return MigRecord(
        parent_uuid="GPU-0", parent_device=parent, profile_id=9, placement_start=start, placement_size=size
    )


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return open_store(tmp_path / STORE_FILE, BOOT).store


def refused(store: Store, uid: str, claim: ClaimRecord) -> str:
    with pytest.raises(MutationRejected) as rejected:
        store.commit(Reserve(uid, claim))
    assert store.claim(uid) is None, "a refused claim left a record"
    return str(rejected.value)


def test_a_full_gpu_serves_one_claim_and_the_message_names_the_holder(store: Store) -> None:
    store.commit(Reserve("a", record("a", "gpu-2")))
    assert "already prepared for claim ns/claim-a (a)" in refused(store, "b", record("b", "gpu-2"))
    store.commit(Release("a"))
    store.commit(Reserve("b", record("b", "gpu-2")))
    assert set(store.snapshot().claims) == {"b"}


def test_admin_access_never_counts_against_a_device(store: Store) -> None:
    store.commit(Reserve("admin", record("admin", device("gpu-2", admin=True))))
    store.commit(Reserve("work", record("work", "gpu-2")))
    store.commit(Reserve("admin2", record("admin2", device("gpu-2", admin=True))))
    store.commit(Release("admin"))
    assert "already prepared for claim ns/claim-work" in refused(store, "c", record("c", "gpu-2"))


def test_a_full_gpu_and_a_mig_device_on_it_exclude_each_other(store: Store) -> None:
    store.commit(Reserve("mig", record("mig", device("gpu-0-mig-3g40gb-9-4", mig=placement(4, 4)))))
    assert "cannot be prepared whole" in refused(store, "full", record("full", "gpu-0"))
    store.commit(Reserve("other", record("other", device("gpu-0-mig-3g40gb-9-0", mig=placement(0, 4)))))
    assert "overlaps MIG device gpu-0-mig-3g40gb-9-4" in refused(
        store, "in", record("in", device("gpu-0-mig-1g10gb-19-5"))
    )
    store.commit(Release("mig"))
    store.commit(Release("other"))
    store.commit(Reserve("full", record("full", "gpu-0")))
    assert "prepared whole" in refused(
        store, "mig2", record("mig2", device("gpu-0-mig-3g40gb-9-4", mig=placement(4, 4)))
    )


def test_shares_of_a_gpu_and_an_exclusive_hold_of_it_exclude_each_other(store: Store) -> None:
    store.commit(Reserve("s1", record("s1", device("gpu-1", share="a"))))
    store.commit(Reserve("s2", record("s2", device("gpu-1", share="b"))))
    assert "holds a share of gpu-1" in refused(store, "x", record("x", "gpu-1"))
    assert "already prepared" in refused(store, "s3", record("s3", device("gpu-1", share="a")))
    store.commit(Release("s1"))
    store.commit(Release("s2"))
    store.commit(Reserve("x", record("x", "gpu-1")))
    assert "prepared exclusively for claim" in refused(store, "s4", record("s4", device("gpu-1", share="c")))


def test_shares_of_a_gpu_that_together_exceed_its_memory_are_refused(store: Store) -> None:
    def share(name: str, gib: int) -> DeviceRecord:
        sizes = {"share_bytes": gib * 2**30, "gpu_bytes": 80 * 2**30}
        return device("gpu-1", share=name).model_copy(update=sizes)

    store.commit(Reserve("s1", record("s1", share("a", 50))))
    message = refused(store, "s2", record("s2", share("b", 40)))
    assert "the shares of device gpu-1 would use 90Gi of its 80Gi of memory" in message
    assert "ns/claim-s1 (s1)" in message
    store.commit(Reserve("s2", record("s2", share("b", 30))))  # what fits is still given
    store.commit(Release("s1"))
    store.commit(Reserve("s3", record("s3", share("c", 50))))


def passthrough(name: str = "gpu-vfio-0", parent: str = "gpu-0") -> DeviceRecord:
    return DeviceRecord(
        request="gpu",
        pool="node-a",
        device=name,
        cdi_device_ids=(f"k/c={name}",),
        passthrough=PassthroughRecord(parent_device=parent, pci_bus_id="0000:3b:00.0"),
    )


@pytest.mark.parametrize(
    "other",
    [
        pytest.param(device("gpu-0"), id="full"),
        pytest.param(device("gpu-0-mig-1g10gb-19-5"), id="static-mig"),
        pytest.param(device("gpu-0-mig-3g40gb-9-4", mig=placement(4, 4)), id="dynamic-mig"),
        pytest.param(device("gpu-0", share="a"), id="share"),
    ],
)
def test_a_passed_through_gpu_excludes_every_other_use_of_it_and_back(
    store: Store, other: DeviceRecord
) -> None:
    store.commit(Reserve("vm", record("vm", passthrough())))
    message = refused(store, "pod", record("pod", other))
    assert "passed through to a virtual machine (gpu-vfio-0) for claim ns/claim-vm (vm)" in message or (
        other.share_id is not None and "prepared exclusively for claim ns/claim-vm" in message
    )
    assert "already prepared" in refused(store, "vm2", record("vm2", passthrough()))
    store.commit(Reserve("elsewhere", record("elsewhere", "gpu-1")))  # another GPU is free
    store.commit(Release("vm"))
    store.commit(Reserve("pod", record("pod", other)))
    message = refused(store, "vm", record("vm", passthrough()))
    assert "cannot be passed through (gpu-vfio-0): claim ns/claim-pod (pod) holds" in message or (
        other.share_id is not None and "holds a share of gpu-0" in message
    )
    store.commit(Release("pod"))
    store.commit(Reserve("vm", record("vm", passthrough())))


def test_records_are_replaced_only_by_the_attempt_that_saw_them(store: Store) -> None:
    store.commit(Reserve("a", record("first", "gpu-0", phase="PrepareStarted")))
    with pytest.raises(MutationRejected, match="concurrently"):
        store.commit(Reserve("a", record("second", "gpu-0")))
    store.commit(Reserve("a", record("second", "gpu-1"), replaces="first"))
    with pytest.raises(MutationRejected, match="taken over"):
        store.commit(Progress("a", record("first", "gpu-0")))
    store.commit(Release("a", "first"))  # a stale attempt's release changes nothing
    assert store.claim("a") == record("second", "gpu-1")
    store.commit(Reserve("b", record("b", "gpu-0")))  # the replaced record's device was freed


def test_two_instances_see_each_others_claims_and_never_share_a_device(tmp_path: Path) -> None:
    path = tmp_path / STORE_FILE
    first, second = open_store(path, BOOT).store, open_store(path, BOOT).store
    first.commit(Reserve("a", record("a", "gpu-0")))
    assert second.claim("a") == record("a", "gpu-0")
    assert "already prepared" in refused(second, "b", record("b", "gpu-0"))


def test_two_instances_writing_at_once_lose_nothing_and_give_each_device_once(tmp_path: Path) -> None:
    path = tmp_path / STORE_FILE
    open_store(path, BOOT)
    won: dict[str, list[str]] = {"one": [], "two": []}

    def instance(name: str) -> None:
        store = open_store(path, BOOT).store  # its own connection, as another process has
        for i in range(100):
            store.commit(Reserve(f"{name}-{i}", record(f"{name}-{i}", f"own-{name}-{i}")))
            try:
                store.commit(Reserve(f"{name}-x{i}", record(f"{name}-x{i}", f"gpu-{i}")))
                won[name].append(f"gpu-{i}")
            except MutationRejected:
                pass
        store.close()

    threads = [threading.Thread(target=instance, args=(name,)) for name in won]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    claims = open_store(path, BOOT).store.snapshot().claims
    assert {f"{n}-{i}" for n in won for i in range(100)} <= set(claims)
    assert sorted(won["one"] + won["two"]) == sorted(f"gpu-{i}" for i in range(100))  # each GPU once


def test_an_earlier_boots_claims_are_reported_stale_and_dropped(tmp_path: Path) -> None:
    path = tmp_path / STORE_FILE
    store = open_store(path, BOOT).store
    store.commit(Reserve("a", record("a", "gpu-0")))
    store.add_mig_device(placement(0, 1).model_copy(update={"uuid": "MIG-1"}))
    store.update_orphans([("GPU-0", 9, 4, 4)], [])
    opened = open_store(path, "boot-2")
    assert (opened.earlier_boot, opened.stale) == (True, ("a",))
    assert opened.store.snapshot().claims == {}
    assert opened.store.mig_devices() == {}
    assert opened.store.orphans() == []  # GPU instances do not survive a reboot: another's may be there
    assert not open_store(path, "boot-2").earlier_boot


@pytest.mark.parametrize(
    "content", [b"", b"SQLite format 3\x00" + b"\xff" * 200, b"not a database at all" * 100]
)
def test_a_damaged_store_is_moved_aside_and_started_afresh(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / STORE_FILE
    if content:
        path.write_bytes(content)
    else:  # a real store, damaged in its pages
        store = open_store(path, BOOT).store
        for i in range(50):
            store.commit(Reserve(f"c{i}", record(f"c{i}", f"dev-{i}")))
        store.close()
        data = bytearray(path.read_bytes() if path.stat().st_size > 4096 else b"")
        if not data:  # still in the WAL: checkpoint it first
            db = sqlite3.connect(path)
            db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            db.close()
            data = bytearray(path.read_bytes())
        data[4096:8192] = b"\x00\x13" * 2048
        path.write_bytes(bytes(data))
    opened = open_store(path, BOOT)
    assert opened.moved_aside is not None
    assert opened.moved_aside.exists()
    assert opened.store.snapshot().claims == {}
    opened.store.commit(Reserve("a", record("a", "gpu-0")))


def test_a_store_of_a_newer_schema_is_refused_and_left_alone(tmp_path: Path) -> None:
    path = tmp_path / STORE_FILE
    open_store(path, BOOT).store.close()
    db = sqlite3.connect(path)
    db.execute("PRAGMA user_version = 99")
    db.close()
    with pytest.raises(StoreFromNewerDriver, match="schema 99"):
        open_store(path, BOOT)
    assert sqlite3.connect(path).execute("PRAGMA user_version").fetchone()[0] == 99


@pytest.mark.parametrize("content", [None, ""])
def test_a_missing_or_empty_boot_id_refuses_to_start(tmp_path: Path, content: str | None) -> None:
    path = tmp_path / "boot_id"
    if content is not None:
        path.write_text(content)
    with pytest.raises(BootIdUnavailable, match="boot id"):
        read_boot_id(path)


# --- the upgrade from schema 2 ------------------------------------------------------------------


def test_a_schema_2_checkpoint_its_log_and_ledger_are_imported_once_and_moved_aside(tmp_path: Path) -> None:
    mig = placement(0, 4, parent="gpu-2").model_copy(update={"uuid": "MIG-abc"})
    write_checkpoint(
        tmp_path / "checkpoint.json",
        BOOT,
        {"a": record("a", "gpu-0"), "b": record("b", "gpu-1")},
        generation=7,
    )
    append_log(
        tmp_path / "checkpoint.json",
        7,
        [({"c": record("c", device("gpu-2-mig-3g40gb-9-0", mig=mig))}, ["b"])],
    )
    write_ledger_entry(tmp_path, mig)
    orphan = {"gpu": "GPU-1", "profileId": 9, "start": 4, "size": 4}
    (tmp_path / "nvml-orphaned-gpu-instances.json").write_text(
        json.dumps({"bootId": BOOT, "instances": [orphan]})
    )

    store = open_store(tmp_path / STORE_FILE, BOOT).store

    assert set(store.snapshot().claims) == {"a", "c"}
    assert store.mig_devices() == {"MIG-abc": mig}
    assert store.orphans() == [("GPU-1", 9, 4, 4)]
    assert "already prepared" in refused(store, "x", record("x", "gpu-0"))
    assert sorted(p.name for p in tmp_path.glob("*.imported")) == [
        "checkpoint.json.imported",
        "checkpoint.json.log.imported",
        "mig-devices.imported",
        "nvml-orphaned-gpu-instances.json.imported",
    ]
    store.commit(Release("a"))
    assert set(open_store(tmp_path / STORE_FILE, BOOT).store.snapshot().claims) == {"c"}  # not imported again


def test_a_schema_2_checkpoint_of_an_earlier_boot_reports_its_claims_stale(tmp_path: Path) -> None:
    write_checkpoint(tmp_path / "checkpoint.json", "boot-0", {"a": record("a", "gpu-0")})
    opened = open_store(tmp_path / STORE_FILE, BOOT)
    assert (opened.earlier_boot, opened.stale, opened.store.snapshot().claims) == (True, ("a",), {})


def test_a_checkpoint_of_a_newer_schema_is_refused_and_left_alone(tmp_path: Path) -> None:
    write_checkpoint(tmp_path / "checkpoint.json", BOOT, {}, version=3)
    with pytest.raises(StoreFromNewerDriver, match="newer version"):
        open_store(tmp_path / STORE_FILE, BOOT)
    assert (tmp_path / "checkpoint.json").exists()
    with pytest.raises(StoreFromNewerDriver):  # and again at the next start
        open_store(tmp_path / STORE_FILE, BOOT)


def test_a_full_disk_fails_the_change_alone_and_says_so(store: Store) -> None:
    store.commit(Reserve("a", record("a", "gpu-0")))
    (pages,) = store._db.execute("PRAGMA page_count").fetchone()
    store._db.execute(f"PRAGMA max_page_count = {pages}")  # the file may grow no more: SQLITE_FULL
    many = record("b", *(f"dev-{i}" for i in range(400)))
    with pytest.raises(StoreWriteError, match="No space left on device"):
        store.commit(Reserve("b", many))
    assert set(store.snapshot().claims) == {"a"}
    store._db.execute("PRAGMA max_page_count = 1073741823")
    store.commit(Reserve("b", many))  # space again: the retry goes through


async def test_on_the_event_loop_the_log_is_copied_into_the_file_by_a_worker_thread(tmp_path: Path) -> None:
    store = open_store(tmp_path / STORE_FILE, BOOT).store
    committed = 0
    while store._checkpointing is None:  # commit until a checkpoint's worth has been made
        store.commit(Reserve(f"c{committed}", record(f"c{committed}", f"dev-{committed}")))
        committed += 1
    assert committed < 250
    await store._checkpointing

    # The file alone (immutable: its write-ahead log unread) has every claim committed before the
    # checkpoint; without one it would have none. No commit runs beside the checkpoint here: one
    # that did would leave the file behind its log, which only the log's own readers may see.
    main_only = sqlite3.connect(f"{(tmp_path / STORE_FILE).as_uri()}?immutable=1", uri=True)
    (count,) = main_only.execute("SELECT count(*) FROM claims").fetchone()
    assert count == committed


_SCHEMA_3 = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL) STRICT;
CREATE TABLE claims (uid TEXT PRIMARY KEY, namespace TEXT NOT NULL, name TEXT NOT NULL, phase TEXT NOT NULL,
    attempt TEXT NOT NULL, record TEXT NOT NULL) STRICT, WITHOUT ROWID;
CREATE TABLE holds (pool TEXT NOT NULL, gpu TEXT NOT NULL, unit TEXT NOT NULL, uid TEXT NOT NULL,
    device TEXT NOT NULL, shared INTEGER NOT NULL, mig_uuid TEXT, PRIMARY KEY (pool, gpu, unit))
    STRICT, WITHOUT ROWID;
CREATE TABLE mig_devices (uuid TEXT PRIMARY KEY, record TEXT NOT NULL) STRICT, WITHOUT ROWID;
"""


def test_a_schema_3_store_gets_the_sharing_and_orphan_tables_and_keeps_its_claims(tmp_path: Path) -> None:
    setting = GpuPolicyRecord(
        gpu_uuid="GPU-2",
        compute_mode="Default",
        time_slice="Long",
        previous_compute_mode="Default",
        previous_time_slice="Default",
    )
    sliced = record("a", "gpu-2").model_copy(
        update={"sharing": SharingRecord(gpus=(setting,), mps_daemon="d")}
    )
    db = sqlite3.connect(tmp_path / STORE_FILE)
    db.executescript(_SCHEMA_3)
    db.execute("INSERT INTO meta VALUES ('boot_id', ?)", (BOOT,))
    db.execute(
        "INSERT INTO claims VALUES ('a', 'ns', 'claim-a', 'PrepareCompleted', 'a', ?)",
        (sliced.model_dump_json(by_alias=True),),
    )
    db.executemany(
        "INSERT INTO holds VALUES ('node-a', 'gpu-2', ?, 'a', 'gpu-2', 0, NULL)",
        [(f"slice:{i}",) for i in range(8)],
    )
    db.execute("PRAGMA user_version = 3")
    db.commit()
    db.close()

    store = open_store(tmp_path / STORE_FILE, BOOT).store

    assert store.claim("a") == sliced
    assert store.sharing().gpus == {"GPU-2": {"a": ("ns/claim-a (a)", setting)}}
    assert store.sharing().daemons == {"d": {"a"}}
    assert "already prepared for claim ns/claim-a (a)" in refused(store, "b", record("b", "gpu-2"))
    store.commit(Release("a"))
    assert store.sharing() == SharingState()
    assert store.orphans() == []
    assert store.domain_claims() == []  # and on to schema 5


def test_orphaned_gpu_instances_are_changed_row_by_row_so_two_instances_keep_each_others(
    tmp_path: Path,
) -> None:
    path = tmp_path / STORE_FILE
    first, second = open_store(path, BOOT).store, open_store(path, BOOT).store
    first.update_orphans([("GPU-0", 9, 4, 4)], [])
    second.update_orphans([("GPU-1", 14, 0, 2)], [])
    assert first.orphans() == [("GPU-0", 9, 4, 4), ("GPU-1", 14, 0, 2)]
    first.update_orphans([], [("GPU-0", 9, 4, 4)])  # destroyed once NVML answered
    assert second.orphans() == [("GPU-1", 14, 0, 2)]
