"""The claim specs on disk, in the directory the container runtime reads (``/var/run/cdi``).

A runtime may read the directory at any moment -- containerd and CRI-O watch it --
and refuses a file it cannot parse, so a spec appears whole or not at all: it is
written to a temporary file whose name the runtime ignores (hidden, ending in
``.tmp``, while runtimes read only ``.json`` and ``.yaml``), flushed, renamed into
place and the directory flushed, so that a crash leaves either the old spec or the
new one.

All methods block on the file system; callers on the event loop use
``asyncio.to_thread``.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dra_driver.cdi.spec import cdi_kind, check_claim_uid
from dra_driver.cdi.validate import validate_spec

_SUFFIX = ".json"
_NAME_MAX = 255  # bytes in one file name on Linux file systems


class SpecStore:
    """The transient specs of one driver: ``<cdi_dir>/k8s.<driver>-claim_<claimUID>.json``."""

    def __init__(self, cdi_dir: Path, driver_name: str) -> None:
        self._dir = cdi_dir
        self._kind = cdi_kind(driver_name)
        # The name CDI's own GenerateTransientSpecName gives: vendor-class_id.
        self._prefix = self._kind.replace("/", "-") + "_"

    def path_for(self, claim_uid: str) -> Path:
        """Where the spec of ``claim_uid`` lives; ValueError for a UID that is not a safe file-name part."""
        check_claim_uid(claim_uid)
        name = f"{self._prefix}{claim_uid}{_SUFFIX}"
        if len(name.encode()) > _NAME_MAX:
            raise ValueError(
                f"claim UID {claim_uid!r} makes the spec file name {name!r} longer than {_NAME_MAX} bytes"
            )
        return self._dir / name

    def write(self, claim_uid: str, spec: Mapping[str, Any]) -> Path:
        """Validate ``spec`` and replace the claim's spec file with it atomically; returns the path."""
        path = self.path_for(claim_uid)
        validate_spec(spec)
        if spec["kind"] != self._kind:
            raise ValueError(
                f"spec of kind {spec['kind']!r} does not belong in this driver's {self._kind!r} files"
            )
        data = (json.dumps(spec, indent=2) + "\n").encode()

        self._dir.mkdir(parents=True, exist_ok=True)
        fd, temp_name = tempfile.mkstemp(dir=self._dir, prefix=f".{path.stem}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as temp:
                temp.write(data)
                temp.flush()
                # Readable like any other spec: tools such as `cdi list` need not run as root.
                os.fchmod(temp.fileno(), 0o644)
                os.fsync(temp.fileno())
            os.replace(temp_name, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp_name)
            raise
        self._sync_directory()
        return path

    def remove(self, claim_uid: str) -> None:
        """Delete the claim's spec; a spec that is already gone is fine."""
        path = self.path_for(claim_uid)
        try:
            path.unlink()
        except FileNotFoundError:
            return
        self._sync_directory()

    def claim_uids(self) -> set[str]:
        """The claims that have a spec file of ours, e.g. to clean up after a lost checkpoint."""
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

    def remove_leftover_temps(self, older_than_s: float = 60.0) -> int:
        """Remove temporary files of writes a crash interrupted; returns how many.

        Only files older than ``older_than_s`` go: a younger one may belong to a write in
        progress by the other plugin instance of a rolling update.
        """
        try:
            entries = list(os.scandir(self._dir))
        except FileNotFoundError:
            return 0
        deadline = time.time() - older_than_s
        removed = 0
        for entry in entries:
            if not (entry.name.startswith("." + self._prefix) and entry.name.endswith(".tmp")):
                continue
            with contextlib.suppress(FileNotFoundError):  # its writer renamed it meanwhile
                if entry.stat(follow_symlinks=False).st_mtime <= deadline:
                    os.unlink(entry.path)
                    removed += 1
        return removed

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

    def _sync_directory(self) -> None:
        """Make a rename or unlink durable: it lives in the directory, not in the file."""
        fd = os.open(self._dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _is_claim_uid(text: str) -> bool:
    try:
        check_claim_uid(text)
    except ValueError:
        return False
    return True
