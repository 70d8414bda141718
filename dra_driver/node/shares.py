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
daemon per GPU, each container with its share's limits). A claim config may ask for MPS
with tighter limits, never for looser ones. It may also ask for ``TimeSlicing``: the
shares of that GPU then trust each other, nothing limits their memory, and every share
of the GPU must ask for the same interval (one time slice per GPU). Several shares of
one GPU in one claim are pooled: the claim's limits on that GPU are their sum, because
every container of the claim gets the same MPS client settings.

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
from dra_driver.resources.naming import gpu_device_name


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


def share_config(device: str, gpu: Gpu, share: Share, config: GpuConfig, configured: str | None) -> GpuConfig:
    """The config a limited share is prepared with: MPS with the share's limits (see the module doc).

    ``config`` is what the claim and class configs say for the device, ``configured`` the
    entry it came from (None: no config applies).
    """
    sharing = config.sharing
    memory = share.memory_bytes
    percentage = share.thread_percentage(gpu)
    where = f"device {device} is a share of {_gib(memory)} (shareID {share.share_id}), isolated with MPS"
    if sharing.strategy == "TimeSlicing":
        return config  # asked for: time-sliced, its memory not limited (see the module doc)
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


def _gib(value: int) -> str:
    return f"{value / 2**30:g}Gi"
