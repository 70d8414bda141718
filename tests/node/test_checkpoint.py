"""The checkpoint file: round trip, every kind of damage detected and moved aside, stale boots."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dra_driver.node import checkpoint as ckpt
from dra_driver.node.checkpoint import Checkpoint, CheckpointUnreadable, ClaimRecord, DeviceRecord

BOOT = "5f0c1e2d-0000-4000-8000-000000000001"


def sample() -> Checkpoint:
    device = DeviceRecord(
        request="gpu/large",
        pool="node-a",
        device="gpu-0",
        share_id="s-1",
        cdi_device_ids=("k8s.gpu.dra-driver.dev/claim=u1-gpu-0",),
        config={"apiVersion": "resource.dra-driver.dev/v1alpha1", "kind": "GpuConfig"},
    )
    admin = DeviceRecord(
        request="mon", pool="node-a", device="gpu-1", admin_access=True, cdi_device_ids=("k/c=u2-gpu-1",)
    )
    return Checkpoint(
        boot_id=BOOT,
        generation=7,
        claims={
            "u1": ClaimRecord(
                namespace="ns", name="c1", phase="PrepareCompleted", attempt="a1", devices=(device,)
            ),
            "u2": ClaimRecord(
                namespace="ns", name="c2", phase="PrepareStarted", attempt="a2", devices=(admin,)
            ),
        },
    )


def test_round_trip_through_the_file(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.json"
    written = ckpt.write(path, sample())

    loaded = ckpt.load(path, BOOT)

    assert loaded.checkpoint == sample()
    assert loaded.stale == {}
    assert loaded.moved_aside is None
    assert path.read_bytes() == written
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.json"]  # no temp file left


def test_file_format_is_versioned_and_checksummed(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.json"
    ckpt.write(path, sample())

    document = json.loads(path.read_text())

    assert document["schemaVersion"] == ckpt.SCHEMA_VERSION
    assert document["checksum"].startswith("sha256:")
    assert document["payload"]["bootId"] == BOOT
    assert document["payload"]["claims"]["u1"]["devices"][0]["cdiDeviceIds"] == [
        "k8s.gpu.dra-driver.dev/claim=u1-gpu-0"
    ]


def test_missing_file_is_an_empty_state(tmp_path: Path) -> None:
    loaded = ckpt.load(tmp_path / "checkpoint.json", BOOT)

    assert loaded.checkpoint == Checkpoint(boot_id=BOOT)
    assert (loaded.stale, loaded.moved_aside) == ({}, None)


def test_other_boot_reports_stale_claims_and_starts_empty(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.json"
    ckpt.write(path, sample())

    loaded = ckpt.load(path, "another-boot")

    assert loaded.checkpoint.claims == {}
    assert loaded.checkpoint.boot_id == "another-boot"
    assert loaded.stale == sample().claims


def test_unknown_boot_keeps_the_state(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.json"
    ckpt.write(path, sample())

    assert ckpt.load(path, "").checkpoint == sample()


@pytest.mark.parametrize("content", [None, b"", b"\n", b"\xff\xfe not text"])
def test_a_missing_or_empty_boot_id_refuses_to_start(tmp_path: Path, content: bytes | None) -> None:
    boot_id = tmp_path / "boot_id"
    if content is not None:
        boot_id.write_bytes(content)

    with pytest.raises(ckpt.BootIdUnavailable, match="DRA_BOOT_ID_FILE"):
        ckpt.read_boot_id(boot_id)


def test_a_file_of_a_newer_schema_is_refused_and_left_alone(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.json"
    newer = json.dumps({"schemaVersion": ckpt.SCHEMA_VERSION + 1, "checksum": "sha256:x", "payload": {}})
    path.write_text(newer)

    with pytest.raises(ckpt.CheckpointFromNewerDriver, match=r"newer version of the driver \(schema 3"):
        ckpt.load(path, BOOT)

    assert path.read_text() == newer  # neither moved aside nor rewritten
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.json"]


def test_leftover_temporary_files_are_removed_and_nothing_else(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.json"
    ckpt.write(path, sample())
    for leftover in (".checkpoint.json.abc123.tmp", ".checkpoint.json.x.tmp"):
        (tmp_path / leftover).write_text("{half")
    (tmp_path / ".other.json.a.tmp").write_text("not ours")

    assert ckpt.remove_leftover_temps(path) == 2

    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.json.a.tmp", "checkpoint.json"]
    assert ckpt.load(path, BOOT).checkpoint == sample()


ENCODED = ckpt.encode(sample())


@given(cut=st.integers(0, len(ENCODED) - 2))
def test_truncation_at_any_byte_is_detected(cut: int) -> None:
    with pytest.raises(CheckpointUnreadable):
        ckpt.decode(ENCODED[:cut])


@settings(max_examples=300)
@given(position=st.integers(0, len(ENCODED) - 1), flip=st.integers(1, 255))
def test_a_changed_byte_is_detected_or_harmless(position: int, flip: int) -> None:
    damaged = bytearray(ENCODED)
    damaged[position] ^= flip
    try:
        decoded = ckpt.decode(bytes(damaged))
    except CheckpointUnreadable:
        return
    # Only whitespace between tokens can change without notice, and it means nothing.
    assert decoded == sample()


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"", "not JSON"),
        (b"{not json", "not JSON"),
        (b"\xff\xfe", "not JSON"),
        (b"[]", "not a checkpoint"),
        (
            json.dumps({"schemaVersion": 0, "checksum": "x", "payload": {}}).encode(),
            "schemaVersion 0 is not 2",
        ),
        (ENCODED.replace(b'"generation": 7', b'"generation": 8'), "checksum mismatch"),
    ],
)
def test_bad_file_is_moved_aside_and_state_starts_empty(tmp_path: Path, content: bytes, reason: str) -> None:
    path = tmp_path / "checkpoint.json"
    path.write_bytes(content)
    with pytest.raises(CheckpointUnreadable, match=reason):
        ckpt.decode(content)

    loaded = ckpt.load(path, BOOT)

    assert loaded.checkpoint == Checkpoint(boot_id=BOOT)
    assert loaded.moved_aside is not None
    assert loaded.moved_aside.name.startswith("checkpoint.json.corrupt-")
    assert loaded.moved_aside.read_bytes() == content
    assert not path.exists()


def test_payload_that_breaks_the_schema_is_unreadable() -> None:
    document = json.loads(ENCODED)
    document["payload"]["claims"]["u1"]["phase"] = "Half"
    payload = ckpt.canonical_json(document["payload"])
    document["checksum"] = "sha256:" + hashlib.sha256(payload).hexdigest()

    with pytest.raises(CheckpointUnreadable, match="does not match schema 2"):
        ckpt.decode(json.dumps(document).encode())


def test_two_bad_files_in_one_second_are_both_kept(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.json"
    path.write_bytes(b"first")
    first = ckpt.load(path, BOOT).moved_aside
    path.write_bytes(b"second")
    second = ckpt.load(path, BOOT).moved_aside

    assert first is not None
    assert second is not None
    assert {first.read_bytes(), second.read_bytes()} == {b"first", b"second"}
