"""Group commit, conflict rules and two plugin instances sharing one checkpoint file."""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import sys
import threading
from pathlib import Path

import pytest

from dra_driver.node import checkpoint as ckpt
from dra_driver.node import checkpoint_log as ckpt_log
from dra_driver.node import journal as journal_module
from dra_driver.node.checkpoint import Checkpoint, ClaimRecord, DeviceRecord, LoadedCheckpoint, Phase
from dra_driver.node.checkpoint_log import LogEntry, read_state
from dra_driver.node.journal import CheckpointWriteError, Journal
from dra_driver.node.state import Complete, MutationRejected, Release, Reserve

BOOT = "boot-1"


def as_loaded(loaded: LoadedCheckpoint) -> Checkpoint:
    return loaded.checkpoint


def record(attempt: str, *devices: str, admin: bool = False, phase: Phase = "PrepareStarted") -> ClaimRecord:
    return ClaimRecord(
        namespace="ns",
        name=f"claim-{attempt}",
        phase=phase,
        attempt=attempt,
        devices=tuple(
            DeviceRecord(
                request="gpu", pool="node-a", device=d, admin_access=admin, cdi_device_ids=(f"k/c={d}",)
            )
            for d in devices
        ),
    )


async def opened(path: Path) -> Journal:
    journal = Journal(path)
    await journal.open(BOOT, as_loaded)
    return journal


@pytest.fixture
def writes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts checkpoint writes (each is one write call): the number of claims each one changes."""
    counted: list[int] = []
    real_encode = ckpt_log.encode_entry

    def counting_encode(entry: LogEntry) -> bytes:
        counted.append(len(entry.set) + len(entry.delete))
        return real_encode(entry)

    monkeypatch.setattr(ckpt_log, "encode_entry", counting_encode)
    return counted


async def test_concurrent_commits_share_one_write(tmp_path: Path, writes: list[int]) -> None:
    journal = await opened(tmp_path / "checkpoint.json")
    writes.clear()

    await asyncio.gather(*(journal.commit(Reserve(f"u{i}", record(f"a{i}", f"gpu-{i}"))) for i in range(200)))

    on_disk = read_state(tmp_path / "checkpoint.json")
    assert sorted(on_disk.claims) == sorted(f"u{i}" for i in range(200))
    assert journal.state == on_disk
    # All 200 were queued before the writer ran: one file write (one fsync) for all of them.
    assert writes == [200]


async def test_a_commit_is_written_without_a_worker_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    journal = await opened(tmp_path / "checkpoint.json")
    handed_off: list[object] = []
    real_to_thread = asyncio.to_thread

    async def to_thread(function: object, *args: object) -> object:
        handed_off.append(function)
        return await real_to_thread(function, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(asyncio, "to_thread", to_thread)
    await journal.commit(Reserve("u1", record("a1", "gpu-0")))
    await journal.refresh()
    await journal.commit(Release("u1"))

    assert handed_off == []  # an unsynced append: cheaper than a thread hop
    assert read_state(tmp_path / "checkpoint.json").claims == {}


async def test_a_commit_waits_in_a_thread_while_the_other_instance_holds_the_lock(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.json"
    journal = await opened(path)
    other = os.open(path.with_name(path.name + ".lock"), os.O_RDWR)
    fcntl.flock(other, fcntl.LOCK_EX)  # another open file: excludes this process's writer too
    try:
        commit = asyncio.create_task(journal.commit(Reserve("u1", record("a1", "gpu-0"))))
        await asyncio.sleep(0.2)  # the event loop runs on: the writer waits in a worker thread
        assert not commit.done()
        assert read_state(path).claims == {}
    finally:
        fcntl.flock(other, fcntl.LOCK_UN)
        os.close(other)
    await asyncio.wait_for(commit, timeout=10)
    assert sorted(read_state(path).claims) == ["u1"]


async def test_the_snapshot_is_rewritten_in_a_worker_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "checkpoint.json"
    journal = await opened(path)
    on_threads: list[str] = []
    real_write = ckpt.write

    def write(where: Path, state: Checkpoint) -> bytes:
        on_threads.append(threading.current_thread().name)
        return real_write(where, state)

    monkeypatch.setattr(ckpt, "write", write)
    monkeypatch.setattr(journal_module, "_COMPACT_AT_LEAST", 0)  # compact once the log passes 2x the snapshot
    for i in range(50):
        await journal.commit(Reserve(f"u{i}", record(f"a{i}", f"gpu-{i}")))
        if on_threads:
            break

    assert on_threads
    assert threading.main_thread().name not in on_threads  # fsynced: never on the event loop
    assert sorted(read_state(path).claims) == sorted(f"u{j}" for j in range(i + 1))


async def test_exactly_one_of_two_claims_for_one_device_wins(tmp_path: Path) -> None:
    journal = await opened(tmp_path / "checkpoint.json")

    outcomes = await asyncio.gather(
        journal.commit(Reserve("u1", record("a1", "gpu-0"))),
        journal.commit(Reserve("u2", record("a2", "gpu-1", "gpu-0"))),
        return_exceptions=True,
    )

    assert outcomes[0] is None
    assert isinstance(outcomes[1], MutationRejected)
    assert "device gpu-0 is already prepared for claim ns/claim-a1 (u1)" in str(outcomes[1])
    assert set(read_state(tmp_path / "checkpoint.json").claims) == {"u1"}


async def test_admin_access_never_counts_against_a_device(tmp_path: Path) -> None:
    journal = await opened(tmp_path / "checkpoint.json")

    await journal.commit(Reserve("u1", record("a1", "gpu-0")))
    await journal.commit(Reserve("u2", record("a2", "gpu-0", admin=True)))
    await journal.commit(Release("u1"))
    await journal.commit(Reserve("u3", record("a3", "gpu-0")))

    assert set(journal.state.claims) == {"u2", "u3"}


async def test_records_are_replaced_only_by_the_attempt_that_saw_them(tmp_path: Path) -> None:
    journal = await opened(tmp_path / "checkpoint.json")
    await journal.commit(Reserve("u1", record("a1", "gpu-0")))

    with pytest.raises(MutationRejected, match="is being prepared concurrently"):
        await journal.commit(Reserve("u1", record("a2", "gpu-0")))
    with pytest.raises(MutationRejected, match="was unprepared or taken over"):
        await journal.commit(Complete("u1", record("a2", "gpu-0", phase="PrepareCompleted")))

    await journal.commit(Reserve("u1", record("a3", "gpu-0"), replaces="a1"))
    await journal.commit(Release("u1", "a1"))  # the old attempt's undo must not remove the new one
    assert journal.state.claims["u1"].attempt == "a3"


async def test_release_of_an_unknown_claim_writes_nothing(tmp_path: Path, writes: list[int]) -> None:
    journal = await opened(tmp_path / "checkpoint.json")
    writes.clear()

    await journal.commit(Release("never-prepared"))

    assert writes == []


async def test_another_instances_writes_are_merged_not_lost(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.json"
    first, second = await opened(path), await opened(path)

    await first.commit(Reserve("u1", record("a1", "gpu-0")))
    await second.commit(Reserve("u2", record("a2", "gpu-1")))
    await first.commit(Reserve("u3", record("a3", "gpu-2")))
    with pytest.raises(MutationRejected, match="device gpu-1 is already prepared for claim ns/claim-a2"):
        await first.commit(Reserve("u4", record("a4", "gpu-1")))
    await second.commit(Release("u1"))

    on_disk = read_state(path)
    assert set(on_disk.claims) == {"u2", "u3"}
    assert on_disk.generation > first.state.generation  # each write, by either, counts up
    await first.commit(Release("u-none"))  # writes nothing, but takes in second's release of u1
    assert first.state == on_disk
    await first.commit(Reserve("u5", record("a5", "gpu-0")))  # so gpu-0 is free again
    assert set(read_state(path).claims) == {"u2", "u3", "u5"}


async def test_two_instances_lose_nothing_while_either_compacts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("dra_driver.node.journal._COMPACT_AT_LEAST", 2048)  # compact every few commits
    path = tmp_path / "checkpoint.json"
    first, second = await opened(path), await opened(path)

    for i in range(40):
        writer, other = (first, second) if i % 3 else (second, first)
        await writer.commit(Reserve(f"u{i}", record(f"a{i}", f"gpu-{i}")))
        if i % 4 == 0:
            await other.commit(Release(f"u{i}"))  # the other instance releases what this one wrote

    expected = {f"u{i}" for i in range(40) if i % 4}
    assert set(read_state(path).claims) == expected
    assert set((await first.refresh()).claims) == expected
    assert set((await second.refresh()).claims) == expected


async def test_failed_write_changes_nothing_and_the_next_succeeds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "checkpoint.json"
    journal = await opened(path)
    await journal.commit(Reserve("u0", record("a0", "gpu-7")))
    log_before = ckpt_log.log_path(path).read_bytes()
    real_pwrite = os.pwrite

    def disk_full_half_way(fd: int, data: bytes, offset: int) -> int:
        real_pwrite(fd, data[: len(data) // 2], offset)  # the disk filled up during the write
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt_log.os, "pwrite", disk_full_half_way)
    with pytest.raises(CheckpointWriteError, match="No space left on device"):
        await journal.commit(Reserve("u1", record("a1", "gpu-0")))
    assert set(journal.state.claims) == {"u0"}
    assert ckpt_log.log_path(path).read_bytes() == log_before  # the torn half was cut off again

    monkeypatch.setattr(ckpt_log.os, "pwrite", real_pwrite)
    await journal.commit(Reserve("u2", record("a2", "gpu-0")))
    assert set(read_state(path).claims) == {"u0", "u2"}


async def test_a_disk_that_fills_during_a_write_is_reported_as_full(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kernel first returns a short count, and only the next write fails with ENOSPC: the user must
    read "No space left on device", not "short write" (found by the fault suite, e2e/reliability)."""
    path = tmp_path / "checkpoint.json"
    journal = await opened(path)
    log_before = ckpt_log.log_path(path).read_bytes()
    real_pwrite = os.pwrite
    calls: list[int] = []

    def short_then_full(fd: int, data: bytes, offset: int) -> int:
        calls.append(len(data))
        if len(calls) > 1:
            raise OSError(28, "No space left on device")
        return real_pwrite(fd, data[:10], offset)

    monkeypatch.setattr(ckpt_log.os, "pwrite", short_then_full)
    with pytest.raises(CheckpointWriteError, match="No space left on device"):
        await journal.commit(Reserve("u1", record("a1", "gpu-0")))
    assert ckpt_log.log_path(path).read_bytes() == log_before

    def short_then_room(fd: int, data: bytes, offset: int) -> int:  # space freed meanwhile
        return real_pwrite(fd, data[: max(1, len(data) // 3)], offset)

    monkeypatch.setattr(ckpt_log.os, "pwrite", short_then_room)
    await journal.commit(Reserve("u2", record("a2", "gpu-0")))
    assert set(read_state(path).claims) == {"u2"}


async def test_a_torn_last_line_is_ignored_and_cut_off_by_the_next_write(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.json"
    journal = await opened(path)
    await journal.commit(Reserve("u1", record("a1", "gpu-0")))
    with ckpt_log.log_path(path).open("ab") as log:
        log.write(b'{"checksum":"sha256:00","entry":{"gener')  # a writer that died mid-line

    assert set(read_state(path).claims) == {"u1"}
    restarted = await opened(path)
    await restarted.commit(Reserve("u2", record("a2", "gpu-1")))

    assert set(read_state(path).claims) == {"u1", "u2"}
    assert ckpt_log.log_path(path).read_bytes().count(b"\n") == 3  # the header and two whole entries


async def test_the_snapshot_is_rewritten_once_the_log_outgrows_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "checkpoint.json"
    journal = await opened(path)
    snapshots: list[int] = []
    real_write = ckpt.write

    def counting_write(path: Path, checkpoint: Checkpoint) -> bytes:
        snapshots.append(checkpoint.generation)
        return real_write(path, checkpoint)

    monkeypatch.setattr(ckpt, "write", counting_write)
    monkeypatch.setattr("dra_driver.node.journal._COMPACT_AT_LEAST", 4096)
    for i in range(60):
        await journal.commit(Reserve(f"u{i}", record(f"a{i}", f"gpu-{i}")))
        if i % 3:
            await journal.commit(Release(f"u{i}"))

    # Amortized: a snapshot every few dozen commits, not one per commit.
    assert 1 <= len(snapshots) <= 10
    assert len(ckpt_log.log_path(path).read_bytes()) <= 4096 + 1024
    assert set(read_state(path).claims) == {f"u{i}" for i in range(0, 60, 3)}
    assert read_state(path) == journal.state
    reopened = await opened(path)
    assert reopened.state.claims == journal.state.claims


async def test_a_cancelled_waiter_does_not_undo_its_mutation(tmp_path: Path) -> None:
    journal = await opened(tmp_path / "checkpoint.json")

    waiter = asyncio.create_task(journal.commit(Reserve("u1", record("a1", "gpu-0"))))
    await asyncio.sleep(0)  # let the waiter queue its mutation
    waiter.cancel()
    await journal.commit(Reserve("u2", record("a2", "gpu-1")))  # resolves after the batch holding u1

    assert waiter.cancelled()
    assert set(read_state(tmp_path / "checkpoint.json").claims) == {"u1", "u2"}


async def test_refreshes_racing_commits_lose_no_update(tmp_path: Path) -> None:
    """An 8-claim pod prepared and unprepared as the preparer does it, many times over.

    Unprepare reads the file (``refresh``) before each release, while the releases of the
    pod's other claims are being written. A read must never pair the new file with the old
    state: the released claims would come back, and the next write would put them on disk.
    """
    path = tmp_path / "checkpoint.json"
    journal = await opened(path)
    claims = 8

    async def prepare(round_: int, i: int) -> None:
        attempt = f"r{round_}-{i}"
        await journal.commit(Reserve(f"u{i}", record(attempt, f"gpu-{i}")))
        await journal.commit(Complete(f"u{i}", record(attempt, f"gpu-{i}", phase="PrepareCompleted")))

    async def unprepare(i: int) -> None:
        await journal.refresh()
        await journal.commit(Release(f"u{i}"))

    for round_ in range(150):
        await asyncio.gather(*(prepare(round_, i) for i in range(claims)))
        assert len(journal.state.claims) == claims
        await asyncio.gather(*(unprepare(i) for i in range(claims)))
        assert journal.state.claims == {}, f"round {round_}: released claims came back"
        assert claim_ids(path) == set(), f"round {round_}: released claims are on disk"


async def test_refresh_sees_the_commits_queued_before_it(tmp_path: Path) -> None:
    journal = await opened(tmp_path / "checkpoint.json")

    reserving = asyncio.ensure_future(journal.commit(Reserve("u1", record("a1", "gpu-0"))))
    await asyncio.sleep(0)  # let it queue its mutation
    seen = await journal.refresh()

    assert reserving.done()
    assert set(seen.claims) == {"u1"}


async def test_a_file_written_by_a_newer_driver_is_never_overwritten(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.json"
    journal = await opened(path)
    await journal.commit(Reserve("u1", record("a1", "gpu-0")))
    newer = json.dumps({"schemaVersion": ckpt.SCHEMA_VERSION + 1, "checksum": "sha256:x", "payload": {}})
    path.write_text(newer)  # the upgraded instance of a rolling update wrote it

    with pytest.raises(CheckpointWriteError, match="written by a newer version of the driver"):
        await journal.commit(Reserve("u2", record("a2", "gpu-1")))

    assert path.read_text() == newer


async def test_opening_removes_temporary_files_of_interrupted_writes(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.json"
    ckpt.write(path, Checkpoint(boot_id=BOOT))
    (tmp_path / ".checkpoint.json.k2j3.tmp").write_text("{torn")
    (tmp_path / ".checkpoint.json.log.x8a1.tmp").write_text('{"base"')

    await opened(path)

    assert sorted(os.listdir(tmp_path)) == ["checkpoint.json", "checkpoint.json.lock", "checkpoint.json.log"]


OTHER_INSTANCE = """
import asyncio, sys
from pathlib import Path
import structlog
from dra_driver.node.checkpoint import ClaimRecord, DeviceRecord
from dra_driver.node.journal import Journal
from dra_driver.node.state import Reserve

structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))  # stdout is for turns

async def main(path: Path, count: int, turns: bool) -> None:
    journal = Journal(path)
    await journal.open("boot-1", lambda loaded: loaded.checkpoint)
    print("ready", flush=True)
    for i in range(count):
        device = DeviceRecord(request="gpu", pool="node-a", device=f"b-{i}", cdi_device_ids=("k/c=x",))
        record = ClaimRecord(namespace="ns", name=f"b{i}", phase="PrepareStarted", attempt=f"b{i}",
                             devices=(device,))
        await journal.commit(Reserve(f"b{i}", record))
        if turns:
            print(i, flush=True)  # your turn
            sys.stdin.readline()  # my turn

    print("done", flush=True)

asyncio.run(main(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "turns"))
"""


async def other_instance(path: Path, count: int, mode: str) -> asyncio.subprocess.Process:
    """Another plugin process committing ``count`` claims b0, b1, ... to the same checkpoint."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        OTHER_INSTANCE,
        str(path),
        str(count),
        mode,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    assert process.stdout is not None
    assert await process.stdout.readline() == b"ready\n"
    return process


def claim_ids(path: Path) -> set[str]:
    return set(read_state(path).claims)


async def test_two_processes_taking_turns_lose_nothing(tmp_path: Path) -> None:
    """Each write follows one by the other process, so every write must take the other's in."""
    path = tmp_path / "checkpoint.json"
    journal = await opened(path)
    count = 20
    other = await other_instance(path, count, "turns")
    assert other.stdin is not None
    assert other.stdout is not None

    for i in range(count):
        assert await other.stdout.readline() == f"{i}\n".encode()
        await journal.commit(Reserve(f"a{i}", record(f"a{i}", f"a-{i}")))
        other.stdin.write(b"\n")
        await other.stdin.drain()
    assert await other.stdout.readline() == b"done\n"
    assert await other.wait() == 0

    assert claim_ids(path) == {f"a{i}" for i in range(count)} | {f"b{i}" for i in range(count)}
    assert read_state(path).generation == 2 * count + 1  # opening wrote generation 1


async def test_two_processes_writing_at_once_lose_nothing(tmp_path: Path) -> None:
    """The file lock makes each read-modify-write whole, however the two processes' writes overlap."""
    path = tmp_path / "checkpoint.json"
    journal = await opened(path)
    count = 40
    other = await other_instance(path, count, "race")

    for i in range(count):
        await journal.commit(Reserve(f"a{i}", record(f"a{i}", f"a-{i}")))
    assert await other.wait() == 0

    assert claim_ids(path) == {f"a{i}" for i in range(count)} | {f"b{i}" for i in range(count)}
