"""The host driver files a GPU container needs, found under a driver root.

The driver root is where the NVIDIA user-space driver is installed on the host:
``/`` for a driver installed there, ``/run/nvidia/driver`` for one installed by a
driver container. Inside the workload's container every file appears at its path
relative to that root, so ``<root>/usr/lib64/libcuda.so.X`` is mounted at
``/usr/lib64/libcuda.so.X``. The plugin itself usually runs in a container too,
which sees the host's driver root mounted elsewhere (``/driver-root``): files are
looked up there, while the CDI spec names them by their host paths, because the
container runtime reads them on the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from dra_driver.devices.backend import DeviceError

# The user-space libraries of the compute and utility driver capabilities, all
# versioned with the driver (lib<name>.so.<driver version>). Not every driver
# branch ships all of them; only libcuda and libnvidia-ml are required.
COMPUTE_LIBRARIES = (
    "libcuda",  # the CUDA driver API
    "libnvidia-ml",  # NVML, for nvidia-smi and monitoring inside the container
    "libnvidia-ptxjitcompiler",  # JIT-compiles PTX for the GPU at hand
    "libnvidia-nvvm",  # NVVM compiler, used by JIT linking (LTO) in CUDA 12+
    "libcudadebugger",  # cuda-gdb's back end
    "libnvidia-gpucomp",  # the shader/PTX compiler shared by newer branches
    "libnvidia-allocator",  # buffer allocation used by EGL/GBM and CUDA interop
    "libnvidia-cfg",  # GPU configuration queries used by nvidia-smi
    "libnvidia-opencl",  # the OpenCL implementation
)
REQUIRED_LIBRARIES = ("libcuda", "libnvidia-ml")

BINARIES = (
    "nvidia-smi",
    "nvidia-debugdump",
    "nvidia-persistenced",
    "nvidia-cuda-mps-control",
    "nvidia-cuda-mps-server",
)

# Where distributions install the driver's libraries, relative to the driver root; the first match wins.
LIBRARY_DIRS = (
    "usr/lib64",
    "usr/lib/x86_64-linux-gnu",
    "usr/lib/aarch64-linux-gnu",
    "lib64",
    "lib/x86_64-linux-gnu",
    "lib/aarch64-linux-gnu",
    "usr/lib",
    "lib",
)
BINARY_DIRS = ("usr/bin", "usr/sbin", "bin", "sbin", "usr/local/bin")
FIRMWARE_DIRS = ("lib/firmware/nvidia", "usr/lib/firmware/nvidia")


@dataclass(frozen=True)
class HostFile:
    """A file on the host and the path it gets in the container."""

    host_path: PurePosixPath
    container_path: PurePosixPath


@dataclass(frozen=True)
class DriverFiles:
    root: PurePosixPath
    driver_version: str
    libraries: tuple[HostFile, ...]
    binaries: tuple[HostFile, ...]
    firmware: HostFile | None  # the GSP firmware directory, on drivers that use one


def _host_file(root: Path, relative: str) -> HostFile:
    return HostFile(PurePosixPath(root / relative), PurePosixPath("/") / relative)


def find_in(seen_at: Path, directories: tuple[str, ...], name: str) -> str | None:
    """The first ``<directory>/<name>`` that exists under ``seen_at``, relative to it."""
    for directory in directories:
        candidate = f"{directory}/{name}"
        if (seen_at / candidate).exists():
            return candidate
    return None


def _soname_links(driver_root: Path, lookup_root: Path, library: HostFile) -> list[HostFile]:
    """The links that make ``library`` loadable, e.g. ``libcuda.so.1 -> libcuda.so.580.95.05``.

    Programs open libraries by soname, and without nvidia-cdi-hook nothing would create
    these links in the container. A bind mount of a link mounts its target, so mounting the
    link at its own path gives the container the library under the name it looks for.
    """
    relative_dir = library.container_path.parent.relative_to("/")
    seen_dir = lookup_root / relative_dir
    stem = library.container_path.name.split(".so.")[0]
    links = []
    for candidate in sorted(seen_dir.glob(f"{stem}.so*")):
        if candidate.is_symlink() and candidate.resolve().name == library.container_path.name:
            links.append(_host_file(driver_root, str(relative_dir / candidate.name)))
    return links


def find_driver_files(driver_root: Path, driver_version: str, *, seen_at: Path | None = None) -> DriverFiles:
    """The files of driver ``driver_version`` under ``driver_root``; DeviceError without libcuda/NVML.

    ``seen_at`` is where this process sees the driver root (default: at ``driver_root`` itself).
    """
    lookup_root = seen_at or driver_root

    def first(directories: tuple[str, ...], name: str) -> HostFile | None:
        found = find_in(lookup_root, directories, name)
        return _host_file(driver_root, found) if found else None

    libraries: list[HostFile] = []
    for library in COMPUTE_LIBRARIES:
        found = first(LIBRARY_DIRS, f"{library}.so.{driver_version}")
        if found:
            libraries.append(found)
            libraries.extend(_soname_links(driver_root, lookup_root, found))
        elif library in REQUIRED_LIBRARIES:
            searched = ", ".join(str(lookup_root / d) for d in LIBRARY_DIRS)
            raise DeviceError(
                f"{library}.so.{driver_version} is not under driver root {driver_root} (searched "
                f"{searched}); set the driver root to where the NVIDIA driver of this version is installed"
            )
    binaries = tuple(found for name in BINARIES if (found := first(BINARY_DIRS, name)))
    firmware = first(FIRMWARE_DIRS, driver_version)
    return DriverFiles(
        root=PurePosixPath(driver_root),
        driver_version=driver_version,
        libraries=tuple(libraries),
        binaries=binaries,
        firmware=firmware,
    )
