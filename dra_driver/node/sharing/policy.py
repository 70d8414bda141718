"""What a claim's sharing settings change on the node: pure rules, checked before anything changes.

For each device of a claim (admin access excepted: it looks at a device, never changes it):

===============  ===========================================  ===================================
strategy         full GPU                                     MIG device
===============  ===========================================  ===================================
Exclusive        nothing                                      nothing
TimeSlicing      compute mode Default, the claim's time       nothing: MIG devices time-slice
                 slice (Default, Short, Medium, Long)         with a fixed slice that cannot be set
MPS              compute mode ExclusiveProcess, time slice    the claim's MPS daemon serves it
                 Default; the claim's MPS daemon serves it    (the parent GPU is left as it is:
                                                              other MIG devices share it)
===============  ===========================================  ===================================

These are the settings NVIDIA's driver makes (``nvidia-smi -c DEFAULT`` and ``compute-policy
--set-timeslice`` for time-slicing, ``-c EXCLUSIVE_PROCESS`` for MPS). Refused, per claim, before
anything is changed:

* MPS on a GPU older than Volta (compute capability 7.0), whose MPS has no client limits;
* two settings for one GPU within the claim (e.g. two results of one GPU with different configs);
* MPS devices of one claim asking different thread percentages: one daemon serves the claim, and
  a daemon has one default;
* a GPU another prepared claim (a share of the same GPU) set differently: claims sharing a GPU
  must agree on its compute mode and time slice, since there is only one;
* MPS for shares of a GPU (consumable capacity) beside other MPS devices in one claim: the shares
  of a GPU are clients of one daemon per GPU (a GPU in ExclusiveProcess mode runs one MPS
  server), each claim's containers with their share's limits, and a claim has one daemon.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

from dra_driver.devices.types import ComputeMode, ComputePolicy, TimeSlice
from dra_driver.node.api_base import quantity_bytes
from dra_driver.node.claims import ClaimRejected
from dra_driver.node.config import GpuSharing
from dra_driver.node.plan import ClaimPlan, PlannedDevice
from dra_driver.node.records import GpuPolicyRecord, SharingState
from dra_driver.node.sharing.mps import MpsDaemonSpec, MpsDevice, daemon_id
from dra_driver.resources.device_names import gpu_device_name

MPS_MINIMUM_CAPABILITY = (7, 0)  # Volta: MPS with per-client thread and memory limits


@dataclass(frozen=True)
class GpuChange:
    """One full GPU's settings as a claim wants them."""

    gpu_uuid: str
    device: str  # the claim's device name for it, for messages
    policy: ComputePolicy


@dataclass(frozen=True)
class SharingPlan:
    """What a claim's sharing changes: GPU settings, and whether it gets an MPS daemon."""

    gpus: tuple[GpuChange, ...]
    mps_devices: tuple[PlannedDevice, ...]  # the devices its MPS daemon serves; empty: no daemon
    active_thread_percentage: int | None

    @property
    def changes_anything(self) -> bool:
        return bool(self.gpus or self.mps_devices)


NO_SHARING = SharingPlan((), (), None)


def sharing_plan(plan: ClaimPlan) -> SharingPlan:
    """What ``plan``'s sharing settings change; :class:`ClaimRejected` for what cannot be done."""
    gpus: dict[str, GpuChange] = {}
    mps: list[PlannedDevice] = []
    percentages: dict[int | None, str] = {}
    for device in plan.devices:
        if device.result.admin_access:
            continue
        sharing = device.config.sharing
        target = device.target
        name = device.result.device
        if sharing.strategy == "Exclusive":
            continue
        if sharing.strategy == "MPS":
            if target.gpu.cuda_compute_capability < MPS_MINIMUM_CAPABILITY:
                major, minor = target.gpu.cuda_compute_capability
                raise ClaimRejected(
                    f"device {name} ({target.gpu.product_name}, compute capability {major}.{minor}) cannot "
                    "run MPS with client limits, which needs Volta or newer (7.0); use TimeSlicing"
                )
            if all(d.result.device != name for d in mps):  # results sharing one device share it
                mps.append(device)
            mps_settings = sharing.mps
            percentages.setdefault(
                mps_settings.default_active_thread_percentage if mps_settings else None, name
            )
        if target.is_mig:
            continue  # nothing to set on a MIG device (see the module doc)
        policy = _gpu_policy(sharing)
        change = GpuChange(target.gpu.uuid, name, policy)
        earlier = gpus.setdefault(target.gpu.uuid, change)
        if earlier.policy != policy:
            raise ClaimRejected(
                f"device {name}: GPU {gpu_device_name(target.gpu.minor)} gets two sharing settings in this "
                f"claim ({_describe(earlier.policy)} and {_describe(policy)}); give its results one config"
            )
    if len(percentages) > 1:
        described = ", ".join(f"{p if p is not None else 'none'} ({d})" for p, d in percentages.items())
        raise ClaimRejected(
            "the claim's MPS devices ask for different sharing.mps.defaultActiveThreadPercentage values "
            f"({described}); one MPS control daemon serves the claim, with one default: use one value"
        )
    shared_gpus = {d.target.gpu.uuid for d in mps if d.share is not None}
    if shared_gpus and (len(shared_gpus) > 1 or any(d.share is None for d in mps)):
        raise ClaimRejected(
            f"the claim's MPS devices ({', '.join(d.result.device for d in mps)}) include shares of a GPU "
            "beside other devices; shares of a GPU are served by that GPU's own MPS daemon and a claim has "
            "one: put the shares in a claim of their own"
        )
    percentage = next(iter(percentages)) if percentages else None
    return SharingPlan(tuple(gpus.values()), tuple(mps), percentage)


def _gpu_policy(sharing: object) -> ComputePolicy:
    if isinstance(sharing, GpuSharing) and sharing.strategy == "TimeSlicing":
        interval = sharing.time_slicing.interval if sharing.time_slicing else "Default"
        return ComputePolicy(ComputeMode.DEFAULT, TimeSlice(interval))
    return ComputePolicy(ComputeMode.EXCLUSIVE_PROCESS, TimeSlice.DEFAULT)


def _describe(policy: ComputePolicy) -> str:
    if policy.compute_mode is ComputeMode.EXCLUSIVE_PROCESS:
        return "MPS (compute mode ExclusiveProcess)"
    return f"TimeSlicing with interval {policy.time_slice.value}"


def held_by_others(uid: str, sharing: SharingState) -> dict[str, tuple[str, GpuPolicyRecord]]:
    """GPU uuid -> (claim, its record) for every GPU another claim's sharing has set."""
    return {
        gpu: next(held for other, held in claims.items() if other != uid)
        for gpu, claims in sharing.gpus.items()
        if set(claims) - {uid}
    }


def check_agrees(uid: str, changes: tuple[GpuChange, ...], sharing: SharingState) -> None:
    """Refuse a GPU that another prepared claim set differently (see the module doc)."""
    held = held_by_others(uid, sharing)
    for change in changes:
        if change.gpu_uuid not in held:
            continue
        other, record = held[change.gpu_uuid]
        theirs = ComputePolicy.from_dict({"computeMode": record.compute_mode, "timeSlice": record.time_slice})
        if theirs != change.policy:
            raise ClaimRejected(
                f"device {change.device}: its GPU is already set to {_describe(theirs)} for claim {other}, "
                f"and this claim asks for {_describe(change.policy)}; claims sharing one GPU must agree "
                "on its settings (there is one compute mode and one time slice per GPU)"
            )


def gpu_records(
    changes: tuple[GpuChange, ...], previous: Mapping[str, ComputePolicy]
) -> tuple[GpuPolicyRecord, ...]:
    return tuple(
        GpuPolicyRecord(
            gpu_uuid=change.gpu_uuid,
            compute_mode=change.policy.compute_mode.value,
            time_slice=change.policy.time_slice.value,
            previous_compute_mode=previous[change.gpu_uuid].compute_mode.value,
            previous_time_slice=previous[change.gpu_uuid].time_slice.value,
        )
        for change in changes
    )


def previous_policy(record: GpuPolicyRecord) -> ComputePolicy:
    return ComputePolicy(ComputeMode(record.previous_compute_mode), TimeSlice(record.previous_time_slice))


def applied_policy(record: GpuPolicyRecord) -> ComputePolicy:
    return ComputePolicy(ComputeMode(record.compute_mode), TimeSlice(record.time_slice))


def mps_daemon_id(plan: ClaimPlan, sharing: SharingPlan) -> str | None:
    """The id of the claim's MPS daemon (one per claim, as NVIDIA's driver names it); None: none.

    Stable before MIG devices exist: it hashes device names, which a created MIG device's uuid
    would change between attempts.
    """
    if not sharing.mps_devices:
        return None
    if is_shared(sharing):
        return shared_daemon_id(sharing.mps_devices[0].target.gpu.uuid)
    return daemon_id(plan.claim.ref.uid, [d.result.device for d in sharing.mps_devices])


def is_shared(sharing: SharingPlan) -> bool:
    """Whether the claim's MPS devices are shares of one GPU, served by that GPU's daemon."""
    return any(d.share is not None for d in sharing.mps_devices)


def shared_daemon_id(gpu_uuid: str) -> str:
    """``shared-<12 hex>``: the daemon every share of the GPU ``gpu_uuid`` is a client of."""
    return f"shared-{hashlib.sha256(gpu_uuid.encode()).hexdigest()[:12]}"


def daemon_spec(spec: MpsDaemonSpec, sharing: SharingPlan) -> MpsDaemonSpec:
    """What the daemon is started with: a GPU's shared daemon has no limits of one share.

    The first share starts it and every share of the GPU uses it; each share's limits reach its
    own containers as MPS client settings (``container_env`` of the claim's ``spec``).
    """
    if not is_shared(sharing):
        return spec
    devices = tuple(MpsDevice(device.uuid) for device in spec.devices)
    return dataclasses.replace(spec, devices=devices, active_thread_percentage=None)


def mps_spec(plan: ClaimPlan, sharing: SharingPlan, daemon: str) -> MpsDaemonSpec:
    """The claim's MPS daemon, once every device it serves exists (MIG devices created)."""
    by_name = {d.result.device: d for d in plan.devices}
    devices = []
    for planned in sharing.mps_devices:
        current = by_name[planned.result.device]  # with the created MIG device's uuid
        settings = current.config.sharing.mps
        limit = settings.default_pinned_device_memory_limit if settings else None
        devices.append(MpsDevice(current.target.uuid, quantity_bytes(limit) if limit else None))
    ref = plan.claim.ref
    return MpsDaemonSpec(
        id=daemon,
        claim_uid=ref.uid,
        claim=f"{ref.namespace}/{ref.name}",
        devices=tuple(devices),
        active_thread_percentage=sharing.active_thread_percentage,
    )
