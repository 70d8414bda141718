"""What the node remembers of a prepared claim: the records the store keeps (:mod:`dra_driver.node.store`).

A claim's record is one row of the store, its JSON the pydantic model below; what its
devices occupy is derived from it (:func:`dra_driver.node.store.units`) into rows that
the database's unique index keeps exclusive. The same models read the schema-2 files of
earlier versions (:mod:`dra_driver.node.legacy`), whose JSON they kept.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel


class MutationRejected(Exception):
    """The change contradicts the store; the message is for the user, ``holder`` the claim in the way."""

    def __init__(self, message: str, holder: str | None = None) -> None:
        super().__init__(message)
        self.holder = holder


class StoreWriteError(Exception):
    """The store could not be written (disk full, I/O error); the change did not happen."""


class StoreFromNewerDriver(Exception):
    """The store was written by a newer schema: this driver must neither believe nor replace it."""


Phase = Literal["PrepareStarted", "PrepareCompleted", "Recovered"]
"""PrepareStarted: devices reserved, side effects (MIG devices, CDI spec) may be
half done. PrepareCompleted: everything done; a repeated prepare returns it as is.
Recovered: rebuilt from a CDI spec after the store was lost; the devices are
known and stay reserved until the claim's unprepare, or until a repeated prepare
records the claim in full again."""


class _Record(BaseModel):
    # defer_build: the schemas are built when the first record is read, after the kubelet
    # sockets opened, not when the CLI imports this module for its errors.
    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        frozen=True,
        alias_generator=to_camel,
        validate_by_name=True,
        defer_build=True,
    )


class MigRecord(_Record):
    """The MIG device that prepare creates for a MIG placement (dynamic MIG) and unprepare destroys.

    It is recorded with PrepareStarted, before the device is created, and ``uuid`` is added
    once the device exists: after a crash in between, the placement still tells which live
    instance is ours (see :mod:`dra_driver.node.recovery`).
    """

    parent_uuid: str
    parent_device: str  # the full GPU's device name ("gpu-0"): not preparable while this exists
    profile_id: int  # the GPU-instance profile id, as the backend takes it
    placement_start: int
    placement_size: int
    uuid: str | None = None  # "MIG-...", once created


class PassthroughRecord(_Record):
    """A GPU that prepare moved to vfio-pci for a virtual machine, and unprepare gives back to nvidia.

    Recorded with PrepareStarted, before the GPU is unbound: after a crash in between, the
    unprepare (or the next prepare) still knows which GPU to bind back.
    """

    parent_device: str  # the full GPU's device name ("gpu-0"): it and its MIG devices are excluded
    pci_bus_id: str  # "0000:3b:00.0", the address sysfs knows it by


class DeviceRecord(_Record):
    """One prepared allocation result."""

    request: str  # "req" or "req/sub"; empty when recovered from a CDI spec
    pool: str
    device: str
    admin_access: bool = False
    share_id: str | None = None
    # A share's consumed memory and its GPU's, both in bytes: the store refuses shares of one GPU
    # that together exceed it. Unknown (None) for a share recovered from its CDI spec.
    share_bytes: int | None = Field(default=None, exclude_if=lambda value: value is None)
    gpu_bytes: int | None = Field(default=None, exclude_if=lambda value: value is None)
    cdi_device_ids: tuple[str, ...]
    config: dict[str, Any] | None = None  # the effective opaque config, as the user would write it
    mig: MigRecord | None = None  # set when prepare creates the device (dynamic MIG)
    # A passthrough device (gpu-vfio-<index>); left out of the file when not (most devices).
    passthrough: PassthroughRecord | None = Field(default=None, exclude_if=lambda value: value is None)


class GpuPolicyRecord(_Record):
    """A full GPU whose compute mode and time slice the claim set, and what to put back.

    Recorded with PrepareStarted, before the GPU is changed: after a crash in between, the
    unprepare (or the next prepare) still knows what the GPU had.
    """

    gpu_uuid: str
    compute_mode: str  # a ComputeMode value: what the claim sets
    time_slice: str  # a TimeSlice value
    previous_compute_mode: str  # what the GPU had before the first claim that changed it
    previous_time_slice: str


class SharingRecord(_Record):
    """What sharing changed on the node for a claim: GPU settings and the MPS control daemon."""

    gpus: tuple[GpuPolicyRecord, ...] = ()
    mps_daemon: str | None = None  # the id of the claim's MPS control daemon


class ClaimRecord(_Record):
    namespace: str  # empty when recovered from a CDI spec
    name: str
    phase: Phase
    attempt: str  # unique per prepare attempt: tells a live attempt from a leftover
    devices: tuple[DeviceRecord, ...]
    # TimeSlicing or MPS applied on the GPU; left out of the file when none (most claims).
    sharing: SharingRecord | None = Field(default=None, exclude_if=lambda value: value is None)
    # Prepared by the binding watcher before the pod was bound (KEP-5007, dra_driver.node.binding),
    # and not yet asked for by the kubelet: the watcher undoes it if the pod never comes. Left out of
    # the file when false, so records stay as earlier versions wrote them.
    ahead_of_binding: bool = Field(default=False, exclude_if=lambda value: not value)

    @property
    def device_names(self) -> frozenset[str]:
        """The devices the claim holds (what the binding watcher compares with its allocation)."""
        return frozenset(device.device for device in self.devices)


@dataclass(frozen=True)
class SharingState:
    """What the claims' sharing set on the node: the store's ``gpu_settings`` and ``mps_daemons``."""

    gpus: dict[str, dict[str, tuple[str, GpuPolicyRecord]]] = field(default_factory=dict)
    """GPU uuid -> claim uid -> (the claim as a message names it, what it set and what to restore)."""
    daemons: dict[str, set[str]] = field(default_factory=dict)  # MPS daemon id -> uids of its claims


@dataclass(frozen=True)
class NodeState:
    """Every claim the store holds: by claim uid."""

    claims: dict[str, ClaimRecord] = field(default_factory=dict)
    boot_id: str = ""  # the boot the store's claims belong to
    sharing: SharingState = field(default_factory=SharingState)


def describe(uid: str, record: ClaimRecord) -> str:
    """A claim as a user's message names it."""
    return named(uid, record.namespace, record.name)


def named(uid: str, namespace: str, name: str) -> str:
    return f"{namespace}/{name} ({uid})" if namespace else f"{uid} (recovered from its CDI spec)"


class BootIdUnavailable(Exception):
    """Without the boot id, state from before a reboot would be believed: refuse to start."""


def read_boot_id(path: Path) -> str:
    """This boot's id; :class:`BootIdUnavailable` when it cannot be read.

    Stale-state detection rests on it: with no boot id, claims prepared before a reboot
    would be believed, and their devices (gone with the reboot) never handed out again.
    """
    try:
        boot_id = path.read_text().strip()
    except (OSError, UnicodeDecodeError) as error:
        reason = error.strerror if isinstance(error, OSError) else "not text"
        raise BootIdUnavailable(
            f"cannot read the boot id from {path}: {reason or error}; it tells prepared state "
            "from before a reboot, so the driver does not start without it (mount the host's /proc, "
            "or point --boot-id-file / DRA_BOOT_ID_FILE at a file that holds it)"
        ) from None
    if not boot_id:
        raise BootIdUnavailable(f"the boot id file {path} is empty; see --boot-id-file / DRA_BOOT_ID_FILE")
    return boot_id
