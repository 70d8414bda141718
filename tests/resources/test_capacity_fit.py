"""Capacity requests judged against published devices, with the scheduler's own rules (KEP-5075).

The webhook refuses what these call impossible, so every rounding the allocator does must be
allowed here: a request below the minimum, between steps, equal to the default.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import pytest

from dra_driver.resources.capacity_fit import (
    CapacityRule,
    ClassFilter,
    OfferIndex,
    class_filter,
    format_quantity,
    parse_quantity,
)
from dra_driver.resources.devices import build_devices, partition_none

from .factories import a100_40gb, h100, inventory

DRIVER = "gpu.dra-driver.dev"
GIB = 2**30
GPU_CLASS = {
    "metadata": {"name": "gpu.dra-driver.dev"},
    "spec": {
        "selectors": [
            {
                "cel": {
                    "expression": 'device.driver == "gpu.dra-driver.dev" && '
                    'device.attributes["gpu.dra-driver.dev"].type == "gpu"'
                }
            }
        ]
    },
}
MIG_CLASS = {
    "metadata": {"name": "mig.dra-driver.dev"},
    "spec": {
        "selectors": [
            {
                "cel": {
                    "expression": "device.driver == 'gpu.dra-driver.dev' && "
                    "device.attributes['gpu.dra-driver.dev'].type == 'mig'"
                }
            }
        ]
    },
}


def slice_of(name: str, *gpus: Any, consumable: bool = True, driver: str = DRIVER) -> dict[str, Any]:
    built = build_devices(inventory(*gpus), partition=partition_none, consumable=consumable)
    devices = [device for gpu in built for device in gpu.devices]
    return {"metadata": {"name": name}, "spec": {"driver": driver, "devices": devices}}


def index(*slices: dict[str, Any]) -> OfferIndex:
    offers = OfferIndex(DRIVER)
    offers.replace_classes([GPU_CLASS, MIG_CLASS])
    offers.replace_slices(slices)
    return offers


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("79Gi", 79 * GIB),
        ("85520809984", 85520809984),
        ("10.5Gi", Fraction(21, 2) * GIB),
        ("500m", Fraction(1, 2)),
        ("1e3", 1000),
        ("2k", 2000),
        ("0", 0),
    ],
)
def test_quantities_parse_exactly(text: str, value: Fraction) -> None:
    assert parse_quantity(text) == value


def test_quantities_are_written_as_kubernetes_writes_them() -> None:
    assert [format_quantity(Fraction(v)) for v in (79 * GIB, 85520809984, 132, 0)] == [
        "79Gi",
        "81559Mi",
        "132",
        "0",
    ]


MEMORY = CapacityRule.from_api(
    {
        "value": "85520809984",
        "requestPolicy": {"default": "79Gi", "validRange": {"min": "1Gi", "max": "79Gi", "step": "1Gi"}},
    }
)


@pytest.mark.parametrize(
    ("asked", "consumed"),
    [
        ("500Mi", "1Gi"),  # below the minimum: rounded up to it, not refused
        ("1", "1Gi"),
        ("10Gi", "10Gi"),
        ("10.5Gi", "11Gi"),  # between steps: rounded up
        ("78.5Gi", "79Gi"),
        ("79Gi", "79Gi"),
    ],
)
def test_requests_the_policy_rounds_up_are_taken(asked: str, consumed: str) -> None:
    assert MEMORY.consumed(parse_quantity(asked)) == parse_quantity(consumed)
    assert MEMORY.takes(parse_quantity(asked))


@pytest.mark.parametrize("asked", ["79.1Gi", "80Gi", "100Gi"])
def test_requests_above_the_range_are_not(asked: str) -> None:
    assert not MEMORY.takes(parse_quantity(asked))
    assert MEMORY.most() == 79 * GIB


def test_valid_values_round_up_to_the_next_and_refuse_above_the_last() -> None:
    rule = CapacityRule.from_api(
        {"value": "100", "requestPolicy": {"default": "10", "validValues": ["10", "20", "40"]}}
    )
    assert rule.consumed(Fraction(15)) == 20
    assert [rule.takes(Fraction(v)) for v in (1, 15, 40, 41)] == [True, True, True, False]
    assert rule.most() == 40


def test_a_range_without_step_or_max_is_bounded_by_the_value() -> None:
    rule = CapacityRule.from_api(
        {"value": "8", "requestPolicy": {"default": "0", "validRange": {"min": "2"}}}
    )
    assert rule.consumed(Fraction(1)) == 2
    assert [rule.takes(Fraction(v)) for v in (0, 3, 8, 9)] == [True, True, True, False]


def test_a_step_grid_that_ends_below_the_max_caps_what_fits() -> None:
    """min 1, step 3: 1, 4, 7, 10; max 9 makes 7 the most, and 8 rounds up to 10, above the max."""
    rule = CapacityRule.from_api(
        {
            "value": "100",
            "requestPolicy": {"default": "1", "validRange": {"min": "1", "max": "9", "step": "3"}},
        }
    )
    assert rule.most() == 7
    assert [rule.takes(Fraction(v)) for v in (5, 7, 8)] == [True, True, False]


def test_without_a_policy_a_request_is_a_minimum_the_device_must_have() -> None:
    rule = CapacityRule.from_api({"value": "85520809984"})
    assert rule.takes(parse_quantity("79.5Gi"))
    assert not rule.takes(parse_quantity("80Gi"))  # 85899345920 > 85520809984


def test_over_asking_names_the_request_the_amount_and_the_most_a_share_can_have() -> None:
    offers = index(slice_of("node-1", h100(0), h100(1)))
    problem = offers.problem("gpu", "gpu.dra-driver.dev", {"memory": "100Gi"})
    assert problem == (
        'request "gpu" asks for memory 100Gi, more than any share of a gpu.dra-driver.dev GPU can have '
        "(79Gi on NVIDIA H100 80GB HBM3)"
    )
    sms = offers.problem("gpu", "gpu.dra-driver.dev", {"memory": "10Gi", "multiprocessors": "133"})
    assert sms == (
        'request "gpu" asks for multiprocessors 133, more than any share of a gpu.dra-driver.dev GPU can '
        "have (132 on NVIDIA H100 80GB HBM3)"
    )


def test_a_misspelt_capacity_is_named_with_the_capacities_the_gpus_have() -> None:
    offers = index(slice_of("node-1", h100(0)))
    assert offers.problem("gpu", "gpu.dra-driver.dev", {"memroy": "10Gi"}) == (
        'request "gpu" names capacity "memroy", which no gpu.dra-driver.dev GPU has (they have '
        "copyEngines, decoders, encoders, jpegEngines, memory, multiprocessors, ofaEngines)"
    )


@pytest.mark.parametrize(
    "asked",
    [
        {"memory": "10Gi"},
        {"memory": "500Mi"},  # rounded up to 1Gi
        {"memory": "10.5Gi"},  # rounded up to 11Gi
        {"memory": "79Gi"},
        {"memory": "20Gi", "multiprocessors": "33"},
        {"multiprocessors": "0.5"},  # rounded up to 1
        {"gpu.dra-driver.dev/memory": "10Gi"},  # the driver's domain spelt out
    ],
)
def test_what_some_gpu_can_take_is_allowed(asked: dict[str, str]) -> None:
    assert index(slice_of("node-1", h100(0))).problem("gpu", "gpu.dra-driver.dev", asked) is None


def test_the_largest_gpu_of_the_class_decides_and_is_named() -> None:
    offers = index(slice_of("small", a100_40gb(0)), slice_of("large", h100(0)))
    assert offers.problem("gpu", "gpu.dra-driver.dev", {"memory": "60Gi"}) is None  # the H100 takes it
    problem = offers.problem("gpu", "gpu.dra-driver.dev", {"memory": "90Gi"})
    assert problem is not None
    assert problem.endswith("(79Gi on NVIDIA H100 80GB HBM3)")


def test_a_gpu_that_is_not_shared_takes_a_request_as_a_minimum() -> None:
    """consumableCapacity off: 79.5Gi fits an 81559Mi H100 whole; 80Gi fits none."""
    offers = index(slice_of("node-1", h100(0), consumable=False))
    assert offers.problem("gpu", "gpu.dra-driver.dev", {"memory": "79.5Gi"}) is None
    assert offers.problem("gpu", "gpu.dra-driver.dev", {"memory": "80Gi"}) == (
        'request "gpu" asks for memory 80Gi, more than any gpu.dra-driver.dev GPU has '
        "(81559Mi on NVIDIA H100 80GB HBM3)"
    )


def test_a_node_that_shares_and_one_that_does_not_each_take_what_they_can() -> None:
    offers = index(slice_of("shared", h100(0)), slice_of("whole", h100(0), consumable=False))
    assert offers.problem("gpu", "gpu.dra-driver.dev", {"memory": "79.5Gi"}) is None  # the whole one


def test_nothing_is_judged_before_the_slices_are_known_or_once_they_are_gone() -> None:
    offers = index()
    assert offers.problem("gpu", "gpu.dra-driver.dev", {"memory": "1000Gi"}) is None
    offers.put_slice(slice_of("node-1", h100(0)))
    assert offers.problem("gpu", "gpu.dra-driver.dev", {"memory": "1000Gi"}) is not None
    offers.drop_slice({"metadata": {"name": "node-1"}})
    assert offers.problem("gpu", "gpu.dra-driver.dev", {"memory": "1000Gi"}) is None


def test_a_slice_replaced_by_a_larger_gpu_counts_only_as_the_new_one() -> None:
    offers = index(slice_of("node-1", a100_40gb(0)))
    assert offers.problem("gpu", "gpu.dra-driver.dev", {"memory": "60Gi"}) is not None
    offers.put_slice(slice_of("node-1", h100(0)))
    assert offers.problem("gpu", "gpu.dra-driver.dev", {"memory": "60Gi"}) is None
    offers.replace_slices([slice_of("node-2", a100_40gb(0))])  # listed afresh: node-1 is gone
    assert offers.problem("gpu", "gpu.dra-driver.dev", {"memory": "60Gi"}) is not None


def test_classes_and_drivers_not_ours_are_not_judged() -> None:
    offers = index(slice_of("node-1", h100(0)), slice_of("other", h100(0), driver="gpu.other.dev"))
    assert offers.problem("gpu", "someone-elses.example.com", {"memory": "1000Gi"}) is None
    assert offers.problem("gpu", "gpu.dra-driver.dev", {"memory": "79Gi"}) is None
    # A class that might match another driver's devices is not judged either.
    broad = {"metadata": {"name": "broad"}, "spec": {"selectors": [{"cel": {"expression": "true"}}]}}
    either = {
        "metadata": {"name": "either"},
        "spec": {
            "selectors": [
                {"cel": {"expression": 'device.driver == "gpu.dra-driver.dev" || device.driver == "x.dev"'}}
            ]
        },
    }
    offers.put_class(broad)
    offers.put_class(either)
    assert offers.problem("gpu", "broad", {"memory": "1000Gi"}) is None
    assert offers.problem("gpu", "either", {"memory": "1000Gi"}) is None
    # The other driver's slices are not counted in ours.
    assert offers.device_count == 1


def test_a_class_deleted_is_no_longer_judged() -> None:
    offers = index(slice_of("node-1", h100(0)))
    offers.drop_class(GPU_CLASS)
    assert offers.problem("gpu", "gpu.dra-driver.dev", {"memory": "1000Gi"}) is None


def test_a_class_with_no_device_matching_is_not_judged() -> None:
    """The MIG class, on a node publishing no MIG devices: nothing known to judge by."""
    offers = index(slice_of("node-1", h100(0)))
    assert offers.problem("mig", "mig.dra-driver.dev", {"memory": "1000Gi"}) is None


def test_the_charts_selectors_are_understood_and_others_are_not() -> None:
    assert class_filter(GPU_CLASS, DRIVER) is not None
    profile = {
        "spec": {
            "selectors": [
                {
                    "cel": {
                        "expression": 'device.driver == "gpu.dra-driver.dev" &&\n'
                        'device.attributes["gpu.dra-driver.dev"].type == "mig" &&\n'
                        'device.attributes["gpu.dra-driver.dev"].profile == "1g.10gb"'
                    }
                }
            ]
        }
    }
    assert class_filter(profile, DRIVER) == ClassFilter((("type", "mig"), ("profile", "1g.10gb")))
    for expression in [
        'device.attributes["gpu.dra-driver.dev"].type == "gpu"',  # no driver: any driver's devices
        'device.driver == "gpu.other.dev"',
        'device.driver == "gpu.dra-driver.dev" && device.capacity["gpu.dra-driver.dev"].memory > 1',
        '!(device.driver == "gpu.dra-driver.dev")',
        # One device by its uuid: devices are not remembered by attributes that tell them apart.
        'device.driver == "gpu.dra-driver.dev" && device.attributes["gpu.dra-driver.dev"].uuid == "GPU-1"',
    ]:
        assert class_filter({"spec": {"selectors": [{"cel": {"expression": expression}}]}}, DRIVER) is None


def test_many_nodes_of_the_same_gpus_are_held_as_one_kind_of_device() -> None:
    offers = index(*(slice_of(f"node-{n}", *(h100(minor) for minor in range(8))) for n in range(50)))
    assert offers.device_count == 400
    assert offers.device_kinds == 1  # uuids and PCI addresses differ; nothing a class selects by does
    assert offers.problem("gpu", "gpu.dra-driver.dev", {"memory": "100Gi"}) is not None
