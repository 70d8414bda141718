"""The webhook's review: opaque configs refused when written, with prepare's own message, and capacity
requests that no GPU of the driver could ever take."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from dra_driver.cdi.spec import common_edits
from dra_driver.node.admission import review
from dra_driver.node.claims import ClaimRejected, allocated_claim
from dra_driver.node.plan import plan_claim
from dra_driver.resources.capacity_fit import OfferIndex
from dra_driver.resources.devices import build_devices, partition_none
from tests.resources.factories import h100, inventory

from .builders import DRIVER, NODE, Node, claim_json, gpu_config, new_ref, opaque, result

EXAMPLES = Path(__file__).parents[2] / "docs" / "examples"
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


def test_an_update_is_judged_only_when_it_changes_the_configs() -> None:
    # A claim written before the webhook (or before a stricter driver) must still lose its finalizer.
    bad = claim([opaque(MISSPELT)])
    finalizer_removed = {"uid": "u-4", "operation": "UPDATE", "object": bad, "oldObject": bad}
    assert review({"request": finalizer_removed}, DRIVER)["response"]["allowed"] is True

    def device_class(configs: list[dict[str, Any]]) -> dict[str, Any]:
        return {"kind": "DeviceClass", "spec": {"config": configs}}

    changed = {
        "uid": "u-5",
        "operation": "UPDATE",
        "object": device_class([{"opaque": opaque(MISSPELT)["opaque"]}]),
        "oldObject": device_class([]),
    }
    assert review({"request": changed}, DRIVER)["response"]["allowed"] is False


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
    vfio = {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "VfioDeviceConfig", "iommu": {"x": 1}}
    message = answer(claim([opaque(MISSPELT), opaque(vfio)]))["status"]["message"]
    assert "config[0]" in message
    assert "config[1] (FromClaim, all requests): iommu.x: Extra inputs are not permitted" in message


# Capacity requests no device of the driver could ever take (dra_driver.resources.capacity_fit).


def shareable_h100s() -> OfferIndex:
    built = build_devices(inventory(h100(0), h100(1)), partition=partition_none, consumable=True)
    devices = [device for gpu in built for device in gpu.devices]
    offers = OfferIndex(DRIVER)
    offers.replace_classes([yaml.safe_load((EXAMPLES / "demo" / "deviceclass.yaml").read_text())])
    offers.replace_slices([{"metadata": {"name": "node-1"}, "spec": {"driver": DRIVER, "devices": devices}}])
    return offers


def sized(memory: dict[str, str], device_class: str = "gpu.dra-driver.dev") -> dict[str, Any]:
    return {"deviceClassName": device_class, "capacity": {"requests": memory}}


def capacity_answer(
    kind: str, requests: list[dict[str, Any]], offers: OfferIndex | None, operation: str = "CREATE"
) -> dict[str, Any]:
    spec = {"devices": {"requests": requests}}
    obj = {"kind": kind, "spec": {"spec": spec} if kind == "ResourceClaimTemplate" else spec}
    admission = {"request": {"uid": "u-2", "operation": operation, "object": obj}}
    response: dict[str, Any] = review(admission, DRIVER, offers)["response"]
    return response


OVER = (
    'request "gpu" asks for memory 100Gi, more than any share of a gpu.dra-driver.dev GPU can have '
    "(79Gi on NVIDIA H100 80GB HBM3)"
)


@pytest.mark.parametrize("kind", ["ResourceClaim", "ResourceClaimTemplate"])
def test_a_request_no_gpu_can_take_is_refused_at_creation_naming_it(kind: str) -> None:
    refused = capacity_answer(
        kind, [{"name": "gpu", "exactly": sized({"memory": "100Gi"})}], shareable_h100s()
    )
    assert refused["allowed"] is False
    assert refused["status"] == {"code": 422, "reason": "Invalid", "message": OVER}


def test_every_impossible_request_is_named_and_fitting_ones_pass() -> None:
    requests = [
        {"name": "small", "exactly": sized({"memory": "10.5Gi"})},  # rounded up to 11Gi: fits
        {"name": "gpu", "exactly": sized({"memory": "100Gi"})},
        {"name": "typo", "exactly": sized({"memroy": "10Gi"})},
        {"name": "whole", "exactly": {"deviceClassName": "gpu.dra-driver.dev"}},
    ]
    message = capacity_answer("ResourceClaim", requests, shareable_h100s())["status"]["message"]
    assert message == (
        f'{OVER}; request "typo" names capacity "memroy", which no gpu.dra-driver.dev GPU has (they have '
        "copyEngines, decoders, encoders, jpegEngines, memory, multiprocessors, ofaEngines)"
    )


def test_first_available_is_refused_only_when_no_subrequest_fits() -> None:
    big = {"name": "big", **sized({"memory": "100Gi"})}
    fits = {"name": "fits", **sized({"memory": "40Gi"})}
    huge = {"name": "huge", **sized({"memory": "200Gi"})}
    offers = shareable_h100s()
    allowed = capacity_answer("ResourceClaim", [{"name": "gpu", "firstAvailable": [big, fits]}], offers)
    assert allowed == {"uid": "u-2", "allowed": True}
    refused = capacity_answer("ResourceClaim", [{"name": "gpu", "firstAvailable": [big, huge]}], offers)
    message = refused["status"]["message"]
    assert message.startswith('request "gpu/big" asks for memory 100Gi, more than any share')
    assert '; request "gpu/huge" asks for memory 200Gi' in message


@pytest.mark.parametrize(
    ("requests", "offers", "operation"),
    [
        (
            [{"name": "gpu", "exactly": sized({"memory": "100Gi"}, "other.example.com")}],
            shareable_h100s(),
            "CREATE",
        ),
        (
            [{"name": "gpu", "exactly": sized({"memory": "100Gi"})}],
            OfferIndex(DRIVER),
            "CREATE",
        ),  # no slices yet
        ([{"name": "gpu", "exactly": sized({"memory": "100Gi"})}], None, "CREATE"),  # no API access
        # An update (a finalizer, a label) is never refused for what the GPUs offer now.
        ([{"name": "gpu", "exactly": sized({"memory": "100Gi"})}], shareable_h100s(), "UPDATE"),
    ],
    ids=["class-not-ours", "no-slices-known", "no-api-access", "update"],
)
def test_what_cannot_be_judged_is_allowed(
    requests: list[dict[str, Any]], offers: OfferIndex | None, operation: str
) -> None:
    assert capacity_answer("ResourceClaim", requests, offers, operation) == {"uid": "u-2", "allowed": True}


def test_a_bad_config_and_an_impossible_request_are_both_named() -> None:
    obj = claim([opaque(MISSPELT, requests=["gpu"])])
    obj["spec"]["devices"]["requests"] = [{"name": "gpu", "exactly": sized({"memory": "100Gi"})}]
    admission = {"request": {"uid": "u-3", "operation": "CREATE", "object": obj}}
    message = review(admission, DRIVER, shareable_h100s())["response"]["status"]["message"]
    assert message.startswith(f"opaque config for {DRIVER}: config[0]")
    assert message.endswith(f"; {OVER}")
