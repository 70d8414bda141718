"""ResourceSlice calls over raw REST, through the ``kubernetes.aio`` ApiClient.

Raw JSON rather than the generated models: the models drop every field they do not know,
so a read-modify-write through them would erase what a newer API server added, and the
pool logic wants plain dicts anyway. The ApiClient still supplies the connection pool,
TLS and authentication from the usual kubeconfig or in-cluster configuration.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Mapping
from typing import TYPE_CHECKING, Any

import aiohttp

from dra_driver.resources.wire import ResourceSlice

if TYPE_CHECKING:  # only for the annotations: dra_driver.kube imports the client's machinery
    from kubernetes.aio.client import ApiClient

_COLLECTION = "/apis/resource.k8s.io/v1/resourceslices"
_REQUEST_TIMEOUT_S = 30.0


class ApiError(Exception):
    """The API server answered with an error status."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}" if message else f"{status} {reason}")
        self.status = status
        self.reason = reason


class ResourceSliceApi:
    def __init__(self, client: ApiClient) -> None:
        self._client = client

    async def list_slices(self, field_selector: str) -> tuple[list[dict[str, Any]], str]:
        """The matching slices and the list's resourceVersion, to start a watch from."""
        body = await self._call("GET", _COLLECTION, query=[("fieldSelector", field_selector)])
        return list(body.get("items") or []), str(body["metadata"]["resourceVersion"])

    async def apply(self, manifest: ResourceSlice, field_manager: str) -> dict[str, Any]:
        """Create or update the slice with server-side apply; returns the stored object."""
        return await self._call(
            "PATCH",
            f"{_COLLECTION}/{manifest['metadata']['name']}",
            query=[("fieldManager", field_manager), ("force", "true")],
            body=manifest,
            content_type="application/apply-patch+yaml",  # JSON is YAML
        )

    async def delete(self, name: str, uid: str, resource_version: str) -> None:
        """Delete the slice only if it is still the object we saw; one already gone is fine."""
        options = {
            "apiVersion": "v1",
            "kind": "DeleteOptions",
            "preconditions": {"uid": uid, "resourceVersion": resource_version},
        }
        try:
            await self._call("DELETE", f"{_COLLECTION}/{name}", body=options)
        except ApiError as error:
            if error.status != 404:
                raise

    async def watch(
        self, field_selector: str, resource_version: str, timeout_seconds: int
    ) -> AsyncGenerator[dict[str, Any], None]:
        """Watch events (``{"type", "object"}``) until the server ends the watch.

        An expired ``resource_version`` raises ApiError 410: list again and watch from there.
        """
        response = await self._send(
            "GET",
            _COLLECTION,
            query=[
                ("fieldSelector", field_selector),
                ("watch", "true"),
                ("resourceVersion", resource_version),
                ("allowWatchBookmarks", "true"),
                ("timeoutSeconds", str(timeout_seconds)),
            ],
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

    async def _call(
        self,
        method: str,
        path: str,
        *,
        query: list[tuple[str, str]] | None = None,
        body: Mapping[str, Any] | None = None,
        content_type: str = "application/json",
    ) -> dict[str, Any]:
        response = await self._send(method, path, query=query, body=body, content_type=content_type)
        data = await response.read()
        if not 200 <= response.status < 300:
            raise _error(response.status, data)
        result: dict[str, Any] = json.loads(data) if data else {}
        return result

    async def _send(
        self,
        method: str,
        path: str,
        *,
        query: list[tuple[str, str]] | None = None,
        body: Mapping[str, Any] | None = None,
        content_type: str = "application/json",
        client_timeout: float | aiohttp.ClientTimeout = _REQUEST_TIMEOUT_S,
    ) -> Any:
        method, url, headers, serialized, _ = await self._client.param_serialize(
            method=method,
            resource_path=path,
            query_params=query or [],
            header_params={"Accept": "application/json", "Content-Type": content_type},
            body=dict(body) if body is not None else None,
            auth_settings=["BearerToken"],
        )
        return await self._client.call_api(
            method, url, header_params=headers, body=serialized, _request_timeout=client_timeout
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
