"""One rule per kind of name: what the kubelet and the API server may hand the driver, and what not."""

from __future__ import annotations

import string
import uuid

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dra_driver.cdi.spec import check_claim_uid
from dra_driver.names import is_dns_label, is_dns_subdomain, is_uid
from dra_driver.node.claims import ClaimRejected, check_ref
from dra_driver.node.types import ClaimRef
from dra_driver.settings import Settings

UID = "0d7f3c52-1b6e-4bb7-9a1e-0c6a3c1e5b11"  # what the API server generates


@pytest.mark.parametrize(
    ("value", "valid"),
    [
        (UID, True),  # every claim and pod the kubelet names
        (UID.upper(), True),  # a UUID in capitals is still one
        (str(uuid.uuid4()), True),
        ("5a0c1e2b9f8d7c6b5a4e3d2c1b0a9f8e", True),  # a static pod's UID: the hex digest of its manifest
        ("a", True),
        ("x" * 64, True),
        ("x" * 65, False),
        ("", False),
        (".", False),
        ("..", False),
        ("a.b", False),  # cdi/spec.py took these, node/claims.py did not: now neither does
        ("a_b", False),
        ("a/b", False),
        ("-a", False),
        ("a-", False),
        ("a b", False),
        ("a\x00b", False),
        (UID + "\n", False),  # "$" would have matched before the newline
        ("é", False),
    ],
)
def test_a_uid_is_what_the_api_server_generates_and_nothing_that_could_be_a_path(
    value: str, valid: bool
) -> None:
    assert is_uid(value) is valid


@pytest.mark.parametrize(
    ("value", "valid"),
    [
        ("default", True),
        ("kube-system", True),
        ("a", True),
        ("0", True),
        ("a" * 63, True),
        ("a" * 64, False),
        ("", False),
        ("Default", False),
        ("my_ns", False),
        ("my.ns", False),  # a label has no dots; a subdomain does
        ("-ns", False),
        ("ns-", False),
        ("ns\n", False),
    ],
)
def test_a_namespace_or_device_name_is_a_dns_label(value: str, valid: bool) -> None:
    assert is_dns_label(value) is valid


@pytest.mark.parametrize(
    ("value", "valid"),
    [
        ("my-claim", True),
        ("pod-gpu.claim-0", True),
        (".".join(["a" * 63] * 3) + "." + "a" * 61, True),  # 253 characters
        (".".join(["a" * 63] * 4), False),  # 255
        ("a" * 64, True),  # the API server checks the whole name's length, not each label's
        ("", False),
        ("a..b", False),
        (".a", False),
        ("a.", False),
        ("My-Claim", False),
        ("my_claim", False),
        ("../etc", False),
        ("c\n", False),
    ],
)
def test_a_claim_or_node_name_is_a_dns_subdomain(value: str, valid: bool) -> None:
    assert is_dns_subdomain(value) is valid


_EDGES = string.ascii_letters + string.digits + "-_./ \n\x00"


@given(st.one_of(st.uuids().map(str), st.text(_EDGES, max_size=70)))
def test_the_node_and_the_cdi_spec_take_the_same_claim_uids(value: str) -> None:
    """What check_ref lets through to a prepare, the CDI spec can name; what it refuses, the spec refuses."""
    try:
        check_ref(ClaimRef("default", "claim", value))
        node_takes = True
    except ClaimRejected:
        node_takes = False
    try:
        check_claim_uid(value)
        cdi_takes = True
    except ValueError:
        cdi_takes = False
    assert node_takes is cdi_takes is is_uid(value)


def test_the_errors_say_what_the_rule_is() -> None:
    with pytest.raises(
        ClaimRejected, match=r"invalid claim uid 'a\.b': must be a Kubernetes UID: at most 64"
    ):
        check_ref(ClaimRef("default", "claim", "a.b"))
    with pytest.raises(
        ValueError, match=r"claim UID 'a_b' cannot name a CDI spec: it must be a Kubernetes UID"
    ):
        check_claim_uid("a_b")
    with pytest.raises(
        ClaimRejected, match=r"invalid claim namespace 'Default': must be a DNS label: at most 63"
    ):
        check_ref(ClaimRef("Default", "claim", UID))


def test_the_settings_take_the_same_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DRA_POD_UID", UID)
    assert Settings().pod_uid == UID
    for value in ("a.b", "a_b"):  # these became socket file names before
        monkeypatch.setenv("DRA_POD_UID", value)
        with pytest.raises(ValueError, match="pod UID"):
            Settings()
