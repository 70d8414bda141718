"""The published counters allow exactly the MIG layouts the hardware allows.

Checked on what is published (the counter set and the devices' consumesCounters, as the
scheduler sees them) against an independent statement of the hardware rule: placements must
not share memory slices, and a profile has at most ``instance_count`` instances.
"""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Callable, Iterator, Sequence

import pytest

from dra_driver.devices.types import Gpu, MigProfile, Placement
from dra_driver.resources.devices import build_devices
from dra_driver.resources.naming import mig_device_name
from dra_driver.resources.partitions import partition_budget
from dra_driver.resources.wire import CounterSet, Device

from .factories import a100_40gb, h100, inventory, mig_device, with_mig_devices

Instance = tuple[MigProfile, Placement]


def published(gpu: Gpu) -> tuple[CounterSet, dict[str, Device]]:
    [result] = build_devices(inventory(gpu))
    assert result.counter_set is not None
    return result.counter_set, {device["name"]: device for device in result.devices}


def fits(counter_set: CounterSet, devices: Sequence[Device]) -> bool:
    """Whether the scheduler could allocate ``devices`` together, by their counter consumption."""
    used: Tally[str] = Tally()
    for device in devices:
        for consumption in device.get("consumesCounters", []):
            assert consumption["counterSet"] == counter_set["name"]
            for name, counter in consumption["counters"].items():
                used[name] += int(counter["value"])
    return all(used[name] <= int(counter["value"]) for name, counter in counter_set["counters"].items())


def legal(instances: Sequence[Instance], fixed: Sequence[Instance] = ()) -> bool:
    """The hardware rule: disjoint memory slices, instance counts respected."""
    everything = [*fixed, *instances]
    for i, (_, a) in enumerate(everything):
        if any(a.overlaps(b) for _, b in everything[i + 1 :]):
            return False
    counts = Tally(profile.name for profile, _ in everything)
    return all(counts[profile.name] <= profile.instance_count for profile, _ in everything)


def name(gpu: Gpu, instance: Instance) -> str:
    profile, placement = instance
    return mig_device_name(gpu.minor, profile.name, profile.profile_id, placement.start)


def all_instances(gpu: Gpu) -> list[Instance]:
    return [(profile, placement) for profile in gpu.mig_profiles for placement in profile.placements]


def subsets(items: Sequence[object], keep: Callable[[tuple[int, ...]], bool]) -> Iterator[tuple[int, ...]]:
    """Index tuples of every subset for which ``keep(subset)`` holds, pruning on failure.

    Valid because both rules are monotone: a superset of a refused set is refused too.
    """

    def walk(start: int, chosen: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
        yield chosen
        for i in range(start, len(items)):
            candidate = (*chosen, i)
            if keep(candidate):
                yield from walk(i + 1, candidate)

    return walk(0, ())


def layouts_the_counters_allow(counter_set: CounterSet, placements: list[Device]) -> set[frozenset[str]]:
    return {
        frozenset(placements[i]["name"] for i in subset)
        for subset in subsets(placements, lambda s: fits(counter_set, [placements[i] for i in s]))
    }


def layouts_the_hardware_allows(gpu: Gpu, fixed: Sequence[Instance] = ()) -> set[frozenset[str]]:
    candidates = all_instances(gpu)
    return {
        frozenset(name(gpu, candidates[i]) for i in subset)
        for subset in subsets(candidates, lambda s: legal([candidates[i] for i in s], fixed))
    }


@pytest.mark.parametrize("make", [h100, a100_40gb], ids=["h100", "a100-40gb"])
def test_counters_allow_exactly_the_legal_layouts(make: Callable[..., Gpu]) -> None:
    gpu = make(0, mig_enabled=True)
    counter_set, devices = published(gpu)
    placements = [device for device in devices.values() if device["attributes"]["type"] == {"string": "mig"}]
    assert layouts_the_counters_allow(counter_set, placements) == layouts_the_hardware_allows(gpu)


@pytest.mark.parametrize(
    ("make", "static"),
    [(a100_40gb, ("3g.20gb", 0)), (h100, ("1g.10gb+me", 2)), (h100, ("2g.20gb", 2)), (h100, ("1g.20gb", 6))],
)
def test_next_to_static_mig_devices_counters_allow_exactly_the_legal_extensions(
    make: Callable[..., Gpu], static: tuple[str, int]
) -> None:
    gpu = make(0)
    existing = mig_device(gpu, *static)
    gpu = with_mig_devices(gpu, existing)
    counter_set, devices = published(gpu)
    placements = [device for device in devices.values() if "consumesCounters" in device]
    [profile] = [p for p in gpu.mig_profiles if p.name == existing.profile]
    fixed = [(profile, existing.placement)]
    assert layouts_the_counters_allow(counter_set, placements) == layouts_the_hardware_allows(gpu, fixed)


@pytest.mark.parametrize(
    "layout",
    [
        ["gpu-0-mig-1g10gb-19-" + str(start) for start in range(7)],  # 7x 1g.10gb
        ["gpu-0-mig-3g40gb-9-4", "gpu-0-mig-2g20gb-14-0", "gpu-0-mig-1g10gb-19-2", "gpu-0-mig-1g10gb-19-3"],
        ["gpu-0-mig-4g40gb-5-0", "gpu-0-mig-3g40gb-9-4"],
        ["gpu-0-mig-2g20gb-14-0", "gpu-0-mig-2g20gb-14-2", "gpu-0-mig-2g20gb-14-4", "gpu-0-mig-1g20gb-15-6"],
        ["gpu-0-mig-1g10gb-me-20-0", *("gpu-0-mig-1g10gb-19-" + str(start) for start in range(1, 7))],
        ["gpu-0-mig-7g80gb-0-0"],
        ["gpu-0"],
    ],
    ids=["7x1g", "3g+2g+1g+1g", "4g+3g", "2gx3+1g.20gb", "1g+me+6x1g", "7g", "full"],
)
def test_classic_h100_layouts_fit_the_counters(layout: list[str]) -> None:
    counter_set, devices = published(h100(0))
    assert fits(counter_set, [devices[name] for name in layout])


def test_no_two_overlapping_placements_fit_together() -> None:
    gpu = h100(0)
    counter_set, devices = published(gpu)
    instances = all_instances(gpu)
    overlapping = [(a, b) for i, a in enumerate(instances) for b in instances[i + 1 :] if a[1].overlaps(b[1])]
    assert overlapping
    for a, b in overlapping:
        assert not fits(counter_set, [devices[name(gpu, a)], devices[name(gpu, b)]]), (a, b)


def test_the_full_gpu_fits_with_no_placement() -> None:
    counter_set, devices = published(h100(0))
    for device_name, device in devices.items():
        if device_name != "gpu-0":
            assert not fits(counter_set, [devices["gpu-0"], device]), device_name


def test_two_media_extension_instances_do_not_fit_although_their_slices_are_disjoint() -> None:
    counter_set, devices = published(h100(0))
    assert not fits(counter_set, [devices["gpu-0-mig-1g10gb-me-20-0"], devices["gpu-0-mig-1g10gb-me-20-5"]])


def test_the_budget_is_computed_once_per_profile_table() -> None:
    assert partition_budget(h100(0).mig_profiles, 8) is partition_budget(h100(5).mig_profiles, 8)
