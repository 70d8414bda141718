"""The claim specs on disk, in the directory the container runtime reads (``/var/run/cdi``).

A runtime may read the directory at any moment -- containerd and CRI-O watch it --
and refuses a file it cannot parse, so a spec appears whole or not at all: it is
written to a temporary file whose name the runtime ignores (hidden, ending in
``.tmp``, while runtimes read only ``.json`` and ``.yaml``) and renamed into place,
so that a killed plugin leaves either the old spec or the new one.

Nothing is fsynced, and that loses nothing: a killed process loses nothing the kernel
already has (the rename is atomic for every reader), and an operating-system crash is a
reboot, after which the plugin removes every spec of ours, whole or torn, before it
serves (the boot id in the node's store says the claims belong to an earlier boot; see
:mod:`dra_driver.node.recovery`). The same rule lets the store's commits skip their
fsyncs (:mod:`dra_driver.node.store`). The default directory,
``/var/run/cdi``, is a tmpfs anyway, where an fsync does nothing.

All methods block on the file system, briefly: the preparer calls them on the event loop,
where a small local write costs less than the thread hop around it.

A spec is written as compact JSON, as CDI's own Go writer does: ``json.dumps`` with an
``indent`` runs Python's pure-Python encoder, several times slower than the compact one and
then the largest part of a prepare's own work (docs/performance.md has the figures).
``jq . <file>`` shows it indented.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from dra_driver import crashpoint
from dra_driver.cdi.spec import cdi_kind, check_claim_uid
from dra_driver.cdi.validate import ValidSpec, validate_spec

_SUFFIX = ".json"
_TEMP_SUFFIX = ".tmp"  # ignored by runtimes, which read only .json and .yaml


class SpecStore:
    """The transient specs of one driver: ``<cdi_dir>/k8s.<driver>-claim_<claimUID>.json``."""

    def __init__(self, cdi_dir: Path, driver_name: str) -> None:
        self._dir = cdi_dir
        self._kind = cdi_kind(driver_name)
        # The name CDI's own GenerateTransientSpecName gives: vendor-class_id.
        self._prefix = self._kind.replace("/", "-") + "_"

    def path_for(self, claim_uid: str) -> Path:
        """Where the spec of ``claim_uid`` lives; ValueError for a UID that is not a safe file-name part."""
        check_claim_uid(claim_uid)  # at most 64 characters: the name stays far below a file name's 255 bytes
        return self._dir / f"{self._prefix}{claim_uid}{_SUFFIX}"

    def write(self, claim_uid: str, spec: Mapping[str, Any]) -> Path:
        """Validate ``spec`` and replace the claim's spec file with it atomically; returns the path."""
        path, fd = self._write_locked(claim_uid, spec)
        os.close(fd)
        return path

    @contextlib.contextmanager
    def write_held(self, claim_uid: str, spec: Mapping[str, Any]) -> Iterator[Path]:
        """:meth:`write`, keeping the new spec locked until the block ends.

        The one-step prepare holds its spec while it commits the claim's record: until then a
        spec without a record is what a crash would leave, and another plugin instance starting
        meanwhile (a rolling update) must not take it for one (:meth:`held_by_a_writer`).
        """
        path, fd = self._write_locked(claim_uid, spec)
        try:
            yield path
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def held(self, claim_uid: str) -> Iterator[None]:
        """The claim's spec held locked, as :meth:`write_held` holds a new one, while the block changes
        what it names (an unprepare binding a GPU back): a plugin instance starting meanwhile leaves
        that to this one (:meth:`held_by_a_writer`). A claim without a spec holds nothing."""
        try:
            fd = os.open(self.path_for(claim_uid), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            yield
            return
        try:
            with contextlib.suppress(BlockingIOError):  # held already: by another live operation
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            yield
        finally:
            os.close(fd)

    def held_by_a_writer(self, claim_uid: str) -> bool:
        """Whether a live process holds the claim's spec locked (:meth:`write_held`).

        The kernel drops the lock when its holder dies, so a spec a crash left is never held.
        """
        try:
            fd = os.open(self.path_for(claim_uid), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)
        return False

    def _write_locked(self, claim_uid: str, spec: Mapping[str, Any]) -> tuple[Path, int]:
        """Write the spec; its path and a descriptor that holds it exclusively locked."""
        path = self.path_for(claim_uid)
        if not isinstance(spec, ValidSpec):  # a ValidSpec was checked where it was built
            validate_spec(spec)
        if spec["kind"] != self._kind:
            raise ValueError(
                f"spec of kind {spec['kind']!r} does not belong in this driver's {self._kind!r} files"
            )
        data = (json.dumps(spec, separators=(",", ":")) + "\n").encode()

        try:
            fd, temp_name = _locked_temp_file(self._dir, prefix=f".{path.stem}.")
        except FileNotFoundError:  # the directory is made by the first write (again, if removed since)
            self._dir.mkdir(parents=True, exist_ok=True)
            fd, temp_name = _locked_temp_file(self._dir, prefix=f".{path.stem}.")
        try:
            # Plain write(2) calls: a file object around the descriptor costs more than the write.
            unwritten = memoryview(data)
            while unwritten:
                unwritten = unwritten[os.write(fd, unwritten) :]
            # Readable like any other spec: tools such as `cdi list` need not run as root.
            os.fchmod(fd, 0o644)
            crashpoint.reached("cdi.before_rename")
            # Renamed while still open and locked: see remove_leftover_temps.
            os.replace(temp_name, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp_name)
            os.close(fd)
            raise
        crashpoint.reached("cdi.after_write")
        return path, fd

    def remove(self, claim_uid: str) -> None:
        """Delete the claim's spec; a spec that is already gone is fine."""
        path = self.path_for(claim_uid)
        crashpoint.reached("cdi.before_remove")
        try:
            path.unlink()
        except FileNotFoundError:
            return
        crashpoint.reached("cdi.after_remove")

    def remove_leftover_temps(self) -> list[str]:
        """Delete the temporary files of spec writes that died half-way; returns their names.

        A crash between creating a temporary file and renaming it into place leaves it behind,
        and nothing else would ever remove it. Each writer holds an exclusive ``flock`` on its
        temporary file until the rename, and the kernel drops the lock when the writer dies: a
        file that can be locked is abandoned. So this is safe while another plugin instance
        (rolling update) is writing specs in the same directory.
        """
        try:
            entries = list(os.scandir(self._dir))
        except FileNotFoundError:
            return []
        removed: list[str] = []
        for entry in entries:
            if not (entry.name.startswith(f".{self._prefix}") and entry.name.endswith(_TEMP_SUFFIX)):
                continue
            try:
                fd = os.open(entry.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError:
                continue  # renamed into place meanwhile, or not a file of ours (a symlink)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue  # a live writer's
            try:
                os.unlink(entry.path)
                removed.append(entry.name)
            except FileNotFoundError:
                pass  # its writer renamed it just before it let go of the lock
            finally:
                os.close(fd)
        return removed

    def claim_uids(self) -> set[str]:
        """The claims that have a spec file of ours, e.g. to clean up after a lost store."""
        try:
            entries = list(os.scandir(self._dir))
        except FileNotFoundError:
            return set()
        uids: set[str] = set()
        for entry in entries:
            if not (entry.name.startswith(self._prefix) and entry.name.endswith(_SUFFIX)):
                continue
            uid = entry.name[len(self._prefix) : -len(_SUFFIX)]
            if _is_claim_uid(uid) and entry.is_file(follow_symlinks=False):
                uids.add(uid)
        return uids

    def read(self, claim_uid: str) -> dict[str, Any] | None:
        """The claim's spec as written, or None when it has none."""
        path = self.path_for(claim_uid)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        try:
            spec = json.loads(text)
        except ValueError as err:
            raise ValueError(
                f"{path} is not valid JSON ({err}); remove it and prepare the claim again"
            ) from err
        if not isinstance(spec, dict):
            raise ValueError(f"{path} does not hold a CDI spec object; remove it and prepare the claim again")
        return spec


def _locked_temp_file(directory: Path, prefix: str) -> tuple[int, str]:
    """A new temporary file in ``directory``, exclusively locked; (fd, path).

    Between creating the file and locking it, another instance's sweep may take it for an
    abandoned one and delete it; then the name no longer leads to our file, and we start over.
    """
    while True:
        fd, name = tempfile.mkstemp(dir=directory, prefix=prefix, suffix=_TEMP_SUFFIX)
        fcntl.flock(fd, fcntl.LOCK_EX)
        with contextlib.suppress(FileNotFoundError):
            if os.stat(name, follow_symlinks=False).st_ino == os.fstat(fd).st_ino:
                return fd, name
        os.close(fd)


def _is_claim_uid(text: str) -> bool:
    try:
        check_claim_uid(text)
    except ValueError:
        return False
    return True
