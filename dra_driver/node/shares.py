"""A share of a GPU (consumable capacity): what the scheduler gave one allocation, and its limits.

The scheduler allocates a GPU published with ``allowMultipleAllocations`` (see
:mod:`dra_driver.resources.capacity`) to several claims and writes, per allocation, a
``shareID`` and the ``consumedCapacity``: the memory (and SMs) that share may use. The
kubelet's NodePrepareResources carries only the claim's identity; the driver reads both
from the claim's ``status.allocation.devices.results[]`` and reports the share id back in
the response's ``Device.share_id`` (the kubelet's v1 API; v1beta1 has no such field).

A share is enforced with MPS. Its effective config becomes strategy ``MPS`` with

* ``defaultPinnedDeviceMemoryLimit`` = the consumed memory, and
* ``defaultActiveThreadPercentage`` = the consumed SMs as a percentage of the GPU's,
  rounded up (none when the share asked for no SMs: it shares all of them),

so that whatever prepares MPS for a claim prepares the share's limits too
(:mod:`dra_driver.node.sharing`: the shares of one GPU are clients of one MPS control
daemon per GPU, each container with its share's limits). Several shares of one GPU in one
claim are pooled: the claim's limits on that GPU are their sum, because every container of
the claim gets the same MPS client settings.

The strategy of a share is the administrator's, never the tenant's: the shares of a GPU
must agree on its one compute mode and time slice, so a tenant who could pick them would
lock every other share of the GPU out. It is what the DeviceClass configs say: ``MPS`` with
the share's limits, unless a class config says ``TimeSlicing`` (then every share of the
class's GPUs is time-sliced with the class's interval, and nothing limits their memory:
shares that trust each other). A claim's own config may ask for MPS with tighter limits,
never for looser ones; a claim config with another strategy than the class's (or another
interval) is refused. A claim config with strategy ``Exclusive`` (or none) says nothing
about a share and takes the class's.

A share that leaves no room for another (a claim that asked for no memory takes the
policy's default, all of it) is the GPU itself: it is prepared as a full GPU, with the
claim's own config.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from dra_driver.devices.types import Gpu
from dra_driver.node.api_base import quantity_bytes
from dra_driver.node.claims import AllocationResult, ClaimRejected
from dra_driver.node.config import GpuConfig, GpuSharing, Mps
from dra_driver.resources.capacity import MEMORY, MULTIPROCESSORS, policy_problems, share_policy
from dra_driver.resources.device_names import gpu_device_name


@dataclass(frozen=True)
class Share:
    """What one allocation of a shareable GPU may use."""

    share_id: str
    memory_bytes: int
    multiprocessors: int  # 0: no compute limit
    whole: bool  # nothing else fits beside it: the GPU itself, not limited

    def thread_percentage(self, gpu: Gpu) -> int | None:
        if self.multiprocessors == 0:
            return None
        return max(1, min(100, math.ceil(self.multiprocessors * 100 / gpu.multiprocessors)))


def share_of(result: AllocationResult, gpu: Gpu, *, consumable: bool) -> Share:
    """The share ``result`` holds of the full GPU ``gpu``; :class:`ClaimRejected` if it cannot be one.

    ``consumable`` says whether this node publishes its GPUs as shareable (the setting).
    """
    assert result.share_id is not None
    device = result.device
    stale = (
        "The claim was allocated from a stale ResourceSlice: delete the pod so the claim is allocated again"
    )
    policy = share_policy(gpu)
    if not consumable or policy is None:
        why = (
            "consumable capacity is off on this node (--consumable-capacity)"
            if not consumable
            else f"{gpu_device_name(gpu.minor)} ({gpu.product_name}) is too small to share"
        )
        raise ClaimRejected(
            f"device {device} was allocated as a share (shareID {result.share_id}), but {why}. {stale}"
        )
    consumed = result.consumed_capacity
    problems = policy_problems(policy, consumed)
    if problems:
        raise ClaimRejected(
            f"device {device}: the share's consumedCapacity does not fit the GPU's request policy: "
            f"{'; '.join(problems)}. {stale}"
        )
    memory = consumed[MEMORY]
    return Share(
        share_id=result.share_id,
        memory_bytes=memory,
        multiprocessors=consumed.get(MULTIPROCESSORS, 0),
        whole=policy.is_whole(memory),
    )


def pooled(shares: Iterable[Share]) -> Share:
    """The limits of several shares of one GPU in one claim: their sum."""
    shares = list(shares)
    return Share(
        share_id=",".join(share.share_id for share in shares),
        memory_bytes=sum(share.memory_bytes for share in shares),
        multiprocessors=sum(share.multiprocessors for share in shares),
        whole=any(share.whole for share in shares),
    )


def share_config(
    device: str,
    gpu: Gpu,
    share: Share,
    config: GpuConfig,
    configured: str | None,
    *,
    admin: GpuSharing,
    from_claim: bool,
) -> GpuConfig:
    """The config a limited share is prepared with (see the module doc).

    ``config`` is what the claim and class configs say for the device, ``configured`` the
    entry it came from (None: no config applies), ``admin`` what the class configs alone say,
    and ``from_claim`` whether ``config`` is the claim's own.
    """
    sharing = config.sharing
    memory = share.memory_bytes
    percentage = share.thread_percentage(gpu)
    what = f"device {device} is a share of {_gib(memory)} (shareID {share.share_id})"
    where = f"{what}, isolated with MPS"
    if admin.strategy == "TimeSlicing":
        if from_claim and sharing.strategy != "Exclusive" and _sharing(sharing) != _sharing(admin):
            raise ClaimRejected(
                f"{what}, time-sliced as its DeviceClass says ({_sharing(admin)}); {configured} asks for "
                f"{_sharing(sharing)}, but the sharing of a share is its class's, the same for every share "
                "of the GPU: remove sharing from the claim's config"
            )
        return config.model_copy(update={"sharing": admin})  # time-sliced, its memory not limited
    if from_claim and sharing.strategy == "TimeSlicing":
        raise ClaimRejected(
            f"{where}; {configured} asks for {_sharing(sharing)}, but the sharing of a share is its "
            "DeviceClass's, the same for every share of the GPU: a claim config may only tighten the MPS "
            "limits, or ask for the whole GPU (no capacity request) to choose its own sharing"
        )
    if sharing.strategy != "MPS":
        sharing = admin
    mps = sharing.mps or Mps()
    if mps.default_pinned_device_memory_limit is not None:
        asked = quantity_bytes(mps.default_pinned_device_memory_limit)
        if asked > memory:
            raise ClaimRejected(
                f"{where}; {configured} sets mps.defaultPinnedDeviceMemoryLimit "
                f"{mps.default_pinned_device_memory_limit}, more than the share: ask for more memory in "
                "capacity.requests instead"
            )
    else:
        mps = mps.model_copy(update={"default_pinned_device_memory_limit": f"{memory // 2**20}Mi"})
    if percentage is not None:
        asked_percentage = mps.default_active_thread_percentage
        if asked_percentage is not None and asked_percentage > percentage:
            raise ClaimRejected(
                f"{where} and {share.multiprocessors} SMs ({percentage}%); {configured} sets "
                f"mps.defaultActiveThreadPercentage {asked_percentage}, more than the share: ask for more "
                "multiprocessors in capacity.requests instead"
            )
        if asked_percentage is None:
            mps = mps.model_copy(update={"default_active_thread_percentage": percentage})
    limited = GpuSharing.model_validate({"strategy": "MPS"}).model_copy(update={"mps": mps})
    return config.model_copy(update={"sharing": limited})


def _sharing(sharing: GpuSharing) -> str:
    if sharing.strategy == "TimeSlicing":
        interval = sharing.time_slicing.interval if sharing.time_slicing else "Default"
        return f"TimeSlicing with interval {interval}"
    return sharing.strategy


def _gib(value: int) -> str:
    return f"{value / 2**30:g}Gi"
