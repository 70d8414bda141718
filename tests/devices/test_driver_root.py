"""Finding the host driver's files under a driver root, on fake roots laid out like real installs."""

from __future__ import annotations

from pathlib import Path, PurePosixPath

import pytest

from dra_driver.devices.backend import DeviceError
from dra_driver.devices.driver_root import (
    DriverFiles,
    HostFile,
    find_cdi_hook,
    find_driver_files,
    parse_capabilities,
)

VERSION = "580.95.05"


def _install(root: Path, *files: str) -> None:
    for relative in files:
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"\x7fELF")


def _by_name(files: tuple[HostFile, ...]) -> dict[str, HostFile]:
    return {f.container_path.name: f for f in files}


def test_a_driver_container_root_maps_files_to_their_host_layout(tmp_path):
    root = tmp_path / "run" / "nvidia" / "driver"
    _install(
        root,
        f"usr/lib/x86_64-linux-gnu/libcuda.so.{VERSION}",
        f"usr/lib/x86_64-linux-gnu/libnvidia-ml.so.{VERSION}",
        f"usr/lib/x86_64-linux-gnu/libnvidia-ptxjitcompiler.so.{VERSION}",
        f"usr/lib/x86_64-linux-gnu/libnvidia-nvvm.so.{VERSION}",
        "usr/bin/nvidia-smi",
        "usr/bin/nvidia-persistenced",
        "usr/bin/nvidia-cuda-mps-control",
        f"lib/firmware/nvidia/{VERSION}/gsp_ga10x.bin",
    )
    files = find_driver_files(root, VERSION)
    assert isinstance(files, DriverFiles)
    assert files.root == PurePosixPath(root)
    assert files.driver_version == VERSION
    libcuda = _by_name(files.libraries)[f"libcuda.so.{VERSION}"]
    assert libcuda.host_path == PurePosixPath(root / f"usr/lib/x86_64-linux-gnu/libcuda.so.{VERSION}")
    assert libcuda.container_path == PurePosixPath(f"/usr/lib/x86_64-linux-gnu/libcuda.so.{VERSION}")
    assert [f.container_path.name for f in files.libraries] == [  # compute, then utility
        f"libcuda.so.{VERSION}",
        f"libnvidia-ptxjitcompiler.so.{VERSION}",
        f"libnvidia-nvvm.so.{VERSION}",
        f"libnvidia-ml.so.{VERSION}",
    ]
    # Not the MPS control program: an MPS client would `quit` the daemon its neighbours share.
    assert {f.container_path for f in files.binaries} == {
        PurePosixPath("/usr/bin/nvidia-smi"),
        PurePosixPath("/usr/bin/nvidia-persistenced"),
    }
    assert files.firmware == HostFile(
        PurePosixPath(root / f"lib/firmware/nvidia/{VERSION}"),
        PurePosixPath(f"/lib/firmware/nvidia/{VERSION}"),
    )


def test_an_rpm_layout_uses_lib64_and_has_no_firmware(tmp_path):
    _install(tmp_path, f"usr/lib64/libcuda.so.{VERSION}", f"usr/lib64/libnvidia-ml.so.{VERSION}")
    files = find_driver_files(tmp_path, VERSION)
    assert {str(f.container_path) for f in files.libraries} == {
        f"/usr/lib64/libcuda.so.{VERSION}",
        f"/usr/lib64/libnvidia-ml.so.{VERSION}",
    }
    assert (files.binaries, files.firmware) == ((), None)


def test_arm_hosts_are_searched_too(tmp_path):
    _install(
        tmp_path,
        f"usr/lib/aarch64-linux-gnu/libcuda.so.{VERSION}",
        f"usr/lib/aarch64-linux-gnu/libnvidia-ml.so.{VERSION}",
    )
    files = find_driver_files(tmp_path, VERSION)
    assert all(str(f.container_path).startswith("/usr/lib/aarch64-linux-gnu/") for f in files.libraries)


def test_only_the_running_drivers_version_is_taken(tmp_path):
    _install(
        tmp_path,
        f"usr/lib64/libcuda.so.{VERSION}",
        f"usr/lib64/libnvidia-ml.so.{VERSION}",
        "usr/lib64/libnvidia-opencl.so.570.86.15",  # a leftover of the previous driver
        "usr/lib64/libcuda.so.570.86.15",
        "lib/firmware/nvidia/570.86.15/gsp_tu10x.bin",
    )
    files = find_driver_files(tmp_path, VERSION)
    assert [f.container_path.name for f in files.libraries] == [
        f"libcuda.so.{VERSION}",
        f"libnvidia-ml.so.{VERSION}",
    ]
    assert files.firmware is None


def test_the_first_library_directory_wins(tmp_path):
    _install(
        tmp_path,
        f"usr/lib64/libcuda.so.{VERSION}",
        f"lib64/libcuda.so.{VERSION}",
        f"usr/lib64/libnvidia-ml.so.{VERSION}",
    )
    libcuda = _by_name(find_driver_files(tmp_path, VERSION).libraries)[f"libcuda.so.{VERSION}"]
    assert libcuda.container_path == PurePosixPath(f"/usr/lib64/libcuda.so.{VERSION}")


def test_the_container_path_is_the_host_path_without_the_root(tmp_path):
    _install(tmp_path, f"usr/lib64/libcuda.so.{VERSION}", f"usr/lib64/libnvidia-ml.so.{VERSION}")
    (libcuda, _) = find_driver_files(tmp_path, VERSION).libraries
    assert PurePosixPath(tmp_path) / libcuda.container_path.relative_to("/") == libcuda.host_path


def test_a_root_without_libcuda_says_what_to_set(tmp_path):
    _install(tmp_path, f"usr/lib64/libnvidia-ml.so.{VERSION}")
    with pytest.raises(
        DeviceError, match=rf"libcuda\.so\.{VERSION} is not under driver root .*set the driver root"
    ):
        find_driver_files(tmp_path, VERSION)


def test_files_seen_at_a_mount_are_named_by_their_host_paths(tmp_path: Path) -> None:
    # The plugin's container sees the host's / at /driver-root; the runtime reads the host's paths.
    mount = tmp_path / "driver-root"
    _install(
        mount, f"usr/lib64/libcuda.so.{VERSION}", f"usr/lib64/libnvidia-ml.so.{VERSION}", "usr/bin/nvidia-smi"
    )
    files = find_driver_files(Path("/"), VERSION, seen_at=mount)
    libcuda = _by_name(files.libraries)[f"libcuda.so.{VERSION}"]
    assert libcuda.host_path == PurePosixPath(f"/usr/lib64/libcuda.so.{VERSION}")
    assert libcuda.container_path == PurePosixPath(f"/usr/lib64/libcuda.so.{VERSION}")
    assert [b.host_path for b in files.binaries] == [PurePosixPath("/usr/bin/nvidia-smi")]
    with pytest.raises(DeviceError, match=str(tmp_path / "elsewhere")):
        find_driver_files(Path("/"), VERSION, seen_at=tmp_path / "elsewhere")


def test_soname_links_are_mounted_so_programs_find_the_libraries(tmp_path: Path) -> None:
    lib = tmp_path / "usr/lib64"
    _install(tmp_path, f"usr/lib64/libcuda.so.{VERSION}", f"usr/lib64/libnvidia-ml.so.{VERSION}")
    (lib / "libcuda.so.1").symlink_to(f"libcuda.so.{VERSION}")
    (lib / "libcuda.so").symlink_to("libcuda.so.1")  # the development link resolves to it as well
    (lib / "libnvidia-ml.so.1").symlink_to(f"libnvidia-ml.so.{VERSION}")
    (lib / "libcuda.so.2").symlink_to("elsewhere.so")  # not a link to this driver's library
    names = [f.container_path.name for f in find_driver_files(tmp_path, VERSION).libraries]
    assert names == [
        f"libcuda.so.{VERSION}",
        "libcuda.so",
        "libcuda.so.1",
        f"libnvidia-ml.so.{VERSION}",
        "libnvidia-ml.so.1",
    ]


def test_video_and_graphics_libraries_come_only_when_asked_for(tmp_path):
    lib = "usr/lib/x86_64-linux-gnu"
    _install(
        tmp_path,
        f"{lib}/libcuda.so.{VERSION}",
        f"{lib}/libnvidia-ml.so.{VERSION}",
        f"{lib}/libnvidia-nscq.so.{VERSION}",
        f"{lib}/libnvcuvid.so.{VERSION}",
        f"{lib}/libnvidia-encode.so.{VERSION}",
        f"{lib}/libGLX_nvidia.so.{VERSION}",
    )
    default = {f.container_path.name for f in find_driver_files(tmp_path, VERSION).libraries}
    assert default == {f"libcuda.so.{VERSION}", f"libnvidia-ml.so.{VERSION}", f"libnvidia-nscq.so.{VERSION}"}
    video = {
        f.container_path.name for f in find_driver_files(tmp_path, VERSION, capabilities=("video",)).libraries
    }
    assert video == default | {f"libnvcuvid.so.{VERSION}", f"libnvidia-encode.so.{VERSION}"}
    everything = find_driver_files(tmp_path, VERSION, capabilities=parse_capabilities("all")).libraries
    assert f"libGLX_nvidia.so.{VERSION}" in {f.container_path.name for f in everything}


def test_driver_capabilities_are_nvidias_classes():
    assert parse_capabilities("video, compute") == ("compute", "video")
    assert parse_capabilities("all") == ("compute", "utility", "graphics", "video")
    with pytest.raises(ValueError, match=r"unknown driver capabilities display: use a comma-separated list"):
        parse_capabilities("compute,display")


def test_the_cdi_hook_is_found_in_the_driver_root_and_named_by_its_host_path(tmp_path):
    seen_at = tmp_path / "driver-root"
    assert find_cdi_hook(Path("/run/nvidia/driver"), seen_at=seen_at) is None
    _install(seen_at, "usr/bin/nvidia-cdi-hook")
    assert (
        find_cdi_hook(Path("/run/nvidia/driver"), seen_at=seen_at)
        == "/run/nvidia/driver/usr/bin/nvidia-cdi-hook"
    )
