"""The published counters allow exactly the MIG layouts the hardware allows.

Checked on what is published (the counter set and the devices' consumesCounters, as the
scheduler sees them) against an independent statement of the hardware rule: placements must
not share memory slices, and a profile has at most ``instance_count`` instances.
"""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dra_driver.devices.types import Gpu, MigDevice, MigProfile, Placement
from dra_driver.resources.device_names import mig_device_name
from dra_driver.resources.devices import build_devices
from dra_driver.resources.partitions import gpu_totals, partition_budget
from dra_driver.resources.wire import CounterSet, Device

from .factories import a100_40gb, h100, inventory, mig_device, mock_h100, with_mig_devices

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
    first, sixth = h100(0), h100(5)
    assert partition_budget(first.mig_profiles, 8, gpu_totals(first)) is partition_budget(
        sixth.mig_profiles, 8, gpu_totals(sixth)
    )


# --- the counters never add up to more than the GPU, whatever NVML's table says ---------------


def what_the_gpu_has(gpu: Gpu) -> dict[str, int]:
    """The GPU as a user reads it: NVML's memory and SMs; an engine count, its largest profile's."""
    engines = {
        "copyEngines": "copy_engines",
        "decoders": "decoders",
        "encoders": "encoders",
        "jpegEngines": "jpeg_engines",
        "ofaEngines": "ofa_engines",
    }
    largest = {name: max(getattr(p, field) for p in gpu.mig_profiles) for name, field in engines.items()}
    sms = gpu.multiprocessors or max(p.multiprocessors for p in gpu.mig_profiles)
    return largest | {"memory": gpu.memory_bytes, "multiprocessors": sms}


def capacity_of(device: Device) -> dict[str, int]:
    return {name: int(value["value"]) for name, value in device["capacity"].items()}


def fitting_sets(counter_set: CounterSet, devices: Sequence[Device]) -> Iterator[list[Device]]:
    """Every set of ``devices`` the scheduler could allocate together, by their counters."""
    left = {name: int(counter["value"]) for name, counter in counter_set["counters"].items()}

    def walk(start: int, chosen: list[Device]) -> Iterator[list[Device]]:
        yield chosen
        for i in range(start, len(devices)):
            [consumption] = devices[i]["consumesCounters"]
            taken = {name: int(counter["value"]) for name, counter in consumption["counters"].items()}
            if all(left[name] >= amount for name, amount in taken.items()):
                for name, amount in taken.items():
                    left[name] -= amount
                yield from walk(i + 1, [*chosen, devices[i]])
                for name, amount in taken.items():
                    left[name] += amount

    return walk(0, [])


@st.composite
def nvml_tables(draw: st.DrawFn) -> Gpu:
    """An H100 whose NVML reports any memory, SM count and MIG profile table at all."""
    slices = draw(st.integers(1, 6))
    profiles = []
    for number in range(draw(st.integers(1, 3))):
        size = draw(st.integers(1, slices))
        starts = draw(st.lists(st.integers(0, slices - size), min_size=1, max_size=slices, unique=True))
        profiles.append(
            MigProfile(
                name=f"{number + 1}g.{number}gb",
                profile_id=number,
                nvml_profile=number,
                compute_slices=size,
                instance_count=draw(st.integers(1, 4)),
                memory_mib=draw(st.integers(1, 100_000)),
                multiprocessors=draw(st.integers(0, 200)),
                copy_engines=draw(st.integers(0, 8)),
                decoders=draw(st.integers(0, 8)),
                encoders=draw(st.integers(0, 8)),
                jpeg_engines=draw(st.integers(0, 8)),
                ofa_engines=draw(st.integers(0, 2)),
                placements=tuple(Placement(start, size) for start in sorted(starts)),
            )
        )
    gpu = replace(
        h100(0, mig_enabled=draw(st.booleans())),
        memory_bytes=draw(st.integers(1, 100_000)) * 2**20,
        multiprocessors=draw(st.integers(0, 200)),  # 0: NVML gave no count, nor the catalog
        memory_slices=slices,
        mig_profiles=tuple(profiles),
    )
    if gpu.mig_enabled and draw(st.booleans()):  # an administrator's MIG device stays on it
        profile = draw(st.sampled_from(profiles))
        placement = draw(st.sampled_from(profile.placements))
        static = MigDevice(
            uuid="MIG-00000000-aaaa-bbbb-cccc-ddddeeeeffff",
            parent_uuid=gpu.uuid,
            profile=profile.name,
            profile_id=profile.profile_id,
            placement=placement,
            gpu_instance_id=1,
            compute_instance_id=0,
        )
        gpu = with_mig_devices(gpu, static)
    return gpu


@settings(max_examples=150, deadline=None)
@given(nvml_tables())
def test_no_set_of_devices_that_fits_the_counters_exceeds_the_gpu(gpu: Gpu) -> None:
    [result] = build_devices(inventory(gpu))
    has = what_the_gpu_has(gpu)
    devices = {device["name"]: device for device in result.devices}
    if "gpu-0" in devices:
        assert capacity_of(devices["gpu-0"]) == has  # the full GPU claims what the GPU has
    static = [
        device for device in result.devices if "uuid" in device["attributes"] and "mig" in device["name"]
    ]
    always_there = Tally[str]()
    for device in static:
        always_there.update(capacity_of(device))
    if result.counter_set is None:
        return
    consumers = [device for device in result.devices if "consumesCounters" in device]
    for chosen in fitting_sets(result.counter_set, consumers):
        used = Tally[str](always_there)
        for device in chosen:
            used.update({name: amount for name, amount in capacity_of(device).items() if name in has})
        assert all(used[name] <= has[name] for name in has), ([d["name"] for d in chosen], dict(used), has)
    for device in consumers:  # each offered device can be allocated on its own
        assert fits(result.counter_set, [device]), device["name"]


def test_on_nvidias_mock_h100_the_counters_hold_what_the_gpu_has() -> None:
    gpu = mock_h100(0)
    counter_set, devices = published(gpu)
    counters = {name: int(counter["value"]) for name, counter in counter_set["counters"].items()}
    # Not 120Gi (3g.40gb beside four 1g.20gb by NVML's table) nor 7 decoders (seven 1g.10gb).
    assert (counters["memory"], counters["decoders"], counters["multiprocessors"]) == (80 * 2**30, 5, 132)
    assert devices["gpu-0"]["consumesCounters"][0]["counters"]["memory"] == {"value": str(80 * 2**30)}
    three_g = devices["gpu-0-mig-3g40gb-2-4"]
    twenty = [devices[f"gpu-0-mig-1g20gb-9-{start}"] for start in range(4)]
    assert fits(counter_set, [three_g, *twenty[:2]])  # 80Gi: what the GPU has
    assert not fits(counter_set, [three_g, *twenty[:3]])  # 100Gi: NVML would create it, the GPU has not
    five = [devices[f"gpu-0-mig-1g10gb-0-{start}"] for start in range(6)]
    assert fits(counter_set, five[:5])
    assert not fits(counter_set, five)  # a sixth decoder the whole GPU (7g.80gb) does not have


def test_a_profile_larger_than_the_gpu_is_not_offered() -> None:
    gpu = mock_h100(0)
    bigger = replace(gpu.mig_profiles[-1], memory_mib=90_000)  # 7g.80gb with more than the GPU's 80Gi
    counter_set, devices = published(replace(gpu, mig_profiles=(*gpu.mig_profiles[:-1], bigger)))
    assert "gpu-0-mig-7g80gb-4-0" not in devices
    assert int(counter_set["counters"]["memory"]["value"]) == 80 * 2**30
