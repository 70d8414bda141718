"""Reading ResourceClaims from the API server, as raw JSON.

We read the raw JSON rather than the client's pydantic models: it is faster, and a
model silently drops fields it does not know, which a newer API server may send.

Claims are read at resource.k8s.io/v1, GA since Kubernetes 1.34, the oldest release the
driver supports (docs/kubernetes-versions.md). A 404 means either "no such claim" or, from
an older server, "no such API version"; the API server tells them apart in the Status body
(``details.kind`` names the resource only when the object is missing): the first is an
answer, the second an error that says which Kubernetes the driver needs.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from dra_driver.apiserver import bounded_json

if TYPE_CHECKING:  # only for the annotations: dra_driver.apiserver.kube imports the client's machinery
    from kubernetes.aio.client import ApiClient


_GET_TIMEOUT_S = 15.0


class ClaimFetchError(Exception):
    """The claim could not be read (network, RBAC, server error); a retry may succeed."""


class ClaimFetcher(Protocol):
    async def get(self, namespace: str, name: str) -> Mapping[str, Any] | None:
        """The ResourceClaim's JSON, or ``None`` if it does not exist.

        Raises :class:`ClaimFetchError` when the API server could not answer.
        """
        ...


API_VERSION = "v1"


class ApiServerClaimFetcher:
    """:class:`ClaimFetcher` backed by ``kubernetes.aio``; the caller owns (and closes) ``api_client``."""

    def __init__(self, api_client: ApiClient) -> None:
        self._api = api_client

    async def get(self, namespace: str, name: str) -> Mapping[str, Any] | None:
        what = f"GET resource.k8s.io/{API_VERSION} ResourceClaim {namespace}/{name}"
        try:
            status, body = await self._get(namespace, name)
        except Exception as error:  # aiohttp and the client raise many types; all mean "no answer"
            raise ClaimFetchError(f"{what}: {error}") from error
        if status == 200:
            return _decode(body, what)
        if status == 404 and names_missing_claim(body):
            return None
        if status == 404:
            raise ClaimFetchError(
                f"the API server does not serve resource.k8s.io/{API_VERSION}: "
                "Dynamic Resource Allocation with this driver needs Kubernetes 1.34 or newer"
            )
        raise ClaimFetchError(f"{what}: HTTP {status}: {_status_message(body)}")

    async def _get(self, namespace: str, name: str) -> tuple[int, bytes]:
        request = await self._api.param_serialize(
            method="GET",
            resource_path=f"/apis/resource.k8s.io/{API_VERSION}/namespaces/{{namespace}}/resourceclaims/{{name}}",
            path_params={"namespace": namespace, "name": name},
            header_params={"Accept": "application/json"},
            auth_settings=["BearerToken"],
        )
        # Bounded well below the kubelet's 45 s: a hung API server must not pin the claim's lock.
        response: Any = await self._api.call_api(*request, _request_timeout=_GET_TIMEOUT_S)
        body: bytes = await response.read()
        return response.status, body


def _decode(body: bytes, what: str) -> Mapping[str, Any]:
    try:
        claim = bounded_json.loads(body, "the claim")
    except bounded_json.TooDeep as error:
        raise ClaimFetchError(f"{what}: {error}") from None
    except ValueError as error:
        raise ClaimFetchError(f"{what}: the response is not JSON: {error}") from error
    if not isinstance(claim, dict):
        raise ClaimFetchError(f"{what}: the response is not a JSON object")
    return claim


def names_missing_claim(body: bytes) -> bool:
    """Whether a 404's body says "no such ResourceClaim" rather than "no such API version".

    A missing object's Status names its resource in ``details``; a path the server does
    not serve gets ``details: {}`` (or, from older servers, plain text).
    """
    try:
        status = json.loads(body)
    except ValueError:
        return False  # "404 page not found" in plain text: the path is not served at all
    details = status.get("details") if isinstance(status, dict) else None
    return isinstance(details, dict) and details.get("kind") == "resourceclaims"


def _status_message(body: bytes) -> str:
    try:
        status = json.loads(body)
    except ValueError:
        return body[:200].decode(errors="replace")
    if isinstance(status, dict) and isinstance(status.get("message"), str):
        return str(status["message"])
    return body[:200].decode(errors="replace")
