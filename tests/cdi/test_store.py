"""Spec files on a real file system, as the container runtime finds them."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

from dra_driver.cdi.spec import CommonEdits, claim_spec
from dra_driver.cdi.store import SpecStore
from dra_driver.cdi.validate import InvalidSpecError

from .conftest import CLAIM_UID, DRIVER, GPU0, GPU1, full_gpu

OTHER_UID = "7f3c2e1a-9b8d-4c6e-a5f4-3e2d1c0b9a87"


def spec_for(claim_uid: str, *gpus: Any) -> dict[str, Any]:
    return claim_spec(DRIVER, claim_uid, [full_gpu(gpu) for gpu in gpus or (GPU0,)], CommonEdits((), (), ()))


@pytest.fixture
def store(tmp_path: Path) -> SpecStore:
    return SpecStore(tmp_path / "cdi", DRIVER)


def runtime_visible(directory: Path) -> list[str]:
    """The files a CDI runtime would try to load."""
    return sorted(p.name for p in directory.iterdir() if p.suffix in (".json", ".yaml"))


def test_spec_lands_under_the_transient_name_and_reads_back(store: SpecStore, tmp_path: Path) -> None:
    spec = spec_for(CLAIM_UID)
    path = store.write(CLAIM_UID, spec)
    assert path == tmp_path / "cdi" / f"k8s.gpu.dra-driver.dev-claim_{CLAIM_UID}.json"
    assert json.loads(path.read_text()) == spec
    assert store.read(CLAIM_UID) == spec
    assert path.stat().st_mode & 0o777 == 0o644
    assert runtime_visible(path.parent) == [path.name]


def test_a_cdi_directory_removed_after_a_write_is_made_again(store: SpecStore, tmp_path: Path) -> None:
    store.write(CLAIM_UID, spec_for(CLAIM_UID))
    store.remove(CLAIM_UID)
    (tmp_path / "cdi").rmdir()
    path = store.write(OTHER_UID, spec_for(OTHER_UID))
    assert json.loads(path.read_text()) == spec_for(OTHER_UID)
    assert path.stat().st_mode & 0o777 == 0o644
    assert runtime_visible(tmp_path / "cdi") == [path.name]


def test_a_spec_is_one_line_of_compact_json(store: SpecStore) -> None:
    # Indented JSON is Python's slow pure-Python encoder: the spec is written as CDI's Go writer does.
    spec = spec_for(CLAIM_UID, GPU0, GPU1)
    text = store.write(CLAIM_UID, spec).read_text()
    assert text == json.dumps(spec, separators=(",", ":")) + "\n"
    assert json.loads(text) == spec


def test_rewriting_replaces_the_spec(store: SpecStore) -> None:
    store.write(CLAIM_UID, spec_for(CLAIM_UID, GPU0))
    store.write(CLAIM_UID, spec_for(CLAIM_UID, GPU1))
    assert store.read(CLAIM_UID) == spec_for(CLAIM_UID, GPU1)
    assert len(list(store.path_for(CLAIM_UID).parent.iterdir())) == 1


def test_the_runtime_never_sees_a_partial_file(store: SpecStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """Until the rename the bytes sit in a file the runtime ignores; a failed rename leaves the old spec."""
    old = spec_for(CLAIM_UID, GPU0)
    store.write(CLAIM_UID, old)
    directory = store.path_for(CLAIM_UID).parent
    seen: list[tuple[str, list[str], str]] = []
    real_replace = os.replace

    def failing_replace(source: str, target: str) -> None:
        # What a runtime scanning the directory at this instant would load.
        seen.append((source, runtime_visible(directory), Path(source).read_text()))
        raise OSError("disk gone")

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError, match="disk gone"):
        store.write(CLAIM_UID, spec_for(CLAIM_UID, GPU1))
    monkeypatch.setattr(os, "replace", real_replace)

    ((temp, visible, content),) = seen
    assert Path(temp).parent == directory  # same file system, so the rename is atomic
    assert Path(temp).name.startswith(".")
    assert Path(temp).suffix == ".tmp"
    assert visible == [store.path_for(CLAIM_UID).name]
    assert json.loads(content) == spec_for(CLAIM_UID, GPU1)  # the whole spec, flushed before the rename
    assert sorted(p.name for p in directory.iterdir()) == [store.path_for(CLAIM_UID).name]  # temp cleaned up
    assert store.read(CLAIM_UID) == old


def test_writes_and_removals_wait_for_no_disk_flush(
    store: SpecStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A kill -9 loses nothing the kernel has, and after an OS crash (a reboot) the plugin removes
    # every spec of the earlier boot before it serves: an fsync per spec would buy nothing.
    flushed: list[int] = []
    monkeypatch.setattr(os, "fsync", flushed.append)
    monkeypatch.setattr(os, "fdatasync", flushed.append)
    store.write(CLAIM_UID, spec_for(CLAIM_UID))
    store.remove(CLAIM_UID)
    assert flushed == []


def test_an_invalid_spec_is_never_written(store: SpecStore) -> None:
    spec = dict(spec_for(CLAIM_UID))  # a plain mapping: not checked where it was built, so checked here
    spec["devices"][0]["containerEdits"]["env"].append("NOT-AN-ASSIGNMENT")
    with pytest.raises(InvalidSpecError, match=re.escape("devices[0].containerEdits.env[1]")):
        store.write(CLAIM_UID, spec)
    assert not store.path_for(CLAIM_UID).parent.exists()


def test_another_drivers_spec_is_refused(store: SpecStore) -> None:
    spec = claim_spec("other.example.com", CLAIM_UID, [full_gpu(GPU0)], CommonEdits((), (), ()))
    with pytest.raises(ValueError, match=re.escape("'k8s.other.example.com/claim' does not belong")):
        store.write(CLAIM_UID, spec)


def test_remove_is_idempotent(store: SpecStore) -> None:
    store.write(CLAIM_UID, spec_for(CLAIM_UID))
    store.write(OTHER_UID, spec_for(OTHER_UID))
    store.remove(CLAIM_UID)
    store.remove(CLAIM_UID)
    store.remove("never-written")
    assert store.read(CLAIM_UID) is None
    assert store.claim_uids() == {OTHER_UID}


def test_remove_before_the_directory_exists_is_fine(store: SpecStore) -> None:
    store.remove(CLAIM_UID)
    assert store.claim_uids() == set()


@pytest.mark.parametrize(
    "claim_uid", ["../x", "a/b", "", ".", "..", "/etc/passwd", "x/../../y", "a\x00b", "-x", "x\n"]
)
def test_unsafe_claim_uids_are_refused_before_any_file_is_touched(
    claim_uid: str, tmp_path: Path, store: SpecStore
) -> None:
    bait = tmp_path / "x.json"
    bait.write_text("{}")
    with pytest.raises(ValueError, match=re.escape(f"claim UID {claim_uid!r} cannot name a CDI spec")):
        store.write(claim_uid, spec_for(CLAIM_UID))
    for operation in (store.path_for, store.remove, store.read):
        with pytest.raises(ValueError, match=re.escape(f"claim UID {claim_uid!r}")):
            operation(claim_uid)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.json"]
    assert bait.read_text() == "{}"


def test_a_uid_too_long_for_a_file_name_is_refused(store: SpecStore) -> None:
    with pytest.raises(ValueError, match="cannot name a CDI spec: it must be a Kubernetes UID: at most 64"):
        store.path_for("a" * 250)


def test_claim_uids_lists_only_our_spec_files(store: SpecStore) -> None:
    store.write(CLAIM_UID, spec_for(CLAIM_UID))
    store.write(OTHER_UID, spec_for(OTHER_UID))
    directory = store.path_for(CLAIM_UID).parent
    for stranger in (
        "nvidia.yaml",  # the node's static NVIDIA spec
        f"k8s.other.example.com-claim_{CLAIM_UID}.json",  # another driver's claim
        f"k8s.gpu.dra-driver.dev-claim_{CLAIM_UID}.yaml",  # not a name we write
        f".k8s.gpu.dra-driver.dev-claim_{CLAIM_UID}.abc123.tmp",  # an interrupted write
        "k8s.gpu.dra-driver.dev-claim_.json",  # no UID
        "k8s.gpu.dra-driver.dev-claim_-x.json",  # not a UID we would write
    ):
        (directory / stranger).write_text("{}")
    (directory / "k8s.gpu.dra-driver.dev-claim_dir.json").mkdir()
    assert store.claim_uids() == {CLAIM_UID, OTHER_UID}


def test_a_corrupt_spec_is_reported_with_its_path(store: SpecStore) -> None:
    path = store.path_for(CLAIM_UID)
    path.parent.mkdir()
    path.write_text('{"cdiVersion": ')
    with pytest.raises(ValueError, match=re.escape(f"{path} is not valid JSON")):
        store.read(CLAIM_UID)
    path.write_text("[]")
    with pytest.raises(ValueError, match="does not hold a CDI spec object"):
        store.read(CLAIM_UID)


WRITE_AND_CRASH = """
import sys
from pathlib import Path
from dra_driver.cdi.spec import CommonEdits, claim_spec
from dra_driver.cdi.store import SpecStore
from tests.cdi.conftest import DRIVER, GPU0, full_gpu
uid = sys.argv[2]
spec = claim_spec(DRIVER, uid, [full_gpu(GPU0)], CommonEdits((), (), ()))
SpecStore(Path(sys.argv[1]), DRIVER).write(uid, spec)
"""


def test_a_write_killed_before_its_rename_leaves_a_temp_file_the_next_start_removes(
    store: SpecStore, tmp_path: Path
) -> None:
    """kill -9 between writing and renaming: the runtime never sees the half-done spec, and the
    temporary file does not stay forever (found by the fault suite, e2e/reliability)."""
    import signal
    import subprocess
    import sys

    store.write(OTHER_UID, spec_for(OTHER_UID))
    directory = tmp_path / "cdi"
    crashed = subprocess.run(
        [sys.executable, "-c", WRITE_AND_CRASH, str(directory), CLAIM_UID],
        env={**os.environ, "TEST_DRA_CRASH_POINT": "cdi.before_rename"},
        cwd=Path(__file__).parents[2],
        capture_output=True,
        text=True,
    )
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    (temp,) = [p.name for p in directory.iterdir() if p.suffix == ".tmp"]
    assert runtime_visible(directory) == [store.path_for(OTHER_UID).name]

    assert store.remove_leftover_temps() == [temp]
    assert sorted(p.name for p in directory.iterdir()) == [store.path_for(OTHER_UID).name]


def test_a_temp_file_a_live_writer_holds_is_kept(store: SpecStore, tmp_path: Path) -> None:
    """During a rolling update the other instance may be writing a spec right now."""
    import fcntl

    directory = tmp_path / "cdi"
    directory.mkdir()
    in_use = directory / f".{store.path_for(CLAIM_UID).stem}.abc123.tmp"
    abandoned = directory / f".{store.path_for(OTHER_UID).stem}.def456.tmp"
    not_ours = directory / ".other-vendor.com-claim_x.tmp"
    for path in (in_use, abandoned, not_ours):
        path.write_text("{")
    with in_use.open() as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        assert store.remove_leftover_temps() == [abandoned.name]
    assert sorted(p.name for p in directory.iterdir()) == sorted([in_use.name, not_ours.name])


def test_a_temp_file_swept_before_its_writer_locked_it_is_replaced(
    store: SpecStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The one moment a sweep can take a live writer's file: between its creation and its lock."""
    import tempfile

    real_mkstemp = tempfile.mkstemp
    created: list[str] = []

    def mkstemp_then_swept(**options: Any) -> tuple[int, str]:
        fd, name = real_mkstemp(**options)
        created.append(name)
        if len(created) == 1:
            store.remove_leftover_temps()  # another instance starting, at the worst moment
        return fd, name

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp_then_swept)
    store.write(CLAIM_UID, spec_for(CLAIM_UID))
    assert len(created) == 2
    assert store.read(CLAIM_UID) == spec_for(CLAIM_UID)
    assert not [p for p in store.path_for(CLAIM_UID).parent.iterdir() if p.suffix == ".tmp"]
