"""GPU instances a failed rollback left behind, remembered until they are destroyed.

Creating a MIG device is two NVML calls (a GPU instance, then a compute instance in it), and a
failure after the first is rolled back. When NVML keeps failing through every attempt of the
rollback, the GPU instance lives on: nobody holds it, and its memory slices are lost to every
claim. The NVML backend records such an instance here and tries to destroy it again at each
inventory read (the periodic refresh) and at the next start, until NVML answers; until then the
inventory lists its slices as reserved, never as a device.

A GPU instance is named by its GPU, profile and placement, not by its id: placements on one GPU
never overlap, and the rollback may have failed before NVML told the id. The record lives in
the plugin's state directory, so a restart keeps it; it carries the kernel's boot id, because
MIG instances do not survive a reboot, and an instance at the same place after one is somebody
else's.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path

import structlog

from dra_driver.devices.types import Placement

log = structlog.get_logger(__name__)

ORPHANS_FILE = "nvml-orphaned-gpu-instances.json"


@dataclass(frozen=True, order=True)
class Orphan:
    """A GPU instance the driver created and could not destroy."""

    gpu_uuid: str
    profile_id: int
    placement: Placement


def boot_id(procfs_root: Path) -> str | None:
    """The kernel's boot id (``/proc/sys/kernel/random/boot_id``), or None where it cannot be read."""
    try:
        return (procfs_root / "sys" / "kernel" / "random" / "boot_id").read_text().strip() or None
    except OSError:
        return None


class OrphanRecord:
    """The orphaned GPU instances, in ``path`` (None: in memory only, for a backend without state)."""

    def __init__(self, path: Path | None, current_boot: str | None) -> None:
        self._path = path
        self._boot = current_boot
        self._in_memory: set[Orphan] = set()
        self._lock = threading.Lock()  # NVML work runs in several worker threads at once

    def entries(self) -> set[Orphan]:
        if self._path is None:
            return set(self._in_memory)
        try:
            data = json.loads(self._path.read_text())
            recorded_boot = data.get("bootId")
            orphans = {
                Orphan(str(e["gpu"]), int(e["profileId"]), Placement(int(e["start"]), int(e["size"])))
                for e in data["instances"]
            }
        except FileNotFoundError:
            return set()
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            log.warning("orphan_record_unreadable", path=str(self._path), error=str(e))
            return set()
        if recorded_boot and self._boot and recorded_boot != self._boot:
            log.info("orphan_record_from_an_earlier_boot_dropped", instances=len(orphans))
            return set()
        return orphans

    def add(self, orphan: Orphan) -> None:
        with self._lock:
            self._write(self.entries() | {orphan})

    def discard(self, orphan: Orphan) -> None:
        with self._lock:
            entries = self.entries()
            if orphan in entries:
                self._write(entries - {orphan})

    def discard_overlapping(self, gpu_uuid: str, placement: Placement) -> None:
        """Forget the orphans a new GPU instance at ``placement`` proves gone: NVML refuses overlaps."""
        with self._lock:
            entries = self.entries()
            stale = {
                o
                for o in entries
                if o.gpu_uuid == gpu_uuid and set(o.placement.memory_slices) & set(placement.memory_slices)
            }
            if stale:
                log.info(
                    "orphan_record_gone", gpu=gpu_uuid, placements=sorted(o.placement.start for o in stale)
                )
                self._write(entries - stale)

    def _write(self, orphans: set[Orphan]) -> None:
        self._in_memory = orphans
        if self._path is None:
            return
        instances = [
            {
                "gpu": o.gpu_uuid,
                "profileId": o.profile_id,
                "start": o.placement.start,
                "size": o.placement.size,
            }
            for o in sorted(orphans)
        ]
        tmp = self._path.with_suffix(".tmp")
        try:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps({"bootId": self._boot, "instances": instances}) + "\n")
            tmp.replace(self._path)
        except OSError as e:
            log.error("orphan_record_failed", path=str(self._path), error=str(e))
            # The file no longer says what is true: the in-memory record is, for the life of the process.
            self._path = None
