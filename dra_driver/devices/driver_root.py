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

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from dra_driver.devices.backend import DeviceError

# The user-space libraries of each NVIDIA_DRIVER_CAPABILITIES class, as NVIDIA's container
# toolkit mounts them (libnvidia-container's nvc_info.c lists), all versioned with the driver
# (lib<name>.so.<driver version>). Not every driver branch ships all of them; only libcuda and
# libnvidia-ml are required.
LIBRARIES_BY_CAPABILITY: dict[str, tuple[str, ...]] = {
    "utility": (
        "libnvidia-ml",  # NVML, for nvidia-smi and monitoring inside the container
        "libnvidia-cfg",  # GPU configuration queries used by nvidia-smi
        "libnvidia-nscq",  # NVSwitch configuration and query (HGX systems)
    ),
    "compute": (
        "libcuda",  # the CUDA driver API
        "libcudadebugger",  # cuda-gdb's back end
        "libnvidia-opencl",  # the OpenCL implementation
        "libnvidia-gpucomp",  # the shader/PTX compiler shared by newer branches
        "libnvidia-ptxjitcompiler",  # JIT-compiles PTX for the GPU at hand
        "libnvidia-fatbinaryloader",  # fatbin loader of older branches
        "libnvidia-allocator",  # buffer allocation used by EGL/GBM and CUDA interop
        "libnvidia-compiler",  # NVVM-PTX compiler for OpenCL on older branches
        "libnvidia-pkcs11",  # encryption for confidential computing
        "libnvidia-pkcs11-openssl3",
        "libnvidia-nvvm",  # NVVM compiler, used by JIT linking (LTO) in CUDA 12+
    ),
    "video": (
        "libvdpau_nvidia",  # VDPAU
        "libnvidia-encode",  # NVENC
        "libnvidia-opticalflow",  # optical flow
        "libnvcuvid",  # NVDEC
    ),
    "graphics": (
        "libnvidia-eglcore",
        "libnvidia-glcore",
        "libnvidia-tls",
        "libnvidia-glsi",
        "libnvidia-fbc",  # framebuffer capture
        "libnvidia-ifr",
        "libnvidia-rtcore",  # OptiX
        "libnvoptix",  # OptiX
        "libGLX_nvidia",  # GLVND vendor libraries
        "libEGL_nvidia",
        "libGLESv2_nvidia",
        "libGLESv1_CM_nvidia",
        "libnvidia-glvkspirv",  # Vulkan SPIR-V compiler
    ),
}
CAPABILITIES = ("compute", "utility", "graphics", "video")
DEFAULT_CAPABILITIES = ("compute", "utility")
# The compute and utility libraries, as mounted by default.
COMPUTE_LIBRARIES = LIBRARIES_BY_CAPABILITY["utility"] + LIBRARIES_BY_CAPABILITY["compute"]
REQUIRED_LIBRARIES = ("libcuda", "libnvidia-ml")

# The driver's tools every container gets. Not the MPS control program (NVIDIA's toolkit mounts
# it): a container that is an MPS client would use it to `quit` the control daemon its neighbours
# share. The daemons run it from the driver root themselves.
BINARIES = (
    "nvidia-smi",
    "nvidia-debugdump",
    "nvidia-persistenced",
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


def parse_capabilities(text: str) -> tuple[str, ...]:
    """``compute,utility`` -> the classes, in a fixed order; ``all`` is every class. ValueError if unknown."""
    wanted = {part.strip() for part in text.split(",") if part.strip()}
    if "all" in wanted:
        return CAPABILITIES
    unknown = sorted(wanted - set(CAPABILITIES))
    if unknown or not wanted:
        raise ValueError(
            f"unknown driver capabilities {', '.join(unknown) or '(none given)'}: use a comma-separated "
            f"list of {', '.join(CAPABILITIES)}, or all"
        )
    return tuple(c for c in CAPABILITIES if c in wanted)


CDI_HOOK = "nvidia-cdi-hook"


def find_cdi_hook(driver_root: Path, *, seen_at: Path | None = None) -> str | None:
    """The host path of ``nvidia-cdi-hook`` in the driver root's binary folders, if it is there."""
    found = find_in(seen_at or driver_root, BINARY_DIRS, CDI_HOOK)
    return str(PurePosixPath(driver_root / found)) if found else None


def cdi_hook_commands(binary: Path, commands: Iterable[str]) -> frozenset[str]:
    """Which of ``commands`` the ``nvidia-cdi-hook`` at ``binary`` (as this process sees it) has.

    Read from the binary rather than run: it is the host's, and a Go program carries each
    command's name as a string. An unknown command fails the hook, and the runtime then refuses
    to start the container, so a spec may only name what the host's hook has.
    """
    try:
        content = binary.read_bytes()
    except OSError as e:
        raise DeviceError(f"cannot read nvidia-cdi-hook at {binary} to see which commands it has: {e}") from e
    return frozenset(command for command in commands if command.encode() in content)


def find_driver_files(
    driver_root: Path,
    driver_version: str,
    *,
    seen_at: Path | None = None,
    capabilities: tuple[str, ...] = DEFAULT_CAPABILITIES,
) -> DriverFiles:
    """The files of driver ``driver_version`` under ``driver_root``; DeviceError without libcuda/NVML.

    ``seen_at`` is where this process sees the driver root (default: at ``driver_root`` itself);
    ``capabilities`` are the NVIDIA_DRIVER_CAPABILITIES classes whose libraries are included
    (compute and utility always: libcuda and NVML are required).
    """
    lookup_root = seen_at or driver_root
    wanted = dict.fromkeys(("compute", "utility", *capabilities))
    names = [name for capability in wanted for name in LIBRARIES_BY_CAPABILITY[capability]]

    def first(directories: tuple[str, ...], name: str) -> HostFile | None:
        found = find_in(lookup_root, directories, name)
        return _host_file(driver_root, found) if found else None

    libraries: list[HostFile] = []
    for library in names:
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
