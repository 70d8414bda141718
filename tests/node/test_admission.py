"""The webhook's review of opaque configs: refused when written, with prepare's own message."""

from __future__ import annotations

from typing import Any

import pytest

from dra_driver.cdi.spec import common_edits
from dra_driver.node.admission import review
from dra_driver.node.claims import ClaimRejected, allocated_claim
from dra_driver.node.plan import plan_claim

from .builders import DRIVER, NODE, Node, claim_json, gpu_config, new_ref, opaque, result

MISSPELT = gpu_config({"strategy": "TimeSlicing", "timeslicing": {"interval": "Long"}})


def claim(configs: list[dict[str, Any]]) -> dict[str, Any]:
    entries = [{k: v for k, v in c.items() if k != "source"} for c in configs]
    return {"kind": "ResourceClaim", "spec": {"devices": {"requests": [], "config": entries}}}


def answer(obj: dict[str, Any]) -> dict[str, Any]:
    response: dict[str, Any] = review({"request": {"uid": "u-1", "object": obj}}, DRIVER)["response"]
    return response


def test_a_valid_config_and_other_drivers_configs_are_allowed() -> None:
    other = opaque({"anything": True}, driver="other.example.com")
    assert answer(claim([opaque(gpu_config({"strategy": "MPS"})), other])) == {"uid": "u-1", "allowed": True}


def test_a_misspelt_config_is_refused_with_the_message_prepare_gives(node: Node) -> None:
    refused = answer(claim([opaque(MISSPELT, requests=["gpu"])]))

    assert refused["allowed"] is False
    assert refused["status"]["code"] == 422
    assert _at_prepare(node, [opaque(MISSPELT, requests=["gpu"])]) in refused["status"]["message"]


def _at_prepare(node: Node, allocation_configs: list[dict[str, Any]]) -> str:
    """What prepare says of a one-request claim (`gpu`) allocated with ``allocation_configs``."""
    ref = new_ref()
    allocated = allocated_claim(ref, claim_json(ref, [result("gpu-0")], allocation_configs), DRIVER, NODE)
    inventory = node.backend.inventory()
    with pytest.raises(ClaimRejected) as at_prepare:
        plan_claim(allocated, inventory, DRIVER, common_edits(inventory, None))
    return str(at_prepare.value)


def test_a_config_naming_every_request_is_described_as_the_1_37_allocation_has_it(node: Node) -> None:
    # Kubernetes 1.37's allocator writes a config that names every request of the claim with no
    # requests ("empty means all"); the webhook's message is then prepare's, word for word.
    written = {
        "kind": "ResourceClaim",
        "spec": {
            "devices": {
                "requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu"}}],
                "config": [{"requests": ["gpu"], "opaque": {"driver": DRIVER, "parameters": MISSPELT}}],
            }
        },
    }
    refused = answer(written)
    assert (
        refused["status"]["message"] == f"opaque config for {DRIVER}: {_at_prepare(node, [opaque(MISSPELT)])}"
    )
    assert "(FromClaim, all requests)" in refused["status"]["message"]
    # One request of two: its name stays, at admission as in the allocation.
    written["spec"]["devices"]["requests"].append({"name": "other", "exactly": {"deviceClassName": "gpu"}})
    assert "(FromClaim, requests [gpu])" in answer(written)["status"]["message"]


@pytest.mark.parametrize(
    ("kind", "wrap"),
    [
        ("ResourceClaimTemplate", lambda configs: {"spec": {"spec": {"devices": {"config": configs}}}}),
        ("DeviceClass", lambda configs: {"spec": {"config": configs}}),
    ],
)
def test_templates_and_classes_are_checked_too(kind: str, wrap: Any) -> None:
    obj = {"kind": kind, **wrap([{"opaque": {"driver": DRIVER, "parameters": MISSPELT}}])}
    refused = answer(obj)
    assert refused["allowed"] is False
    source = "FromClass" if kind == "DeviceClass" else "FromClaim"
    assert (
        f"config[0] ({source}, all requests): sharing.timeslicing: Extra inputs are not permitted"
        in (refused["status"]["message"])
    )


def test_every_bad_entry_is_named_at_once() -> None:
    vfio = {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "VfioDeviceConfig"}
    message = answer(claim([opaque(MISSPELT), opaque(vfio)]))["status"]["message"]
    assert "config[0]" in message
    assert "config[1] (FromClaim, all requests): kind: VfioDeviceConfig" in message
