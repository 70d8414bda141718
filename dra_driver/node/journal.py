"""Durable, concurrent updates of the checkpoint: one writer, group commit, cross-process lock.

Prepares of different claims run concurrently, and each must know its record is on
disk before it answers the kubelet. Writing the file once per mutation behind one
lock would make 200 concurrent prepares wait for 200 serial fsyncs (that is what the
upstream Go helper and NVIDIA's driver do). Instead every :meth:`Journal.commit`
queues its mutation and one flusher task writes all queued mutations with a single
atomic write and fsync, then resolves every waiter; mutations that arrive during a
write go into the next one.

During a rolling update two plugin instances share the file. Each write is a
read-modify-write under an exclusive ``flock`` on ``<checkpoint>.lock``, held only for
that write (never across API calls): if the file in place does not hold what this
instance wrote last, the other instance wrote it, so its state (with its higher
``generation``) becomes the base the queued mutations apply to. (The comparison is
of the bytes, not of inode numbers or times: a file system reuses freed inodes, and
times are coarse.) No instance's update is lost, and the conflict rules of
:mod:`dra_driver.node.state` always see both instances' claims.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import structlog

from dra_driver.node import checkpoint as ckpt
from dra_driver.node.checkpoint import Checkpoint, CheckpointUnreadable, LoadedCheckpoint
from dra_driver.node.state import Mutation, MutationRejected, apply

log = structlog.get_logger(__name__)


class CheckpointWriteError(Exception):
    """The checkpoint could not be written; the mutation did not happen."""


class Journal:
    """The checkpoint at ``path`` and the single writer that changes it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock_path = path.with_name(path.name + ".lock")
        self._state: Checkpoint | None = None
        self._written: bytes | None = None  # the file's content as this instance wrote (or read) it last
        self._pending: list[tuple[Mutation, asyncio.Future[None]]] = []
        self._flusher: asyncio.Task[None] | None = None

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
            loaded = ckpt.load(self.path, boot_id)
            state = repair(loaded)
            if state != loaded.checkpoint or loaded.stale or loaded.moved_aside or not self.path.exists():
                state = state.model_copy(update={"generation": state.generation + 1})
                self._written = ckpt.write(self.path, state)
            else:
                self._written = self.path.read_bytes()
            self._state = state

    async def refresh(self) -> Checkpoint:
        """The state including what another plugin instance wrote since our last write.

        Read under the file lock. Needed before acting on a record that the other
        instance of a rolling update may have written (a MIG device to destroy).
        """
        return await asyncio.to_thread(self._refresh)

    def _refresh(self) -> Checkpoint:
        with self._locked():
            self._state = self._current()
            return self._state

    async def commit(self, mutation: Mutation) -> None:
        """Apply ``mutation`` durably; returns once it is on disk.

        Raises :class:`MutationRejected` when the state forbids it and
        :class:`CheckpointWriteError` when the file could not be written.
        """
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending.append((mutation, future))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush())
        await future

    async def _flush(self) -> None:
        while self._pending:
            batch, self._pending = self._pending, []
            try:
                state, written, outcomes = await asyncio.to_thread(self._write, [m for m, _ in batch])
            except Exception as error:  # a waiter must never hang: every failure resolves the batch
                log.error(
                    "checkpoint write failed", path=str(self.path), error=str(error), mutations=len(batch)
                )
                message = f"cannot write the checkpoint {self.path}: {error}"
                for _, future in batch:
                    _resolve(future, CheckpointWriteError(message))
                continue
            self._state, self._written = state, written
            for (_, future), outcome in zip(batch, outcomes, strict=True):
                _resolve(future, outcome)

    def _write(
        self, mutations: list[Mutation]
    ) -> tuple[Checkpoint, bytes | None, list[MutationRejected | None]]:
        with self._locked():
            base = self._current()
            state, outcomes = apply(base, mutations)
            written = ckpt.write(self.path, state) if state is not base else self._written
            return state, written, outcomes

    def _current(self) -> Checkpoint:
        """Our state, or the other instance's if it wrote the file since our last write."""
        mine = self.state
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            log.warning("checkpoint disappeared; writing it again from memory", path=str(self.path))
            return mine
        if data == self._written:
            return mine
        try:
            theirs = ckpt.decode(data)
        except CheckpointUnreadable as error:
            log.error(
                "checkpoint written by another instance is unreadable; overwriting it from memory",
                path=str(self.path),
                reason=str(error),
            )
            return mine
        log.info(
            "checkpoint changed by another plugin instance; merging",
            ours=mine.generation,
            theirs=theirs.generation,
        )
        # The file wins: it holds our earlier writes plus theirs. The next write must
        # have a higher generation than both.
        self._written = data
        return theirs.model_copy(update={"generation": max(theirs.generation, mine.generation)})

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self._lock_path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock


def _resolve(future: asyncio.Future[None], outcome: Exception | None) -> None:
    if future.done():  # the waiter was cancelled; the mutation stands
        return
    if outcome is None:
        future.set_result(None)
    else:
        future.set_exception(outcome)
