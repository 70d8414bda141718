"""Which MIG devices this driver created, kept apart from the checkpoint.

A MIG device looks the same whether the driver created it for a claim (dynamic MIG: it
destroys the device at unprepare) or an administrator did (static MIG: it is never
destroyed). The checkpoint records the difference, but a checkpoint can be lost or
damaged; the CDI specs then tell which claims are prepared, yet not which of their MIG
devices are the driver's. Without that, a full GPU and a MIG device on it could be given
to two claims, and the driver's devices would live on as static ones forever.

So every MIG device the driver creates also gets a small file of its own here,
``<uuid>.json`` holding the checkpoint's :class:`MigRecord` of it, written after the
create and removed after the destroy. One file per device means a damaged file costs
one entry, never the ledger. The files block on the file system; callers on the event
loop use ``asyncio.to_thread``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import structlog
from pydantic import ValidationError

from dra_driver.node.checkpoint import MigRecord, write_atomically

log = structlog.get_logger(__name__)

MIG_LEDGER_DIR = "mig-devices"  # beside the checkpoint, in the plugin's data directory

# NVML's MIG uuids ("MIG-<uuid>"); anything else cannot be a file name we wrote.
_UUID = re.compile(r"MIG-[0-9A-Za-z-]{1,100}")


class MigLedger:
    """The driver's MIG devices, one file each in ``directory``."""

    def __init__(self, directory: Path) -> None:
        self._dir = directory

    def add(self, mig: MigRecord) -> None:
        """Remember a MIG device the driver just created (``mig.uuid`` set)."""
        if mig.uuid is None or not _UUID.fullmatch(mig.uuid):
            raise ValueError(f"not a MIG device uuid: {mig.uuid!r}")
        write_atomically(self._dir / f"{mig.uuid}.json", mig.model_dump_json(by_alias=True).encode())

    def remove(self, uuid: str) -> None:
        """Forget a MIG device that was destroyed (or is gone); forgetting twice is fine."""
        if _UUID.fullmatch(uuid):
            (self._dir / f"{uuid}.json").unlink(missing_ok=True)

    def entries(self) -> dict[str, MigRecord]:
        """MIG uuid -> what the driver created there; unreadable entries are logged and skipped."""
        try:
            names = os.listdir(self._dir)
        except FileNotFoundError:
            return {}
        found: dict[str, MigRecord] = {}
        for name in sorted(names):
            uuid = name.removesuffix(".json")
            if not name.endswith(".json") or not _UUID.fullmatch(uuid):
                continue  # a temporary file of an interrupted write, or not ours
            try:
                mig = MigRecord.model_validate_json((self._dir / name).read_bytes())
            except (OSError, ValidationError) as error:
                log.warning("skipping an unreadable MIG ledger entry", file=name, error=str(error))
                continue
            if mig.uuid == uuid:
                found[uuid] = mig
        return found
