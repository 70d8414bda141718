"""MIG geometry as counters: what a placement consumes and what a GPU has to give.

With partitionable devices (KEP-4815) the scheduler sees every MIG placement as a device
that draws from its GPU's counter set. Two kinds of counter do two different jobs:

* one counter per memory slice, capacity 1: a placement consumes exactly its slices, so the
  scheduler can never hand out two overlapping placements, nor the full GPU (which consumes
  every slice) together with any of them;
* engine counters (SMs, copy engines, decoders, encoders, JPEG, OFA, memory bytes): a
  placement consumes its profile's share. A capacity is the largest total that any layout
  the hardware allows reaches, so these counters never forbid a legal layout; they do forbid
  what no layout reaches, e.g. a second ``+me`` instance on a GPU that has a single OFA.

NVML's profile table is not trusted to add up. NVIDIA's own go-nvml mock of an H100 lists
``1g.20gb`` at every memory slice, so ``3g.40gb`` beside four of them would be 120Gi on an 80 GB
GPU. A capacity is therefore also capped at what the whole GPU has (:func:`gpu_totals`), less
what the instances fixed on it take, and a placement whose share alone exceeds that is not
offered. No device, and no set of devices that fits the counters, then claims more than the
GPU has, whatever NVML reports; on real hardware the cap changes nothing, because there the
layouts add up.

Legal layouts are sets of non-overlapping placements within each profile's instance count
(exactly what ``nvmlDeviceCreateGpuInstanceWithPlacement`` checks). The search over them is
exhaustive, which is cheap: placements start at multiples of their size within 8 slices, so a
GPU has a few thousand layouts, and the result is memoized per profile table.
"""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from types import MappingProxyType

from dra_driver.devices.types import Gpu, MigProfile, Placement

# Counter names (DNS labels, as NVIDIA names them) in the order they are published.
ENGINE_COUNTERS: tuple[str, ...] = (
    "multiprocessors",
    "copy-engines",
    "decoders",
    "encoders",
    "jpeg-engines",
    "ofa-engines",
    "memory",
)


def profile_share(profile: MigProfile) -> dict[str, int]:
    """What one instance of ``profile`` takes from its GPU, per engine counter."""
    return {
        "multiprocessors": profile.multiprocessors,
        "copy-engines": profile.copy_engines,
        "decoders": profile.decoders,
        "encoders": profile.encoders,
        "jpeg-engines": profile.jpeg_engines,
        "ofa-engines": profile.ofa_engines,
        "memory": profile.memory_bytes,
    }


def gpu_totals(gpu: Gpu) -> dict[str, int]:
    """What the whole GPU has of each engine counter: the most any set of its partitions may take.

    Memory is NVML's total memory of the GPU and the SMs are its own count (what CUDA sees in a
    container given the whole GPU; the largest profile's where the count is unknown). NVML
    reports no engine counts for a GPU, only for its profiles, so each engine count is the
    largest of its profiles': the profile that spans the GPU has all of its engines. The full
    GPU device publishes these numbers as its capacities and consumes them all.
    """
    profiles = gpu.mig_profiles
    largest = {name: max((profile_share(p)[name] for p in profiles), default=0) for name in ENGINE_COUNTERS}
    return largest | {
        "memory": gpu.memory_bytes,
        "multiprocessors": gpu.multiprocessors or largest["multiprocessors"],
    }


@dataclass(frozen=True)
class PartitionBudget:
    """What is left to partition on a GPU around the instances that are fixed on it."""

    # Engine counter -> the largest total any legal layout of the offered placements reaches,
    # at most what the GPU has beside the fixed instances.
    capacities: Mapping[str, int]
    # (profile, placement) pairs that can still be created next to the fixed instances.
    offered: tuple[tuple[MigProfile, Placement], ...]


def partition_budget(
    profiles: Iterable[MigProfile],
    memory_slices: int,
    totals: Mapping[str, int],
    fixed: Iterable[tuple[str, Placement]] = (),
) -> PartitionBudget:
    """The offerable placements and engine capacities of a GPU with ``profiles``.

    ``totals`` is what the whole GPU has per engine counter (:func:`gpu_totals`). ``fixed`` are
    instances that exist and stay, whatever the scheduler does (MIG devices an administrator
    created), as (profile name, placement): they occupy their memory slices, count against
    their profile's instance limit and take their share of ``totals``, but consume nothing
    from the counters, because they are not published as counter consumers.
    """
    return _budget(tuple(profiles), memory_slices, tuple(sorted(totals.items())), frozenset(fixed))


@lru_cache(maxsize=64)
def _budget(
    profiles: tuple[MigProfile, ...],
    memory_slices: int,
    totals: tuple[tuple[str, int], ...],
    fixed: frozenset[tuple[str, Placement]],
) -> PartitionBudget:
    fixed_slices = {index for _, placement in fixed for index in placement.memory_slices}
    fixed_counts = Tally(name for name, _ in fixed)
    # What the GPU has left beside the fixed instances (an instance of a profile the table does
    # not list takes nothing known).
    left = dict(totals)
    by_name = {profile.name: profile for profile in profiles}
    for name, _ in fixed:
        if name in by_name:
            share = profile_share(by_name[name])
            left = {counter: max(0, left[counter] - share[counter]) for counter in ENGINE_COUNTERS}

    def within_the_gpu(profile: MigProfile) -> bool:
        share = profile_share(profile)
        return all(share[counter] <= left[counter] for counter in ENGINE_COUNTERS)

    def can_add(profile: MigProfile, placement: Placement, instances: Tally[str]) -> bool:
        return (
            placement.start + placement.size <= memory_slices
            and fixed_slices.isdisjoint(placement.memory_slices)
            and fixed_counts[profile.name] + instances[profile.name] < profile.instance_count
        )

    none_yet: Tally[str] = Tally()
    offered = tuple(
        (profile, placement)
        for profile in profiles
        for placement in profile.placements
        if can_add(profile, placement, none_yet) and within_the_gpu(profile)
    )
    starting_at: dict[int, list[tuple[MigProfile, Placement]]] = {}
    for profile, placement in offered:
        starting_at.setdefault(placement.start, []).append((profile, placement))

    best = dict.fromkeys(ENGINE_COUNTERS, 0)
    in_layout = dict.fromkeys(ENGINE_COUNTERS, 0)
    instances: Tally[str] = Tally()

    # Walk the memory slices left to right; at each one either leave it unused or start one
    # of the placements that begin there, then continue after it. This visits every legal
    # layout exactly once.
    def visit(slot: int) -> None:
        if slot >= memory_slices:
            for name in ENGINE_COUNTERS:
                best[name] = max(best[name], in_layout[name])
            return
        visit(slot + 1)
        for profile, placement in starting_at.get(slot, ()):
            if not can_add(profile, placement, instances):
                continue
            share = profile_share(profile)
            instances[profile.name] += 1
            for name in ENGINE_COUNTERS:
                in_layout[name] += share[name]
            visit(slot + placement.size)
            instances[profile.name] -= 1
            for name in ENGINE_COUNTERS:
                in_layout[name] -= share[name]

    visit(0)
    capacities = {name: min(best[name], left[name]) for name in ENGINE_COUNTERS}
    return PartitionBudget(capacities=MappingProxyType(capacities), offered=offered)
