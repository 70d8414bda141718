"""The record of orphaned GPU instances, on its own: what it keeps when its file cannot be written."""

from __future__ import annotations

from pathlib import Path

from dra_driver.devices.nvml_orphans import Orphan, OrphanRecord
from dra_driver.devices.types import Placement

ORPHAN = Orphan("GPU-1e6e8190-b542-509f-b116-838e12aea6ae", 19, Placement(3, 1))


def test_an_orphan_the_file_could_not_take_is_still_remembered(tmp_path: Path) -> None:
    blocked = tmp_path / "not-a-directory"
    blocked.write_text("")  # the record's parent is a file: every write fails
    record = OrphanRecord(blocked / "orphans.json", "boot-1")

    record.add(ORPHAN)

    assert record.entries() == {ORPHAN}
    record.discard(ORPHAN)
    assert record.entries() == set()


def test_the_record_survives_a_restart_of_the_same_boot_only(tmp_path: Path) -> None:
    path = tmp_path / "orphans.json"
    OrphanRecord(path, "boot-1").add(ORPHAN)

    assert OrphanRecord(path, "boot-1").entries() == {ORPHAN}
    assert OrphanRecord(path, "boot-2").entries() == set()
