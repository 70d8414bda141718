"""Planning a prepare: device resolution, effective configs, sharing env and the CDI spec (pure)."""

from __future__ import annotations

import re
from typing import Any

import pytest

from dra_driver.cdi.spec import common_edits
from dra_driver.devices.types import Inventory
from dra_driver.node.claims import AllocatedClaim, ClaimRejected, allocated_claim
from dra_driver.node.plan import ClaimPlan, plan_claim
from dra_driver.resources.device_names import mig_device_name

from .builders import DRIVER, NODE, Node, claim_json, gpu_config, new_ref, opaque, result


def plan(node: Node, results: list[dict[str, Any]], configs: list[dict[str, Any]] | None = None) -> ClaimPlan:
    ref = new_ref()
    claim: AllocatedClaim = allocated_claim(ref, claim_json(ref, results, configs or []), DRIVER, NODE)
    inventory: Inventory = node.backend.inventory()
    return plan_claim(claim, inventory, DRIVER, common_edits(inventory, None))


def device_env(plan: ClaimPlan, name: str) -> dict[str, str]:
    uid = plan.claim.ref.uid
    device = next(d for d in plan.cdi_spec["devices"] if d["name"] == f"{uid}-{name}")
    return dict(e.split("=", 1) for e in device["containerEdits"]["env"])


def test_full_gpus_get_their_node_uuid_and_default_config(node: Node) -> None:
    planned = plan(node, [result("gpu-0"), result("gpu-4", "other")])
    inventory = node.backend.inventory()
    uid = planned.claim.ref.uid

    assert [d.cdi_device_id for d in planned.devices] == [
        f"k8s.{DRIVER}/claim={uid}-gpu-0",
        f"k8s.{DRIVER}/claim={uid}-gpu-4",
    ]
    assert [d.target.gpu.minor for d in planned.devices] == [0, 4]
    spec_device = planned.cdi_spec["devices"][1]
    assert spec_device["containerEdits"]["deviceNodes"][0]["path"] == "/dev/nvidia4"
    assert device_env(planned, "gpu-4") == {
        "DRA_GPU_UUID_GPU_4": inventory.gpus[4].uuid,
        "DRA_GPU_SHARING_STRATEGY_GPU_4": "Exclusive",
    }


def test_sharing_settings_reach_the_env_of_their_device_only(node: Node) -> None:
    mps = gpu_config(
        {
            "strategy": "MPS",
            "mps": {"defaultActiveThreadPercentage": 25, "defaultPinnedDeviceMemoryLimit": "2Gi"},
        }
    )
    slicing = gpu_config({"strategy": "TimeSlicing", "timeSlicing": {"interval": "Long"}})
    planned = plan(
        node,
        [result("gpu-0", "train"), result("gpu-1", "infer")],
        [opaque(slicing, source="FromClass"), opaque(mps, requests=["train"])],
    )

    assert device_env(planned, "gpu-0") == {
        "DRA_GPU_UUID_GPU_0": planned.devices[0].target.uuid,
        "DRA_GPU_SHARING_STRATEGY_GPU_0": "MPS",
        "DRA_GPU_MPS_ACTIVE_THREAD_PERCENTAGE_GPU_0": "25",
        "DRA_GPU_MPS_PINNED_DEVICE_MEMORY_LIMIT_GPU_0": str(2 * 2**30),
    }
    assert device_env(planned, "gpu-1") == {
        "DRA_GPU_UUID_GPU_1": planned.devices[1].target.uuid,
        "DRA_GPU_SHARING_STRATEGY_GPU_1": "TimeSlicing",
        "DRA_GPU_TIME_SLICE_INTERVAL_GPU_1": "Long",
    }


def test_config_for_parent_request_applies_to_first_available_result(node: Node) -> None:
    slicing = gpu_config({"strategy": "TimeSlicing"})
    planned = plan(node, [result("gpu-2", "gpu/a100")], [opaque(slicing, requests=["gpu"])])

    assert planned.devices[0].config.sharing.strategy == "TimeSlicing"
    assert device_env(planned, "gpu-2")["DRA_GPU_TIME_SLICE_INTERVAL_GPU_2"] == "Default"


def test_existing_mig_device_is_prepared_with_its_caps_and_mig_config(node: Node) -> None:
    node.backend.admin_set_mig_mode(0, True)
    mig = node.backend.admin_create_mig(0, "3g.40gb", 4)
    name = mig_device_name(0, mig.profile, mig.profile_id, mig.placement.start)
    gpu_only = gpu_config({"strategy": "TimeSlicing"})
    mig_mps = {
        "apiVersion": gpu_only["apiVersion"],
        "kind": "MigDeviceConfig",
        "sharing": {"strategy": "MPS"},
    }

    planned = plan(node, [result(name)], [opaque(gpu_only), opaque(mig_mps)])

    device = planned.cdi_spec["devices"][0]
    assert [n["path"] for n in device["containerEdits"]["deviceNodes"]] == [
        "/dev/nvidia0",
        *(n.path for n in mig.cap_nodes),
    ]
    assert device_env(planned, name)[f"DRA_GPU_UUID_{name.upper().replace('-', '_')}"] == mig.uuid
    assert planned.devices[0].config.kind == "MigDeviceConfig"
    assert planned.devices[0].config.sharing.strategy == "MPS"


@pytest.mark.parametrize(
    ("device", "complaint"),
    [
        (
            "gpu-9",
            "device gpu-9 does not exist on this node (GPUs: gpu-0, gpu-1, gpu-2, gpu-3, gpu-4, gpu-5)",
        ),
        ("gpu-0-mig-1g10gb-19-7", "device gpu-0-mig-1g10gb-19-7 does not exist"),  # no 1g at slice 7
        ("gpu-4-mig-1g10gb-19-0", "device gpu-4-mig-1g10gb-19-0 does not exist"),  # an L4 has no MIG
        ("nvme-0", "device nvme-0 does not exist on this node"),
    ],
)
def test_device_we_do_not_have_is_rejected(node: Node, device: str, complaint: str) -> None:
    with pytest.raises(ClaimRejected, match=re.escape(complaint)):
        plan(node, [result("gpu-1"), result(device, "other")])


def test_full_gpu_in_mig_mode_is_rejected(node: Node) -> None:
    node.backend.admin_set_mig_mode(1, True)
    with pytest.raises(ClaimRejected, match="device gpu-1 is in MIG mode and cannot be used whole"):
        plan(node, [result("gpu-1")])


def test_mps_memory_limit_beyond_the_device_is_rejected(node: Node) -> None:
    too_much = gpu_config({"strategy": "MPS", "mps": {"defaultPinnedDeviceMemoryLimit": "100Gi"}})
    with pytest.raises(
        ClaimRejected, match=r"device gpu-4: sharing.mps.defaultPinnedDeviceMemoryLimit 100Gi exceeds"
    ):
        plan(node, [result("gpu-4")], [opaque(too_much)])


def test_invalid_config_for_our_driver_rejects_the_claim(node: Node) -> None:
    with pytest.raises(ClaimRejected, match=r"config\[1\] \(FromClaim, all requests\): sharing.strategy"):
        plan(
            node,
            [result("gpu-0")],
            [opaque({"x": 1}, driver="other.example.com"), opaque(gpu_config({"strategy": 1}))],
        )


# --- configs of the wrong kind ---------------------------------------------------------------------------

MIG_1G = "gpu-0-mig-1g10gb-19-0"  # a 1g.10gb placement on the first H100, created at prepare


def mig_config(sharing: dict[str, Any] | None = None) -> dict[str, Any]:
    return {**gpu_config(sharing), "kind": "MigDeviceConfig"}


@pytest.mark.parametrize(
    ("results", "config", "complaint"),
    [
        (
            [result(MIG_1G, "gpu")],
            opaque(gpu_config({"strategy": "TimeSlicing"}), requests=["gpu"]),
            f"config[0] (FromClaim, requests [gpu]): GpuConfig applies to full GPUs, but request gpu was "
            f"allocated MIG device {MIG_1G}; use MigDeviceConfig",
        ),
        (
            [result("gpu-0", "infer"), result("gpu-1", "infer")],
            opaque(mig_config({"strategy": "MPS"}), requests=["infer"]),
            "config[0] (FromClaim, requests [infer]): MigDeviceConfig applies to MIG devices, but request "
            "infer was allocated full GPUs gpu-0, gpu-1; use GpuConfig",
        ),
        (  # one named request is served, the other is not
            [result("gpu-2", "train"), result(MIG_1G, "infer")],
            opaque(gpu_config(), requests=["train", "infer"]),
            "config[0] (FromClaim, requests [train, infer]): GpuConfig applies to full GPUs, but request "
            f"infer was allocated MIG device {MIG_1G}; use MigDeviceConfig",
        ),
        (  # a subrequest named itself is checked like any request
            [result(MIG_1G, "gpu/small")],
            opaque(gpu_config(), requests=["gpu/small"]),
            "config[0] (FromClaim, requests [gpu/small]): GpuConfig applies to full GPUs, but request "
            f"gpu/small was allocated MIG device {MIG_1G}",
        ),
    ],
)
def test_claim_config_naming_a_request_of_the_other_kind_rejects_the_claim(
    node: Node, results: list[dict[str, Any]], config: dict[str, Any], complaint: str
) -> None:
    with pytest.raises(ClaimRejected, match=re.escape(complaint)):
        plan(node, results, [config])


def test_every_config_of_the_wrong_kind_is_named_at_once(node: Node) -> None:
    with pytest.raises(ClaimRejected) as rejected:
        plan(
            node,
            [result("gpu-2", "train"), result(MIG_1G, "infer")],
            [opaque(mig_config(), requests=["train"]), opaque(gpu_config(), requests=["infer"])],
        )

    assert str(rejected.value).startswith("config[0] (FromClaim, requests [train]): MigDeviceConfig")
    assert "; config[1] (FromClaim, requests [infer]): GpuConfig" in str(rejected.value)


def test_config_naming_no_request_applies_to_its_kind_in_a_mixed_claim(node: Node) -> None:
    planned = plan(
        node,
        [result("gpu-2", "train"), result(MIG_1G, "infer")],
        [opaque(gpu_config({"strategy": "TimeSlicing"}))],
    )

    assert [(d.config.kind, d.config.sharing.strategy) for d in planned.devices] == [
        ("GpuConfig", "TimeSlicing"),
        ("MigDeviceConfig", "Exclusive"),
    ]


def test_class_configs_of_both_kinds_sit_side_by_side(node: Node) -> None:
    # The scheduler names, for each class config, the requests allocated from the class.
    planned = plan(
        node,
        [result(MIG_1G, "infer")],
        [
            opaque(gpu_config({"strategy": "TimeSlicing"}), source="FromClass", requests=["infer"]),
            opaque(mig_config({"strategy": "MPS"}), source="FromClass", requests=["infer"]),
        ],
    )

    assert planned.devices[0].config.kind == "MigDeviceConfig"
    assert planned.devices[0].config.sharing.strategy == "MPS"


@pytest.mark.parametrize(
    ("chosen", "kind", "strategy"),
    [("gpu/whole", "GpuConfig", "TimeSlicing"), ("gpu/small", "MigDeviceConfig", "MPS")],
)
def test_configs_per_kind_for_a_first_available_parent_apply_to_whichever_alternative_won(
    node: Node, chosen: str, kind: str, strategy: str
) -> None:
    device = "gpu-2" if chosen == "gpu/whole" else MIG_1G
    planned = plan(
        node,
        [result(device, chosen)],
        [
            opaque(gpu_config({"strategy": "TimeSlicing"}), requests=["gpu"]),
            opaque(mig_config({"strategy": "MPS"}), requests=["gpu"]),
        ],
    )

    assert (planned.devices[0].config.kind, planned.devices[0].config.sharing.strategy) == (kind, strategy)


def test_config_of_one_kind_for_a_first_available_parent_is_no_error_when_the_other_kind_won(
    node: Node,
) -> None:
    planned = plan(node, [result(MIG_1G, "gpu/small")], [opaque(gpu_config(), requests=["gpu"])])

    assert planned.devices[0].config.kind == "MigDeviceConfig"
