"""Reading a claim at resource.k8s.io/v1, and telling "no such claim" from "no such API version"
in a 404.

The bodies are what kube-apiserver v1.37.2 answered (recorded with the project's control
plane): for a missing claim under a served version, and for a version it does not serve.
The fetcher against a live API server is exercised by the cluster tests.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import pytest

from dra_driver.apiserver.bounded_json import MAX_DEPTH
from dra_driver.node.claim_fetcher import ApiServerClaimFetcher, ClaimFetchError, names_missing_claim

if TYPE_CHECKING:
    from kubernetes.aio.client import ApiClient

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


class _Response:
    def __init__(self, status: int, body: bytes) -> None:
        self.status = status
        self._body = body

    async def read(self) -> bytes:
        return self._body


class _ApiClient:
    """Answers every GET with one status and body, and records the paths asked for."""

    def __init__(self, status: int, body: bytes) -> None:
        self.paths: list[str] = []
        self._response = _Response(status, body)

    async def param_serialize(
        self, *, resource_path: str, path_params: dict[str, str], **_: Any
    ) -> tuple[str]:
        self.paths.append(resource_path.format(**path_params))
        return (resource_path,)

    async def call_api(self, *_: Any, **__: Any) -> _Response:
        return self._response


def _fetcher(status: int, body: bytes) -> tuple[ApiServerClaimFetcher, _ApiClient]:
    api = _ApiClient(status, body)
    return ApiServerClaimFetcher(cast("ApiClient", api)), api


async def test_a_claim_is_read_at_resource_v1_once() -> None:
    fetcher, api = _fetcher(200, b'{"metadata": {"name": "c"}}')
    assert await fetcher.get("ns", "c") == {"metadata": {"name": "c"}}
    assert api.paths == ["/apis/resource.k8s.io/v1/namespaces/ns/resourceclaims/c"]


async def test_a_missing_claim_is_none() -> None:
    fetcher, api = _fetcher(404, MISSING_CLAIM)
    assert await fetcher.get("ns", "nope") is None
    assert len(api.paths) == 1


@pytest.mark.parametrize("body", [UNSERVED_VERSION, b"404 page not found\n"])
async def test_a_server_without_resource_v1_is_an_error_naming_the_release_needed(body: bytes) -> None:
    fetcher, api = _fetcher(404, body)
    with pytest.raises(
        ClaimFetchError, match=r"does not serve resource.k8s.io/v1: .* Kubernetes 1.34 or newer"
    ):
        await fetcher.get("ns", "c")
    assert len(api.paths) == 1  # no older version is tried: no supported release lacks v1


async def test_a_claim_whose_config_nests_3000_levels_is_refused_with_the_limit() -> None:
    parameters = '{"a":' * 3000 + "1" + "}" * 3000
    body = (
        '{"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": "deep"}, '
        '"status": {"allocation": {"devices": {"config": [{"opaque": {"parameters": ' + parameters + "}}]}}}}"
    ).encode()

    class Answering(ApiServerClaimFetcher):
        async def _get(self, namespace: str, name: str) -> tuple[int, bytes]:
            return 200, body

    with pytest.raises(ClaimFetchError) as refused:
        await Answering(cast("ApiClient", None)).get("default", "deep")
    assert str(refused.value) == (
        "GET resource.k8s.io/v1 ResourceClaim default/deep: the claim nests JSON deeper than "
        f"{MAX_DEPTH} levels, the most the driver decodes (an opaque config of this driver nests at most 5); "
        "flatten the config's parameters"
    )
