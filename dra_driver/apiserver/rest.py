"""Kubernetes API calls in plain JSON, through the ``kubernetes.aio`` ApiClient.

Raw JSON rather than the generated models: the models drop every field they do not know, so a
read-modify-write through them would erase what a newer API server added; custom resources have
no models at all; and the driver's logic wants plain dicts anyway. The ApiClient still supplies
the connection pool, TLS and authentication from the usual kubeconfig or in-cluster
configuration (see :mod:`dra_driver.apiserver.kube`).
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Mapping
from typing import TYPE_CHECKING, Any

import aiohttp

if TYPE_CHECKING:  # only for the annotations: dra_driver.apiserver.kube imports the client's machinery
    from kubernetes.aio.client import ApiClient

_REQUEST_TIMEOUT_S = 30.0
Json = dict[str, Any]


class ApiError(Exception):
    """The API server answered with an error status."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}" if message else f"{status} {reason}")
        self.status = status
        self.reason = reason


class JsonApi:
    """GET/LIST/CREATE/PATCH/DELETE on API paths, answers as dicts; errors as :class:`ApiError`."""

    def __init__(self, client: ApiClient) -> None:
        self._client = client

    async def get(self, path: str, *, request_timeout_s: float = _REQUEST_TIMEOUT_S) -> Json | None:
        """The object, or None when it does not exist."""
        try:
            return await self.call("GET", path, request_timeout_s=request_timeout_s)
        except ApiError as error:
            if error.status == 404:
                return None
            raise

    async def list(self, path: str, **query: str) -> Json:
        return await self.call("GET", path, query=query)

    async def create(self, path: str, body: Mapping[str, Any]) -> Json:
        return await self.call("POST", path, body=body)

    async def create_as_kubectl(self, path: str, body: Mapping[str, Any]) -> Json:
        """Create, the object arriving as kubectl sends it: an opaque config's bytes in Go's JSON.

        For an object that carries a claim's opaque config (a ResourceClaimTemplate): the API server
        keeps a RawExtension's bytes as sent, a template's go to its claims, and Kubernetes refuses
        every status write of a claim allocated with bytes other than Go's own encoding (compact,
        keys sorted; docs/binding-conditions.md), binding conditions included. The client's
        transport sends a JSON body as ``json.dumps`` writes it, with spaces; a YAML body (JSON is
        YAML) goes as it is, and the server decodes YAML into Go's JSON, as kubectl would have sent.
        """
        text = json.dumps(body, sort_keys=True, separators=(",", ":"))
        return await self.call("POST", path, body=text.encode(), content_type="application/yaml")

    async def merge_patch(self, path: str, body: Mapping[str, Any]) -> Json:
        return await self.call("PATCH", path, body=body, content_type="application/merge-patch+json")

    async def apply(self, path: str, body: Mapping[str, Any], manager: str) -> Json:
        """Server-side apply (create or update the fields ``manager`` owns)."""
        return await self.call(
            "PATCH",
            path,
            query={"fieldManager": manager, "force": "true"},
            body=body,
            content_type="application/apply-patch+yaml",
        )

    async def replace(self, path: str, body: Mapping[str, Any]) -> Json:
        """PUT: fails with 409 when the object changed since ``body``'s resourceVersion was read."""
        return await self.call("PUT", path, body=body)

    async def delete(self, path: str) -> None:
        """Delete (in the background); one already gone is fine."""
        try:
            await self.call("DELETE", path, body={"propagationPolicy": "Background"})
        except ApiError as error:
            if error.status != 404:
                raise

    async def call(
        self,
        method: str,
        path: str,
        *,
        query: Mapping[str, str] | None = None,
        body: Mapping[str, Any] | bytes | None = None,
        content_type: str = "application/json",
        request_timeout_s: float = _REQUEST_TIMEOUT_S,
    ) -> Json:
        response = await self._send(
            method, path, query=query, body=body, content_type=content_type, client_timeout=request_timeout_s
        )
        data = await response.read()
        if not 200 <= response.status < 300:
            raise _error(response.status, data)
        result: Json = json.loads(data) if data else {}
        return result

    async def watch(
        self,
        path: str,
        resource_version: str,
        *,
        label_selector: str = "",
        field_selector: str = "",
        timeout_seconds: int = 300,
    ) -> AsyncGenerator[Json, None]:
        """Watch events (``{"type", "object"}``) from ``resource_version`` until the server ends it.

        An expired ``resource_version`` raises ApiError 410: list again and watch from there.
        """
        selectors = {"labelSelector": label_selector, "fieldSelector": field_selector}
        response = await self._send(
            "GET",
            path,
            query={
                **{key: value for key, value in selectors.items() if value},
                "watch": "true",
                "resourceVersion": resource_version,
                "allowWatchBookmarks": "true",
                "timeoutSeconds": str(timeout_seconds),
            },
            # No total limit for a stream; only silence beyond the server's own timeout is an error.
            client_timeout=aiohttp.ClientTimeout(
                total=None, sock_connect=_REQUEST_TIMEOUT_S, sock_read=timeout_seconds + 30
            ),
        )
        try:
            if response.status != 200:
                raise _error(response.status, await response.read())
            async for line in response.response.content:
                if not line.strip():
                    continue
                event = json.loads(line)
                if event.get("type") == "ERROR":
                    status = event.get("object") or {}
                    raise ApiError(
                        int(status.get("code", 0)),
                        str(status.get("reason", "")),
                        str(status.get("message", "")),
                    )
                yield event
        finally:
            response.response.close()

    async def _send(
        self,
        method: str,
        path: str,
        *,
        query: Mapping[str, str] | None = None,
        body: Mapping[str, Any] | bytes | None = None,
        content_type: str = "application/json",
        client_timeout: float | aiohttp.ClientTimeout = _REQUEST_TIMEOUT_S,
    ) -> Any:
        method, url, headers, _, _ = await self._client.param_serialize(
            method=method,
            resource_path=path,
            query_params=list((query or {}).items()),
            header_params={"Accept": "application/json", "Content-Type": content_type},
            auth_settings=["BearerToken"],
        )
        # The body goes past param_serialize, whose sanitizing walk (meant for the generated
        # models) copies every node of plain JSON, which takes longer than json.dumps of them
        # (docs/performance.md has the figure). The client's transport encodes it either way.
        return await self._client.call_api(
            method,
            url,
            header_params=headers,
            body=body if body is None or isinstance(body, bytes) else dict(body),  # bytes go as they are
            _request_timeout=client_timeout,
        )


def _error(status: int, data: bytes) -> ApiError:
    """An ApiError carrying the server's own explanation (a Status object) when it sent one."""
    try:
        body = json.loads(data)
    except ValueError:
        return ApiError(status, "", data.decode(errors="replace")[:500])
    if not isinstance(body, dict):
        return ApiError(status, "", str(body)[:500])
    return ApiError(status, str(body.get("reason", "")), str(body.get("message", "")))
