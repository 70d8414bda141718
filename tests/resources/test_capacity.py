"""Consumable capacity: what a shareable GPU publishes, and the policy the node checks allocations by."""

from __future__ import annotations

from dataclasses import replace

from dra_driver.resources.capacity import GIB, policy_problems, share_policy
from dra_driver.resources.devices import build_devices, partition_none
from dra_driver.resources.slices import split_pool

from .factories import h100, inventory, mig_device, with_mig_devices

H100_BYTES = 85520809984  # 81559 MiB, what NVML reports


def test_off_by_default_nothing_is_shareable() -> None:
    (gpu,) = build_devices(inventory(h100()))
    assert all("allowMultipleAllocations" not in device for device in gpu.devices)
    assert all("requestPolicy" not in c for d in gpu.devices for c in d["capacity"].values())


def test_a_shareable_gpu_publishes_memory_and_sms_with_request_policies() -> None:
    (gpu,) = build_devices(inventory(h100()), partition=partition_none, consumable=True)
    (device,) = gpu.devices
    assert device["name"] == "gpu-0"
    assert device["allowMultipleAllocations"] is True
    assert device["capacity"]["memory"] == {
        "value": str(H100_BYTES),
        # The default is everything one allocation may take: a claim that asks for no memory gets the GPU.
        "requestPolicy": {"default": "79Gi", "validRange": {"min": "1Gi", "max": "79Gi", "step": "1Gi"}},
    }
    assert device["capacity"]["multiprocessors"] == {
        "value": "132",
        "requestPolicy": {"default": "0", "validRange": {"min": "0", "max": "132", "step": "1"}},
    }


def test_every_other_capacity_is_not_reserved_by_a_share() -> None:
    """Without a policy an allocation consumes a capacity whole, and no second share would fit."""
    (gpu,) = build_devices(inventory(h100()), consumable=True)
    capacity = next(d for d in gpu.devices if d["name"] == "gpu-0")["capacity"]
    assert set(capacity) == {
        "memory",
        "multiprocessors",
        "copyEngines",
        "decoders",
        "encoders",
        "jpegEngines",
        "ofaEngines",
    }
    assert capacity["ofaEngines"] == {
        "value": "1",
        "requestPolicy": {"default": "0", "validRange": {"min": "0", "max": "1"}},
    }
    assert all("requestPolicy" in value for value in capacity.values())


def test_a_partitioned_gpu_stays_shareable_and_keeps_its_counters() -> None:
    (gpu,) = build_devices(inventory(h100()), consumable=True)
    devices = {device["name"]: device for device in gpu.devices}
    full = devices["gpu-0"]
    assert full["allowMultipleAllocations"] is True
    # Charged once with the first share: no MIG placement of this GPU beside any share.
    assert full["consumesCounters"][0]["counters"] == gpu.counter_set["counters"]  # type: ignore[index]
    assert all("allowMultipleAllocations" not in d for name, d in devices.items() if name != "gpu-0")


def test_only_full_gpus_become_shareable() -> None:
    gpu = with_mig_devices(h100(), mig_device(h100(), "3g.40gb", 0))
    (published,) = build_devices(inventory(gpu), consumable=True, maintenance=True)
    assert [d["name"] for d in published.devices if d.get("allowMultipleAllocations")] == []


def test_shareable_slices_stay_within_the_api_limits() -> None:
    gpus = build_devices(inventory(*(h100(minor) for minor in range(8))), consumable=True)
    for content in split_pool(gpus):
        assert len(content.devices) <= 64
        for device in content.devices:
            assert len(device["attributes"]) + len(device["capacity"]) <= 32


def test_a_gpu_too_small_for_two_shares_is_published_as_before() -> None:
    tiny = replace(h100(), memory_bytes=GIB + GIB // 2)
    (gpu,) = build_devices(inventory(tiny), partition=partition_none, consumable=True)
    assert "allowMultipleAllocations" not in gpu.devices[0]


def test_the_policy_accepts_what_the_scheduler_records_and_names_what_it_would_not() -> None:
    policy = share_policy(h100())
    assert policy is not None
    assert policy_problems(policy, {"memory": 10 * GIB, "multiprocessors": 0}) == []
    assert policy_problems(policy, {"memory": 79 * GIB, "multiprocessors": 132}) == []
    assert policy_problems(policy, {"memory": 80 * GIB}) == [
        "memory 80Gi is outside the policy's range 1Gi-79Gi"
    ]
    assert policy_problems(policy, {"memory": 10 * GIB + 1}) == [
        f"memory {10 * GIB + 1} bytes is not a whole number of 1Gi steps"
    ]
    assert policy_problems(policy, {"memory": GIB, "multiprocessors": 133}) == [
        "multiprocessors 133 is outside the policy's range 0-132"
    ]
    assert policy_problems(policy, {}) == ["it records no memory"]


def test_whole_means_no_other_share_fits_beside_it() -> None:
    policy = share_policy(h100())
    assert policy is not None
    assert policy.is_whole(policy.memory_default)
    assert not policy.is_whole(78 * GIB)
