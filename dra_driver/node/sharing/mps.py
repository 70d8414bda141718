"""MPS control daemons: one per claim (or per share), started at prepare and stopped at unprepare.

CUDA's Multi-Process Service lets the processes of several containers share one GPU through one
MPS server, which enforces per-client limits: the share of the GPU's threads a client may use
(``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``) and the device memory it may pin
(``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``). The server is started by a control daemon
(``nvidia-cuda-mps-control -d``) that clients find through its *pipe directory*; server and
clients also share ``/dev/shm``.

As in NVIDIA's DRA driver, each daemon gets a directory of its own on the host,
``<root>/<id>/{pipe,log,shm}``, and every container of the claim gets:

* ``<root>/<id>/pipe`` at ``/tmp/nvidia-mps`` and ``CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps``;
* ``<root>/<id>/shm`` as its ``/dev/shm``;
* the limits as client variables: ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=<1-100>`` and
  ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=<uuid>=<MiB>M,...`` (one entry per device that has a limit).
  The daemon is given the same values as its defaults (``set_default_active_thread_percentage``,
  ``set_default_device_pinned_mem_limit``), as NVIDIA's is, so a client that drops the variables
  still gets them.

Unlike NVIDIA's clients, no container gets the log directory (only the daemon writes there: a
client that could would plant links for the privileged daemon to follow) nor the
``nvidia-cuda-mps-control`` program (:data:`dra_driver.devices.driver_root.BINARIES`), with which
any client could ``quit`` the daemon. The control pipe itself every client needs, so this raises
the bar and is no boundary: a client that speaks the control protocol itself can still stop the
daemon it shares.

Where the daemon runs is the :class:`MpsDaemons` implementation's business:

* :class:`~dra_driver.node.sharing.mps_deployment.DeploymentMpsDaemons` (a real node): a
  Deployment of one privileged pod per daemon in the plugin's namespace, pinned to the node,
  shaped like NVIDIA's ``mps-control-daemon`` template, owned by the Node object and labelled
  with the claim, so that it goes with the node and leftovers can be found;
* :class:`~dra_driver.simulated.mps_daemons.LocalMpsDaemons` (a simulated node, where no
  kubelet runs pods): a stand-in process per daemon with the same lifecycle -- directories,
  startup, readiness (``startup.log``), failure (the process exits, its log says why), stop.

Either way :meth:`MpsDaemons.start` is idempotent (a repeated prepare finds the daemon running),
:meth:`MpsDaemons.wait_ready` raises :class:`MpsDaemonError` with the daemon's own words when it
fails or does not come up in time, and :meth:`MpsDaemons.stop` is idempotent and removes the
directories.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from dra_driver.cdi.spec import Mount

PIPE_DIR = "/tmp/nvidia-mps"
LOG_DIR = "/var/log/nvidia-mps"
SHM_DIR = "/dev/shm"
READY_FILE = "startup.log"  # written into the log directory once the daemon has its settings
# Bind mounts the container may write through (the pipe, shared memory), never execute from.
MPS_BIND = ("rw", "nosuid", "nodev", "noexec", "bind")
DEFAULT_READY_TIMEOUT_S = 30.0


class MpsDaemonError(Exception):
    """An MPS control daemon could not be started, did not become ready, or could not be stopped."""


@dataclass(frozen=True)
class MpsDevice:
    """One device an MPS daemon serves: a full GPU or a MIG device, by the uuid CUDA knows it by."""

    uuid: str
    pinned_memory_limit_bytes: int | None = None  # per client; None: no limit


@dataclass(frozen=True)
class MpsDaemonSpec:
    """What one MPS control daemon serves, and with which client limits.

    ``id`` names the daemon (its directory, its Deployment, its process); :func:`daemon_id` makes
    one per claim as NVIDIA's driver does. ``claim_uid`` and ``claim`` (``namespace/name``) label
    what the daemon is for.
    """

    id: str
    claim_uid: str
    claim: str
    devices: tuple[MpsDevice, ...]
    active_thread_percentage: int | None = None

    def __post_init__(self) -> None:
        if not self.devices:
            raise ValueError(f"MPS daemon {self.id}: no devices")
        if self.active_thread_percentage is not None and not 1 <= self.active_thread_percentage <= 100:
            raise ValueError(
                f"MPS daemon {self.id}: active thread percentage {self.active_thread_percentage} "
                "is not within 1-100"
            )
        for device in self.devices:
            limit = device.pinned_memory_limit_bytes
            if limit is not None and limit < 2**20:
                raise ValueError(
                    f"MPS daemon {self.id}: pinned memory limit {limit} bytes for {device.uuid} "
                    "is below 1 MiB"
                )

    @property
    def visible_devices(self) -> str:
        """``CUDA_VISIBLE_DEVICES`` of the daemon: the uuids of its devices."""
        return ",".join(device.uuid for device in self.devices)

    @property
    def pinned_memory_limits(self) -> dict[str, str]:
        """uuid -> limit as MPS takes it (``<MiB>M``), for the devices with a limit."""
        return {
            device.uuid: f"{device.pinned_memory_limit_bytes // 2**20}M"
            for device in self.devices
            if device.pinned_memory_limit_bytes is not None
        }


@dataclass(frozen=True)
class MpsPaths:
    """A daemon's directories, as host paths (what CDI mounts and the daemon writes)."""

    root: Path

    @property
    def pipe(self) -> Path:
        return self.root / "pipe"

    @property
    def log(self) -> Path:
        return self.root / "log"

    @property
    def shm(self) -> Path:
        return self.root / "shm"


def daemon_id(claim_uid: str, device_uuids: Sequence[str]) -> str:
    """``<claimUID>-<5 hex>``: NVIDIA's name for a claim's daemon (a hash of its device uuids)."""
    digest = hashlib.sha256(",".join(device_uuids).encode()).hexdigest()[:5]
    return f"{claim_uid}-{digest}"


def container_env(spec: MpsDaemonSpec) -> tuple[tuple[str, str], ...]:
    """The variables every container of the daemon's claim gets (see the module doc)."""
    env: list[tuple[str, str]] = [("CUDA_MPS_PIPE_DIRECTORY", PIPE_DIR)]
    if spec.active_thread_percentage is not None:
        env.append(("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", str(spec.active_thread_percentage)))
    if limits := spec.pinned_memory_limits:
        env.append(
            (
                "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT",
                ",".join(f"{uuid}={limit}" for uuid, limit in limits.items()),
            )
        )
    return tuple(env)


def container_mounts(paths: MpsPaths) -> tuple[Mount, ...]:
    """The daemon's pipe and shared-memory directories, bound into every container of the claim."""
    return (
        Mount(str(paths.pipe), PIPE_DIR, MPS_BIND),
        Mount(str(paths.shm), SHM_DIR, MPS_BIND),
    )


def control_commands(spec: MpsDaemonSpec) -> list[str]:
    """The ``nvidia-cuda-mps-control`` commands that give the daemon its default client limits."""
    commands = []
    if spec.active_thread_percentage is not None:
        commands.append(f"set_default_active_thread_percentage {spec.active_thread_percentage}")
    commands.extend(
        f"set_default_device_pinned_mem_limit {uuid} {limit}"
        for uuid, limit in spec.pinned_memory_limits.items()
    )
    return commands


class MpsDaemons(Protocol):
    """Where a node's MPS control daemons run; every method is safe to repeat."""

    def paths(self, daemon_id: str) -> MpsPaths:
        """The host directories of daemon ``daemon_id`` (they exist once it is started)."""
        ...

    async def start(self, spec: MpsDaemonSpec) -> MpsPaths:
        """Create the directories and start the daemon; one already running is left as it is."""
        ...

    async def wait_ready(self, spec: MpsDaemonSpec, timeout_s: float = DEFAULT_READY_TIMEOUT_S) -> None:
        """Return once the daemon serves clients; :class:`MpsDaemonError` when it failed or timed out."""
        ...

    async def stop(self, daemon_id: str) -> None:
        """Stop the daemon and remove its directories; one that is gone already is fine."""
        ...

    async def running(self) -> set[str]:
        """The ids of the daemons this node has (to find leftovers no claim records)."""
        ...
