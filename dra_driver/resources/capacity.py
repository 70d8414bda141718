"""Consumable capacity (KEP-5075): one full GPU shared by several claims, each taking some memory.

With ``--consumable-capacity`` a full GPU is published with ``allowMultipleAllocations: true``
and a request policy on two of its capacities, so that the scheduler packs claims onto it::

    capacity:
      memory:          {value: <bytes>, requestPolicy: {default: <max>,
                        validRange: {min: 1Gi, max: <max>, step: 1Gi}}}
      multiprocessors: {value: <SMs>,   requestPolicy: {default: 0,
                        validRange: {min: 0, max: <SMs>, step: 1}}}

where ``<max>`` is the GPU's memory rounded down to whole GiB. A claim asking
``capacity.requests.memory: 10Gi`` consumes 10Gi (a request between steps is rounded up);
the scheduler allocates the GPU to further claims as long as their memory adds up to at
most the GPU's, and records ``consumedCapacity`` and a ``shareID`` in each allocation.

The defaults are chosen so that nothing changes for claims that do not ask for capacity:

* memory defaults to ``<max>``: a claim without a memory request takes the whole GPU, and
  what is left (less than the 1Gi minimum) fits no share. Exclusive claims and shares of
  one GPU therefore never mix, by the scheduler's own arithmetic;
* multiprocessors defaults to 0, meaning "no compute limit": a share that asks only for
  memory must not take every SM, or no second share would fit. A share that asks for SMs
  reserves them against the other shares and gets an MPS active thread percentage
  (:mod:`dra_driver.node.shares`);
* every other capacity (the copy engines, decoders, ... of a MIG-capable GPU) defaults to 0
  too, with a range up to its value: a capacity without a policy is consumed whole by every
  allocation, so one share would take them all and no second share would fit.

A request the policy cannot satisfy (more memory than ``<max>``, more SMs than the GPU
has) makes the GPU ineligible for that claim: the scheduler reports the claim as not
allocatable. The node re-checks what the scheduler recorded against the same policy
(:func:`policy_problems`), for allocations made from a slice that no longer holds.

A GPU that offers MIG partitions keeps consuming every counter of its counter set: the
scheduler charges a multi-allocatable device's counters once, with its first share, so
shares and MIG devices of one GPU exclude each other as the whole GPU and MIG devices do.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from dra_driver.devices.types import Gpu
from dra_driver.resources.wire import DeviceCapacity

GIB = 2**30
MEMORY = "memory"
MULTIPROCESSORS = "multiprocessors"


@dataclass(frozen=True)
class SharePolicy:
    """How one GPU's memory and SMs may be consumed by shares."""

    memory_bytes: int  # the GPU's memory, the capacity's value
    memory_max: int  # the most one allocation may take: memory rounded down to whole steps
    multiprocessors: int
    memory_min: int = GIB
    memory_step: int = GIB

    @property
    def memory_default(self) -> int:
        """What an allocation that asks for no memory consumes: all of it (an exclusive claim)."""
        return self.memory_max

    def is_whole(self, consumed_memory: int) -> bool:
        """Whether an allocation consuming ``consumed_memory`` leaves no room for another share."""
        return consumed_memory + self.memory_min > self.memory_bytes


def share_policy(gpu: Gpu) -> SharePolicy | None:
    """The policy of ``gpu``; None for a GPU too small to hold two shares of the minimum."""
    memory_max = gpu.memory_bytes // GIB * GIB
    if memory_max < 2 * GIB or gpu.multiprocessors < 1:
        return None
    return SharePolicy(
        memory_bytes=gpu.memory_bytes, memory_max=memory_max, multiprocessors=gpu.multiprocessors
    )


def consumable_capacity(
    policy: SharePolicy, capacity: Mapping[str, DeviceCapacity]
) -> dict[str, DeviceCapacity]:
    """The GPU's ``capacity``, each with its request policy (see the module doc)."""
    others: dict[str, DeviceCapacity] = {
        name: {
            "value": value["value"],
            # No step: min + step may not exceed the value, and an engine count may be 0.
            "requestPolicy": {"default": "0", "validRange": {"min": "0", "max": value["value"]}},
        }
        for name, value in capacity.items()
        if name not in (MEMORY, MULTIPROCESSORS)
    }
    return others | {
        MEMORY: {
            "value": str(policy.memory_bytes),
            "requestPolicy": {  # in GiB, as users write their requests (all are whole GiB)
                "default": _gib(policy.memory_default),
                "validRange": {
                    "min": _gib(policy.memory_min),
                    "max": _gib(policy.memory_max),
                    "step": _gib(policy.memory_step),
                },
            },
        },
        MULTIPROCESSORS: {
            "value": str(policy.multiprocessors),
            "requestPolicy": {
                "default": "0",
                "validRange": {"min": "0", "max": str(policy.multiprocessors), "step": "1"},
            },
        },
    }


def policy_problems(policy: SharePolicy, consumed: Mapping[str, int]) -> list[str]:
    """What is wrong with an allocation's ``consumedCapacity`` under ``policy``; empty when it fits.

    The scheduler only records amounts the policy allows, so a problem means the allocation
    was made from another policy: an older slice, another GPU, or a changed setting.
    """
    problems = []
    memory = consumed.get(MEMORY)
    if memory is None:
        problems.append(f"it records no {MEMORY}")
    elif not policy.memory_min <= memory <= policy.memory_max:
        problems.append(
            f"{MEMORY} {_gib(memory)} is outside the policy's range {_gib(policy.memory_min)}-"
            f"{_gib(policy.memory_max)}"
        )
    elif (memory - policy.memory_min) % policy.memory_step:
        problems.append(f"{MEMORY} {_gib(memory)} is not a whole number of {_gib(policy.memory_step)} steps")
    sms = consumed.get(MULTIPROCESSORS, 0)
    if not 0 <= sms <= policy.multiprocessors:
        problems.append(f"{MULTIPROCESSORS} {sms} is outside the policy's range 0-{policy.multiprocessors}")
    return problems


def _gib(value: int) -> str:
    return f"{value // GIB}Gi" if value % GIB == 0 else f"{value} bytes"
