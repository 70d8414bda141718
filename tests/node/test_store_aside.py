"""A damaged store is moved aside, never over an earlier one: each is kept for the bug report."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from dra_driver.node.store import STORE_FILE, open_store

BOOT = "boot-1"


def test_two_stores_damaged_within_one_second_are_both_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The aside name carries the time to the second; a second damage in that second must not
    overwrite the first (the clock is held still, so the test does not depend on timing)."""
    still = time.gmtime()
    monkeypatch.setattr(time, "gmtime", lambda *_: still)
    path = tmp_path / STORE_FILE
    kept = []
    for damage in (b"first damaged store " * 100, b"second damaged store " * 100):
        path.write_bytes(damage)
        opened = open_store(path, BOOT)
        opened.store.close()
        assert opened.moved_aside is not None
        kept.append(opened.moved_aside)
    first, second = kept
    assert first != second
    assert first.name.startswith(f"{STORE_FILE}.corrupt-")
    assert (first.read_bytes(), second.read_bytes()) == (
        b"first damaged store " * 100,
        b"second damaged store " * 100,
    )
