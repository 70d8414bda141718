"""What every container gets from the host: the driver's files by capability, and nvidia-cdi-hook."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from dra_driver.devices.types import Inventory
from dra_driver.gpu_plugin.policies import edits_for
from dra_driver.settings import Settings

VERSION = "580.95.05"
LIB = "usr/lib64"  # a RHEL host: the hook's ldcache update makes Debian images find the libraries here
INVENTORY = Inventory(gpus=(), driver_version=VERSION, cuda_driver_version=(13, 0))


# The command names a Go build of NVIDIA's nvidia-cdi-hook carries, v1.18 and a v1.17.
NEW_HOOK = b"\x7fELF create-symlinks enable-cuda-compat update-ldcache disable-device-node-modification chmod"
OLD_HOOK = b"\x7fELF create-symlinks update-ldcache chmod"


def _driver_root(root: Path, *extra: str, hook: bytes = NEW_HOOK) -> Path:
    for relative in (f"{LIB}/libcuda.so.{VERSION}", f"{LIB}/libnvidia-ml.so.{VERSION}", *extra):
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_bytes(hook if relative.endswith("nvidia-cdi-hook") else b"\x7fELF")
    return root


def _settings(**values: object) -> Settings:
    return Settings(node_name="n1", **values)  # type: ignore[arg-type]


def test_the_hook_in_the_driver_root_is_used_by_its_host_path(tmp_path: Path) -> None:
    seen_at = _driver_root(tmp_path / "driver-root", "usr/bin/nvidia-cdi-hook")
    settings = _settings(driver_root=Path("/run/nvidia/driver"), driver_root_mount=seen_at)
    hooks = edits_for(settings, INVENTORY).hooks
    assert [hook.path for hook in hooks] == ["/run/nvidia/driver/usr/bin/nvidia-cdi-hook"] * 4
    assert [hook.args[1] for hook in hooks] == [
        "create-symlinks",
        "enable-cuda-compat",
        "update-ldcache",
        "disable-device-node-modification",
    ]
    assert hooks[2].args == ("nvidia-cdi-hook", "update-ldcache", "--folder", f"/{LIB}")


def test_a_hook_older_than_toolkit_1_18_gets_only_the_commands_it_has(tmp_path: Path) -> None:
    """A command the host's hook lacks would fail the hook, and the runtime would not start the container."""
    seen_at = _driver_root(tmp_path / "driver-root", "usr/bin/nvidia-cdi-hook", hook=OLD_HOOK)
    settings = _settings(driver_root=Path("/run/nvidia/driver"), driver_root_mount=seen_at)
    assert [hook.args[1] for hook in edits_for(settings, INVENTORY).hooks] == [
        "create-symlinks",
        "update-ldcache",
    ]


def test_a_configured_hook_path_wins_and_without_one_there_are_no_hooks(tmp_path: Path) -> None:
    root = _driver_root(tmp_path / "driver-root")
    assert edits_for(_settings(driver_root=root), INVENTORY).hooks == ()
    configured = _settings(driver_root=root, nvidia_cdi_hook_path="/usr/local/nvidia/toolkit/nvidia-cdi-hook")
    hooks = edits_for(configured, INVENTORY).hooks
    assert {h.path for h in hooks} == {"/usr/local/nvidia/toolkit/nvidia-cdi-hook"}
    # That path is not readable here, so only what every hook version has is run.
    assert [hook.args[1] for hook in hooks] == ["create-symlinks", "update-ldcache"]


def test_video_libraries_are_mounted_by_setting(tmp_path: Path) -> None:
    root = _driver_root(tmp_path / "driver-root", f"{LIB}/libnvcuvid.so.{VERSION}")

    def mounted(settings: Settings) -> set[str]:
        return {Path(m.container_path).name for m in edits_for(settings, INVENTORY).mounts}

    assert f"libnvcuvid.so.{VERSION}" not in mounted(_settings(driver_root=root))
    assert f"libnvcuvid.so.{VERSION}" in mounted(
        _settings(driver_root=root, driver_capabilities="compute,video")
    )


def test_unknown_capabilities_and_relative_hook_paths_are_refused() -> None:
    with pytest.raises(ValidationError, match="unknown driver capabilities display"):
        _settings(driver_capabilities="display")
    with pytest.raises(ValidationError, match="not an absolute path"):
        _settings(nvidia_cdi_hook_path="bin/nvidia-cdi-hook")
