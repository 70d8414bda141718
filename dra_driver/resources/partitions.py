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

from dra_driver.devices.types import MigProfile, Placement

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


@dataclass(frozen=True)
class PartitionBudget:
    """What is left to partition on a GPU around the instances that are fixed on it."""

    # Engine counter -> the largest total any legal layout of the offered placements reaches.
    capacities: Mapping[str, int]
    # (profile, placement) pairs that can still be created next to the fixed instances.
    offered: tuple[tuple[MigProfile, Placement], ...]


def partition_budget(
    profiles: Iterable[MigProfile],
    memory_slices: int,
    fixed: Iterable[tuple[str, Placement]] = (),
) -> PartitionBudget:
    """The offerable placements and engine capacities of a GPU with ``profiles``.

    ``fixed`` are instances that exist and stay, whatever the scheduler does (MIG devices an
    administrator created), as (profile name, placement): they occupy their memory slices and
    count against their profile's instance limit, but consume nothing from the counters,
    because they are not published as counter consumers.
    """
    return _budget(tuple(profiles), memory_slices, frozenset(fixed))


@lru_cache(maxsize=64)
def _budget(
    profiles: tuple[MigProfile, ...], memory_slices: int, fixed: frozenset[tuple[str, Placement]]
) -> PartitionBudget:
    fixed_slices = {index for _, placement in fixed for index in placement.memory_slices}
    fixed_counts = Tally(name for name, _ in fixed)

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
        if can_add(profile, placement, none_yet)
    )
    starting_at: dict[int, list[tuple[MigProfile, Placement]]] = {}
    for profile, placement in offered:
        starting_at.setdefault(placement.start, []).append((profile, placement))

    best = dict.fromkeys(ENGINE_COUNTERS, 0)
    totals = dict.fromkeys(ENGINE_COUNTERS, 0)
    instances: Tally[str] = Tally()

    # Walk the memory slices left to right; at each one either leave it unused or start one
    # of the placements that begin there, then continue after it. This visits every legal
    # layout exactly once.
    def visit(slot: int) -> None:
        if slot >= memory_slices:
            for name in ENGINE_COUNTERS:
                best[name] = max(best[name], totals[name])
            return
        visit(slot + 1)
        for profile, placement in starting_at.get(slot, ()):
            if not can_add(profile, placement, instances):
                continue
            share = profile_share(profile)
            instances[profile.name] += 1
            for name in ENGINE_COUNTERS:
                totals[name] += share[name]
            visit(slot + placement.size)
            instances[profile.name] -= 1
            for name in ENGINE_COUNTERS:
                totals[name] -= share[name]

    visit(0)
    return PartitionBudget(capacities=MappingProxyType(best), offered=offered)
