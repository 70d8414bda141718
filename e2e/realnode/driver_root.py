"""A simulated GPU host's driver root: the files a GPU container gets from the NVIDIA driver.

The driver (`--simulate`) finds its libraries here exactly as on a GPU host, so its CDI specs mount
them into containers; the device nodes are real character devices with NVIDIA's major numbers
(made with mknod), as the driver container of NVIDIA's GPU operator has them under its root. No
NVIDIA kernel module exists, so opening one fails (ENXIO): what a container checks is that it was
given the node, which runc creates from the numbers in the CDI spec.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from dra_driver.simulated.gpus import CONTROL_NODES, DRIVER_VERSION, NVIDIA_CAPS_MAJOR
from dra_driver.simulated.nodes import NVIDIA_MAJOR, node_profile
from dra_driver.simulated.sysfs import FIRST_GROUP, VFIO_GROUP_MAJOR, VFIO_MISC

LIBRARY_DIR = "usr/lib/x86_64-linux-gnu"
BUSYBOX = "/bin/busybox"  # Debian's busybox-static (hack/install-deps.sh), statically linked
LIBRARIES = ("libcuda", "libnvidia-ml", "libnvidia-ptxjitcompiler")


def make_driver_root(root: Path, profile: str) -> None:
    """Fills `root` for the GPUs of node profile `profile` (dra-driver inventory --list-profiles)."""
    gpus = len(node_profile(profile).gpu_models)
    libraries = root / LIBRARY_DIR
    libraries.mkdir(parents=True, exist_ok=True)
    for name in LIBRARIES:
        versioned = libraries / f"{name}.so.{DRIVER_VERSION}"
        versioned.write_text(f"simulated {name} {DRIVER_VERSION}: the driver's files reach the container\n")
        link = libraries / f"{name}.so.1"
        if not link.is_symlink():
            link.symlink_to(versioned.name)
    binaries = root / "usr" / "bin"
    binaries.mkdir(parents=True, exist_ok=True)
    smi = binaries / "nvidia-smi"
    smi.write_text(
        "#!/bin/sh\necho 'simulated nvidia-smi: no NVIDIA kernel module on this host' >&2\nexit 9\n"
    )
    smi.chmod(0o755)
    dev = root / "dev"
    nodes = [(f"nvidia{minor}", NVIDIA_MAJOR, minor) for minor in range(gpus)]
    nodes += [(node.path.removeprefix("/dev/"), node.major, node.minor) for node in CONTROL_NODES]
    nodes += [
        ("nvidia-caps/nvidia-cap1", NVIDIA_CAPS_MAJOR, 1),
        ("nvidia-caps/nvidia-cap2", NVIDIA_CAPS_MAJOR, 2),
    ]
    for name, major, minor in nodes:
        path = dev / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists():
            os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(major, minor))


def vfio_device_nodes(profile: str) -> list[tuple[str, int, int, int]]:
    """The host's VFIO device nodes (path, major, minor, mode) for the GPUs of node profile ``profile``.

    On a host with an IOMMU, binding a GPU to vfio-pci makes ``/dev/vfio/<group>`` (root, 0600),
    with the numbers sysfs gives in ``class/vfio/<group>/dev``, beside ``/dev/vfio/vfio`` (0666);
    a passthrough claim's CDI spec names the group's node by its path alone, so the runtime reads
    the numbers from the host's node. These are the simulator's (:mod:`dra_driver.simulated.sysfs`:
    group ``FIRST_GROUP + index`` per GPU), made for every GPU up front: what a container gets is
    decided by the spec, which names only the groups of its claim's GPUs.
    """
    gpus = len(node_profile(profile).gpu_models)
    groups = [
        (f"/dev/vfio/{group}", VFIO_GROUP_MAJOR, group, 0o600)
        for group in range(FIRST_GROUP, FIRST_GROUP + gpus)
    ]
    return [("/dev/vfio/vfio", *VFIO_MISC, 0o666), *groups]


def make_nvml_driver_root(
    root: Path, mock_library: Path, driver_version: str, profile: str = "dgx-h100"
) -> None:
    """A driver root for the NVML backend: as :func:`make_driver_root`, with the mock
    libnvidia-ml.so.1 (hack/mock-nvml) where a Debian/Ubuntu host keeps NVML.

    The library is copied, not linked: the plugin's container sees only the driver root. The
    user-space libraries carry the version the mock's driver reports, as a host's do.
    """
    make_driver_root(root, profile)
    libraries = root / LIBRARY_DIR
    for name in LIBRARIES:
        versioned = libraries / f"{name}.so.{driver_version}"
        if name == "libnvidia-ml":
            versioned.write_bytes(mock_library.read_bytes())
        else:
            versioned.write_text(f"simulated {name} {driver_version}\n")
        link = libraries / f"{name}.so.1"
        link.unlink(missing_ok=True)
        link.symlink_to(versioned.name)
        (libraries / f"{name}.so.{DRIVER_VERSION}").unlink(missing_ok=True)
    _mps_control_standin(root)


# nvidia-cuda-mps-control as the plugin's MPS daemon pod runs it, `chroot <driver root> sh -c ...`
# (dra_driver/node/sharing/mps_deployment.py): `-d` starts a daemon that keeps the control pipe
# until it is stopped, and without it one command is read from stdin and logged, as the real
# program applies it. It shares nothing (there is no GPU); what is real is the pod, its startup
# probe, the directories the workload's containers get, and the daemon's going with the claim.
_MPS_CONTROL = """#!/bin/sh
pipe=${CUDA_MPS_PIPE_DIRECTORY:-/tmp/nvidia-mps}
log=${CUDA_MPS_LOG_DIRECTORY:-/var/log/nvidia-mps}/control.log
if [ "$1" = "-d" ]; then
    echo "stand-in MPS control daemon started (CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES)" >> "$log"
    rm -f "$pipe/control" && /bin/busybox mkfifo "$pipe/control"
    (trap 'rm -f "$pipe/control"; exit 0' TERM; while :; do /bin/busybox sleep 1; done) \
        < /dev/null > /dev/null 2>&1 &
    exit 0
fi
read -r command
echo "applied: $command" >> "$log"
"""


def _mps_control_standin(root: Path) -> None:
    """A static busybox as the driver root's sh, and the nvidia-cuda-mps-control stand-in above."""
    bin_dir = root / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    busybox = bin_dir / "busybox"
    if not busybox.exists():
        busybox.write_bytes(Path(BUSYBOX).read_bytes())
        busybox.chmod(0o755)
    sh = bin_dir / "sh"
    if not sh.is_symlink():
        sh.symlink_to("busybox")
    control = root / "usr" / "bin" / "nvidia-cuda-mps-control"
    control.write_text(_MPS_CONTROL)
    control.chmod(0o755)
