"""The MPS daemons' /dev/shm on a real node: a tmpfs of the configured size (--mps-shm-size)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dra_driver.apiserver.rest import JsonApi
from dra_driver.node.sharing import mps_deployment
from dra_driver.node.sharing.mps_deployment import DeploymentMpsDaemons
from dra_driver.settings import shm_size_bytes


def mounted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, size: int | None) -> list[str]:
    commands: list[list[str]] = []
    monkeypatch.setattr(mps_deployment, "_run", commands.append)
    daemons = DeploymentMpsDaemons(
        JsonApi(None),  # type: ignore[arg-type]  # no API call is made here
        namespace="dra",
        node_name="node-1",
        image="image",
        driver_root="/",
        root=tmp_path,
        shm_size_bytes=size,
    )
    daemons._make_dirs(daemons.paths("d-1"))
    (command,) = commands
    return command


def test_the_tmpfs_has_the_configured_size(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    command = mounted(tmp_path, monkeypatch, shm_size_bytes("64Mi"))
    assert command == [
        "mount",
        "-t",
        "tmpfs",
        "-o",
        "rw,nosuid,nodev,noexec,size=65536k",
        "shm",
        str(tmp_path / "d-1" / "shm"),
    ]


def test_unset_it_is_half_the_node_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mps_deployment, "_half_the_memory", lambda: "8388608k")
    assert "rw,nosuid,nodev,noexec,size=8388608k" in mounted(tmp_path, monkeypatch, None)
