"""The NVIDIA kernel driver's capability device nodes (``/dev/nvidia-caps/nvidia-cap<N>``).

A process may use a MIG device only if it can open two capability nodes besides the parent
GPU's ``/dev/nvidia<minor>``: the GPU instance's and the compute instance's. The kernel driver
describes each in procfs (``/proc/driver/nvidia/capabilities/gpu<G>/mig/gi<I>/access`` and
``.../ci<C>/access``)::

    DeviceFileMinor: 12
    DeviceFileMode: 292
    DeviceFileModify: 1

and registers their character major as ``nvidia-caps`` in ``/proc/devices``. It does not create
the nodes: NVIDIA's setuid helper nvidia-modprobe does, on the host, when a process on the host
asks (nvidia-smi, NVML with ``ModifyDeviceFiles``). A MIG device this driver creates from its
own container is asked for by no process on the host, so a host's ``/dev/nvidia-caps`` can be
empty while the device exists. The CDI spec needs no host node (it gives the container path,
type and numbers, and the runtime makes the node in the container), but tools on the host and
runtimes that bind-mount device nodes instead of making them (rootless, user namespaces) do;
so the driver makes them as nvidia-modprobe would: with the major from ``/proc/devices``, the
minor and mode from the access file, and only where ``DeviceFileModify`` allows it.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

import structlog

from dra_driver.devices.backend import DeviceError

log = structlog.get_logger(__name__)

CAPS_DIR = "nvidia-caps"  # under /dev, as nvidia-modprobe makes it
CAPS_DIR_MODE = 0o755  # nvidia-modprobe's mode for /dev/nvidia-caps


@dataclass(frozen=True)
class Capability:
    """One capability as the kernel driver's ``access`` file describes it."""

    minor: int
    mode: int  # permission bits for the node (DeviceFileMode, decimal in the file)
    modify: bool  # DeviceFileModify: whether nvidia-modprobe may create or change the node

    @property
    def path(self) -> str:
        """The node's path in a container, and on the host under its /dev."""
        return f"/dev/{CAPS_DIR}/nvidia-cap{self.minor}"


def read_capability(access: Path) -> Capability:
    """The capability described by the procfs file ``access``."""
    try:
        lines = access.read_text().splitlines()
    except OSError as e:
        raise DeviceError(
            f"cannot read {access} ({e}): mount the host's /proc/driver/nvidia into the plugin "
            "and point its procfs root at it"
        ) from e
    fields = {key.strip(): value.strip() for key, _, value in (line.partition(":") for line in lines)}
    try:
        minor = int(fields["DeviceFileMinor"])
        mode = int(fields.get("DeviceFileMode", "292")) & 0o777  # 292 = 0o444, the driver's default
        modify = fields.get("DeviceFileModify", "1") != "0"
    except (KeyError, ValueError):
        raise DeviceError(
            f"{access} has no DeviceFileMinor number; is this an NVIDIA driver capability file?"
        ) from None
    return Capability(minor=minor, mode=mode, modify=modify)


def caps_major(procfs_root: Path) -> int:
    """The character major the kernel gave ``nvidia-caps``, from ``<procfs_root>/devices``."""
    devices = procfs_root / "devices"
    try:
        text = devices.read_text()
    except OSError as e:
        raise DeviceError(f"cannot read {devices} ({e}) to find the nvidia-caps device major") from e
    character = text.partition("Character devices:")[2].partition("Block devices:")[0]
    for line in character.splitlines():
        number, _, name = line.strip().partition(" ")
        if name == CAPS_DIR:
            return int(number)
    raise DeviceError(f"{devices} lists no nvidia-caps driver: is the NVIDIA kernel module loaded?")


def ensure_node(dev_root: Path, capability: Capability, major: int) -> bool:
    """Make the host's node of ``capability`` under ``<dev_root>/dev`` if it is missing.

    True when a node was made. A node that exists is left as it is (an administrator's, or
    nvidia-modprobe's); so is a missing one the driver may not modify. A node that cannot be
    made is logged and not an error: containers still get theirs from the CDI spec.
    """
    host = dev_root / "dev" / CAPS_DIR / f"nvidia-cap{capability.minor}"
    if not capability.modify or os.path.lexists(host):
        return False
    try:
        host.parent.mkdir(mode=CAPS_DIR_MODE, parents=True, exist_ok=True)
        os.mknod(host, stat.S_IFCHR | capability.mode, os.makedev(major, capability.minor))
        os.chmod(host, capability.mode)  # mknod's mode is masked by the umask
    except FileExistsError:
        return False  # made meanwhile by nvidia-modprobe on the host
    except OSError as e:
        log.warning("capability_node_not_created", path=str(host), error=str(e))
        return False
    log.info("capability_node_created", path=str(host), major=major, minor=capability.minor)
    return True
