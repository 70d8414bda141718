"""Durable, concurrent updates of the checkpoint: one writer, group commit, cross-process lock.

Prepares of different claims run concurrently, and each must know its record is on
disk before it answers the kubelet. Writing the file once per mutation behind one
lock would make 200 concurrent prepares wait for 200 serial writes (that is what the
upstream Go helper and NVIDIA's driver do, with an fsync each). Instead every
:meth:`Journal.commit` queues its mutation and one flusher task applies all queued
mutations and appends them to the checkpoint's log as one entry, then resolves every
waiter; mutations that arrive during a write go into the next one. The cost of an
entry is that of the records it changes, not of the whole state: the snapshot is
rewritten only when the log has grown past twice its size (amortized O(1) per
commit; see :mod:`dra_driver.node.checkpoint_log`).

During a rolling update two plugin instances share the file. Each write is a
read-modify-write under an exclusive ``flock`` on ``<checkpoint>.lock``, held only for
that write (never across API calls): if the log has grown past what this instance
wrote or read last, the other instance appended to it, and its entries are applied
before the queued mutations; if the log was started afresh (its random epoch
changed), the other instance compacted, and both files are read again. (Epochs, not
inode numbers or times: a file system reuses freed inodes, and times are coarse.)
No instance's update is lost, and the conflict rules of :mod:`dra_driver.node.state`
always see both instances' claims.

The flusher is the only owner of the in-memory state: reads of the file
(:meth:`Journal.refresh`) queue behind writes like mutations do, and the writer
publishes the state it wrote together with the bytes, before it releases the
lock. State and file therefore always change together. (Publishing on the event loop
after the lock was released let a concurrent read pair the new bytes with the old
state and keep the old state: released claims came back, and a committed reservation
could be dropped.)

A group commit is an append of a few hundred bytes, without an fsync, to a file on the
node's own disk: it takes less time than handing it to a worker thread and waking the
event loop again, which on a busy node is two waits for a CPU. So the flusher writes on
the event loop, with the locks taken without waiting. Only when it would have to wait or
block for long -- the other instance holds the file lock, or the snapshot is due to be
rewritten, which is fsynced -- does the batch go to a worker thread, as a whole and from the
start (nothing is written before that decision).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fcntl
import io
import os
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import structlog

from dra_driver.node import checkpoint as ckpt
from dra_driver.node import checkpoint_log as ckpt_log
from dra_driver.node.checkpoint import (
    Checkpoint,
    CheckpointFromNewerDriver,
    CheckpointUnreadable,
    LoadedCheckpoint,
)
from dra_driver.node.checkpoint_log import LogEntry, LogPosition
from dra_driver.node.state import Mutation, MutationRejected, apply

_COMPACT_AT_LEAST = 1 << 20  # bytes of log before the snapshot is rewritten, at the least

log = structlog.get_logger(__name__)


class CheckpointWriteError(Exception):
    """The checkpoint could not be written; the mutation did not happen."""


class _WouldBlock(Exception):
    """The write would wait (for a lock) or block for long (an fsync): run it in a worker thread."""


@dataclass(frozen=True)
class _Read:
    """A queued :meth:`Journal.refresh`: no change, only the freshest state."""


_Step = Mutation | _Read


class Journal:
    """The checkpoint at ``path`` and the single writer that changes it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock_path = path.with_name(path.name + ".lock")
        self._state: Checkpoint | None = None
        self._log_path = ckpt_log.log_path(path)
        self._position: LogPosition | None = None  # how far this instance wrote or read the log
        self._snapshot_size = 0  # bytes of the snapshot last written or read
        self._pending: list[tuple[_Step, asyncio.Future[Checkpoint]]] = []
        self._flusher: asyncio.Task[None] | None = None
        # The file lock is per open file, so it also excludes our own threads; this lock
        # says so explicitly and holds where flock is advisory-only (some network file systems).
        self._thread_lock = threading.Lock()
        self._lock_file_object: io.FileIO | None = None  # kept open (see _lock_file)

    @property
    def state(self) -> Checkpoint:
        """The state as of this instance's last write; the authority is the writer, not this view."""
        if self._state is None:
            raise RuntimeError("Journal.open() has not run")
        return self._state

    async def open(self, boot_id: str, repair: Callable[[LoadedCheckpoint], Checkpoint]) -> None:
        """Load the checkpoint and let ``repair`` turn what was found into the state to start from.

        ``repair`` runs in a worker thread under the file lock, so its file-system
        clean-up cannot race with another instance's prepares; its result is written
        when it differs from the file.
        """
        await asyncio.to_thread(self._open, boot_id, repair)

    def _open(self, boot_id: str, repair: Callable[[LoadedCheckpoint], Checkpoint]) -> None:
        with self._locked():
            # Only lock holders write these files: no write of them is in progress.
            ckpt.remove_leftover_temps(self.path)
            ckpt.remove_leftover_temps(self._log_path)
            replayed: list[ckpt_log.Replayed] = []

            def replay(snapshot: Checkpoint) -> Checkpoint:
                replayed.append(ckpt_log.replay(self.path, snapshot))
                return replayed[0].state

            loaded = ckpt.load(self.path, boot_id, replay)
            if replayed and replayed[0].damaged and not loaded.earlier_boot:
                aside = ckpt_log.keep_damaged(self.path)
                log.error(
                    "checkpoint log damaged after its last whole entry; recovering the claims it lost "
                    "from their CDI specs",
                    moved_to=str(aside),
                    what_to_do="nothing is needed to recover; keep the copy for a bug report",
                )
            state = repair(loaded)
            position = replayed[0].position if replayed else None
            if position is None or loaded.earlier_boot or state != loaded.checkpoint:
                self._compact(state.model_copy(update={"generation": state.generation + 1}))
            else:
                self._snapshot_size = self.path.stat().st_size
                self._state, self._position = state, position

    async def refresh(self) -> Checkpoint:
        """The state including what another plugin instance wrote since our last write.

        Read under the file lock, in turn with the commits queued before it. Needed before
        acting on a record that the other instance of a rolling update may have written (a
        MIG device to destroy).
        """
        return await self._enqueue(_Read())

    async def commit(self, mutation: Mutation) -> None:
        """Apply ``mutation`` durably; returns once it is on disk.

        Raises :class:`MutationRejected` when the state forbids it and
        :class:`CheckpointWriteError` when the file could not be written.
        """
        await self._enqueue(mutation)

    async def _enqueue(self, step: _Step) -> Checkpoint:
        future: asyncio.Future[Checkpoint] = asyncio.get_running_loop().create_future()
        self._pending.append((step, future))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush())
        return await future

    async def _flush(self) -> None:
        while self._pending:
            batch, self._pending = self._pending, []
            steps = [step for step, _ in batch]
            try:
                try:
                    state, outcomes = self._write(steps, inline=True)
                except _WouldBlock:
                    state, outcomes = await asyncio.to_thread(self._write, steps)
            except Exception as error:  # a waiter must never hang: every failure resolves the batch
                log.error(
                    "checkpoint write failed", path=str(self.path), error=str(error), mutations=len(batch)
                )
                message = f"cannot write the checkpoint {self.path}: {error}"
                for _, future in batch:
                    _resolve(future, CheckpointWriteError(message))
                continue
            for (_, future), outcome in zip(batch, outcomes, strict=True):
                _resolve(future, state if outcome is None else outcome)

    def _write(
        self, steps: list[_Step], *, inline: bool = False
    ) -> tuple[Checkpoint, list[MutationRejected | None]]:
        """Apply ``steps`` to the freshest state; publish the state before unlocking.

        ``inline`` (on the event loop): raise :class:`_WouldBlock` instead of waiting for a lock
        or rewriting the snapshot, before anything is written or published.
        """
        with self._locked(wait=not inline):
            base, position = self._current()
            mutations = [step for step in steps if not isinstance(step, _Read)]
            state, applied = apply(base, mutations)
            if state is base:
                self._state, self._position = state, position
            elif position is None or position.end > max(_COMPACT_AT_LEAST, 2 * self._snapshot_size):
                if inline:
                    raise _WouldBlock
                self._compact(state)
            else:
                changed = {m.uid for m in mutations if base.claims.get(m.uid) is not state.claims.get(m.uid)}
                entry = LogEntry(
                    generation=state.generation,
                    set={uid: state.claims[uid] for uid in sorted(changed) if uid in state.claims},
                    delete=tuple(sorted(uid for uid in changed if uid not in state.claims)),
                )
                end = ckpt_log.append(self._log_path, ckpt_log.encode_entry(entry), position.end)
                # Only now, with the write done and the lock still held: a failed write changes nothing.
                self._state, self._position = state, dataclasses.replace(position, end=end)
            results = iter(applied)
            return state, [None if isinstance(step, _Read) else next(results) for step in steps]

    def _compact(self, state: Checkpoint) -> None:
        """Write ``state`` as the snapshot and start an empty log after it."""
        self._snapshot_size = len(ckpt.write(self.path, state))
        # A crash here leaves the new snapshot and the old log, whose base it no longer
        # matches: the log is ignored, and the snapshot holds all it said.
        self._state, self._position = state, ckpt_log.start(self.path, state.generation)

    def _current(self) -> tuple[Checkpoint, LogPosition | None]:
        """The state to build on and how far it follows the log (None: compact at the next write).

        That is our state, plus what another instance wrote since our last write. The
        state is not published here: the caller does that once its own write is done.
        """
        mine = self.state
        if self._position is not None:
            followed = ckpt_log.follow(self.path, mine, self._position)
            if followed is not None:
                if followed.position != self._position:
                    log.info("checkpoint changed by another plugin instance; merging")
                return followed.state, followed.position
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            log.warning("checkpoint disappeared; writing it again from memory", path=str(self.path))
            return mine, None
        try:
            theirs = ckpt.decode(data)
        except CheckpointFromNewerDriver as error:
            # A newer driver (an upgrade next to this instance) owns the file now: never overwrite it.
            raise CheckpointFromNewerDriver(f"checkpoint {self.path}: {error}") from None
        except CheckpointUnreadable as error:
            log.error(
                "checkpoint written by another instance is unreadable; overwriting it from memory",
                path=str(self.path),
                reason=str(error),
            )
            return mine, None
        log.info(
            "checkpoint rewritten by another plugin instance; reading it again", theirs=theirs.generation
        )
        self._snapshot_size = len(data)
        replayed = ckpt_log.replay(self.path, theirs)
        # The files win: they hold our earlier writes plus theirs.
        return replayed.state, replayed.position

    @contextlib.contextmanager
    def _locked(self, *, wait: bool = True) -> Iterator[None]:
        """Both locks; ``wait=False``: raise :class:`_WouldBlock` rather than wait for either."""
        if not self._thread_lock.acquire(blocking=wait):
            raise _WouldBlock
        try:
            fd = self._lock_file()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # only without waiting: the other instance is writing
                raise _WouldBlock from None
            try:
                yield
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            self._thread_lock.release()

    def _lock_file(self) -> int:
        """The lock file, kept open between writes; opened again if its path names another file.

        The other instance locks whatever file the path names when it looks: if the file was
        removed or replaced (a wiped data directory), locking the old one would exclude nobody.
        """
        if self._lock_file_object is not None:
            fd = self._lock_file_object.fileno()
            try:
                if os.stat(self._lock_path).st_ino == os.fstat(fd).st_ino:
                    return fd
            except FileNotFoundError:
                pass
            self._lock_file_object.close()
            self._lock_file_object = None
        self._lock_path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self._lock_file_object = io.FileIO(fd, "r+", closefd=True)
        weakref.finalize(self, self._lock_file_object.close)  # closed, not left to the collector
        return fd


def _resolve(future: asyncio.Future[Checkpoint], outcome: Checkpoint | Exception) -> None:
    """Hand a waiter the state after its step, or the reason its step did not happen."""
    if future.done():  # the waiter was cancelled; the mutation stands
        return
    if isinstance(outcome, Exception):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)
