"""Identity checks and allocation parsing: pure functions on the claim's JSON."""

from __future__ import annotations

import pytest

from dra_driver.node.claims import (
    AllocationResult,
    ClaimRejected,
    ConfigSource,
    OpaqueConfig,
    allocated_claim,
    check_ref,
)
from dra_driver.node.types import ClaimRef

from .builders import DRIVER, NODE, claim_json, new_ref, opaque, result


@pytest.mark.parametrize(
    ("namespace", "name", "uid", "complaint"),
    [
        ("", "c", "0d7f3c52-1b6e-4bb7-9a1e-0c6a3c1e5b11", "invalid claim namespace ''"),
        ("Default", "c", "0d7f3c52-1b6e-4bb7-9a1e-0c6a3c1e5b11", "invalid claim namespace 'Default'"),
        ("a" * 64, "c", "0d7f3c52-1b6e-4bb7-9a1e-0c6a3c1e5b11", "invalid claim namespace"),
        ("default", "", "0d7f3c52-1b6e-4bb7-9a1e-0c6a3c1e5b11", "invalid claim name ''"),
        ("default", "my_claim", "0d7f3c52-1b6e-4bb7-9a1e-0c6a3c1e5b11", "invalid claim name 'my_claim'"),
        ("default", "../etc", "0d7f3c52-1b6e-4bb7-9a1e-0c6a3c1e5b11", "invalid claim name '../etc'"),
        ("default", "c", "", "invalid claim uid ''"),
        ("default", "c", "../../etc/passwd", "invalid claim uid '../../etc/passwd'"),
        ("default", "c", "a/b", "invalid claim uid 'a/b'"),
        ("default", "c", "..", "invalid claim uid '..'"),
        ("default", "c", "abc\x00def", "invalid claim uid"),
        ("default", "c", "-leading-dash", "invalid claim uid"),
        ("default", "c", "x" * 65, "invalid claim uid"),
        # A trailing newline slipped past "$" (found by the fault suite's gRPC fuzzer, e2e/reliability).
        ("default\n", "c", "0d7f3c52-1b6e-4bb7-9a1e-0c6a3c1e5b11", "invalid claim namespace"),
        ("default", "c\n", "0d7f3c52-1b6e-4bb7-9a1e-0c6a3c1e5b11", "invalid claim name"),
        ("default", "c", "0d7f3c52-1b6e-4bb7-9a1e-0c6a3c1e5b11\n", "invalid claim uid"),
    ],
)
def test_malformed_identity_is_rejected(namespace: str, name: str, uid: str, complaint: str) -> None:
    with pytest.raises(ClaimRejected, match=complaint.replace(".", r"\.")):
        check_ref(ClaimRef(namespace, name, uid))


def test_well_formed_identity_passes() -> None:
    check_ref(ClaimRef("kube-system", "pod-gpu.claim-1", "0d7f3c52-1b6e-4bb7-9a1e-0c6a3c1e5b11"))


def test_only_our_driver_and_pool_are_kept() -> None:
    ref = new_ref()
    claim = claim_json(
        ref,
        [
            result("gpu-0", "a"),
            result("gpu-0", "b", pool="node-b"),
            result("nic-0", "c", driver="net.example.com"),
            result("gpu-1", "d/large", admin_access=True, share_id="7a6b"),
        ],
    )

    parsed = allocated_claim(ref, claim, DRIVER, NODE)

    assert parsed.ref == ref
    assert parsed.results == (
        AllocationResult("a", NODE, "gpu-0"),
        AllocationResult("d/large", NODE, "gpu-1", admin_access=True, share_id="7a6b"),
    )
    assert parsed.results[1].parent_request == "d"


def test_only_opaque_configs_of_our_driver_are_kept_with_their_position() -> None:
    ref = new_ref()
    mine = {"apiVersion": "x", "kind": "y"}
    claim = claim_json(
        ref,
        [result("gpu-0")],
        [
            opaque({"other": 1}, driver="net.example.com"),
            opaque(mine, source="FromClass"),
            opaque(mine, requests=["gpu", "gpu/small"]),
        ],
    )

    parsed = allocated_claim(ref, claim, DRIVER, NODE)

    assert parsed.configs == (
        OpaqueConfig(1, ConfigSource.FROM_CLASS, (), mine),
        OpaqueConfig(2, ConfigSource.FROM_CLAIM, ("gpu", "gpu/small"), mine),
    )
    assert parsed.configs[1].describe() == "config[2] (FromClaim, requests [gpu, gpu/small])"
    assert parsed.configs[0].describe() == "config[1] (FromClass, all requests)"


def test_replaced_claim_names_both_uids() -> None:
    ref = new_ref("c1")
    claim = claim_json(ref, [result("gpu-0")], uid="11111111-2222-3333-4444-555555555555")

    with pytest.raises(ClaimRejected) as rejected:
        allocated_claim(ref, claim, DRIVER, NODE)

    assert str(rejected.value).startswith(
        f"claim default/c1 was deleted and re-created (replaced): expected uid {ref.uid}, "
        "found 11111111-2222-3333-4444-555555555555"
    )


def test_unallocated_claim_is_rejected() -> None:
    ref = new_ref()
    with pytest.raises(ClaimRejected, match="is not allocated"):
        allocated_claim(ref, claim_json(ref, results=None), DRIVER, NODE)


@pytest.mark.parametrize(
    "results",
    [
        [result("gpu-0", pool="node-b")],
        [result("nic-0", driver="net.example.com")],
        [],
    ],
)
def test_claim_with_nothing_for_us_is_rejected(results: list[dict[str, object]]) -> None:
    ref = new_ref()
    with pytest.raises(ClaimRejected, match="allocated to another node's pool or another driver only"):
        allocated_claim(ref, claim_json(ref, results), DRIVER, NODE)


def test_unknown_config_source_is_rejected() -> None:
    ref = new_ref()
    claim = claim_json(ref, [result("gpu-0")], [opaque({}, source="FromElsewhere")])
    with pytest.raises(ClaimRejected, match=r"config\[0\] has unknown source 'FromElsewhere'"):
        allocated_claim(ref, claim, DRIVER, NODE)
