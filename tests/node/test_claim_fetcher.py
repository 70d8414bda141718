"""Telling "no such claim" from "no such API version" in a 404.

The bodies are what kube-apiserver v1.37.2 answered (recorded with the project's control
plane): for a missing claim under a served version, and for a version it does not serve.
The fetcher against a live API server is exercised by the cluster tests.
"""

from __future__ import annotations

import pytest

from dra_driver.bounded_json import MAX_DEPTH
from dra_driver.node.claim_fetcher import ApiServerClaimFetcher, ClaimFetchError, names_missing_claim

MISSING_CLAIM = (
    b'{"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure",'
    b'"message":"resourceclaims.resource.k8s.io \\"nope\\" not found","reason":"NotFound",'
    b'"details":{"name":"nope","group":"resource.k8s.io","kind":"resourceclaims"},"code":404}\n'
)
UNSERVED_VERSION = (
    b'{"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure",'
    b'"message":"the server could not find the requested resource","reason":"NotFound",'
    b'"details":{},"code":404}\n'
)


def test_missing_claim_is_recognized() -> None:
    assert names_missing_claim(MISSING_CLAIM)


@pytest.mark.parametrize("body", [UNSERVED_VERSION, b"404 page not found\n", b"", b"[]", b'{"details": []}'])
def test_unserved_version_is_not_a_missing_claim(body: bytes) -> None:
    assert not names_missing_claim(body)


async def test_a_claim_whose_config_nests_3000_levels_is_refused_with_the_limit() -> None:
    parameters = '{"a":' * 3000 + "1" + "}" * 3000
    body = (
        '{"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": "deep"}, '
        '"status": {"allocation": {"devices": {"config": [{"opaque": {"parameters": ' + parameters + "}}]}}}}"
    ).encode()

    class Answering(ApiServerClaimFetcher):
        async def _get(self, version: str, namespace: str, name: str) -> tuple[int, bytes]:
            return 200, body

    with pytest.raises(ClaimFetchError) as refused:
        await Answering(api_client=None).get("default", "deep")  # type: ignore[arg-type]
    assert str(refused.value) == (
        "GET resource.k8s.io/v1 ResourceClaim default/deep: the claim nests JSON deeper than "
        f"{MAX_DEPTH} levels, the most the driver decodes (an opaque config of this driver nests at most 5); "
        "flatten the config's parameters"
    )
