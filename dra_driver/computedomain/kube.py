"""Plain-JSON Kubernetes calls for the ComputeDomain components, and a list-then-watch loop.

Raw JSON through the ``kubernetes.aio`` ApiClient, as for ResourceSlices: custom resources have no
generated models, and a read-modify-write through models would drop fields they do not know.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from typing import Any

import aiohttp
import structlog

from dra_driver.kube import ApiClient
from dra_driver.resources.slice_api import ApiError

log = structlog.get_logger(__name__)

_REQUEST_TIMEOUT_S = 30.0
_GONE = 410
Json = dict[str, Any]


class Kube:
    """GET/LIST/CREATE/PATCH/DELETE on API paths, answers as dicts; errors as :class:`ApiError`."""

    def __init__(self, client: ApiClient) -> None:
        self._client = client

    async def get(self, path: str) -> Json | None:
        """The object, or None when it does not exist."""
        try:
            return await self.call("GET", path)
        except ApiError as error:
            if error.status == 404:
                return None
            raise

    async def list(self, path: str, **query: str) -> Json:
        return await self.call("GET", path, query=query)

    async def create(self, path: str, body: Mapping[str, Any]) -> Json:
        return await self.call("POST", path, body=body)

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
        body: Mapping[str, Any] | None = None,
        content_type: str = "application/json",
    ) -> Json:
        response = await self._send(method, path, query=query, body=body, content_type=content_type)
        data = await response.read()
        if not 200 <= response.status < 300:
            raise _error(response.status, data)
        result: Json = json.loads(data) if data else {}
        return result

    async def watch(
        self, path: str, resource_version: str, *, label_selector: str = "", timeout_seconds: int = 300
    ) -> AsyncGenerator[Json, None]:
        """Watch events (``{"type", "object"}``) from ``resource_version`` until the server ends it."""
        selector = {"labelSelector": label_selector} if label_selector else {}
        response = await self._send(
            "GET",
            path,
            query={
                **selector,
                "watch": "true",
                "resourceVersion": resource_version,
                "allowWatchBookmarks": "true",
                "timeoutSeconds": str(timeout_seconds),
            },
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
        body: Mapping[str, Any] | None = None,
        content_type: str = "application/json",
        client_timeout: float | aiohttp.ClientTimeout = _REQUEST_TIMEOUT_S,
    ) -> Any:
        method, url, headers, serialized, _ = await self._client.param_serialize(
            method=method,
            resource_path=path,
            query_params=list((query or {}).items()),
            header_params={"Accept": "application/json", "Content-Type": content_type},
            body=dict(body) if body is not None else None,
            auth_settings=["BearerToken"],
        )
        return await self._client.call_api(
            method, url, header_params=headers, body=serialized, _request_timeout=client_timeout
        )


def _error(status: int, data: bytes) -> ApiError:
    try:
        body = json.loads(data)
    except ValueError:
        return ApiError(status, "", data.decode(errors="replace")[:500])
    if not isinstance(body, dict):
        return ApiError(status, "", str(body)[:500])
    return ApiError(status, str(body.get("reason", "")), str(body.get("message", "")))


async def list_and_watch(
    kube: Kube,
    path: str,
    on_event: Callable[[str, Json], Awaitable[None] | None],
    *,
    resync_seconds: float,
    label_selector: str = "",
    retry_seconds: float = 1.0,
) -> None:
    """Call ``on_event(type, object)`` for every object of ``path``, for ever: like an informer.

    Every ``resync_seconds`` (and after any watch failure) the collection is listed again and each
    object delivered as ``"SYNC"``, so a missed event is repaired within one resync period.
    """
    while True:
        try:
            query = {"labelSelector": label_selector} if label_selector else {}
            listed = await kube.list(path, **query)
            for item in listed.get("items") or []:
                await _deliver(on_event, "SYNC", item)
            version = str(listed["metadata"]["resourceVersion"])
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(resync_seconds):
                    while True:
                        events = kube.watch(path, version, label_selector=label_selector)
                        async with contextlib.aclosing(events):
                            async for event in events:
                                obj = event.get("object") or {}
                                version = obj.get("metadata", {}).get("resourceVersion", version)
                                if event.get("type") != "BOOKMARK":
                                    await _deliver(on_event, str(event.get("type")), obj)
        except asyncio.CancelledError:
            raise
        except Exception as error:  # an outage or an expired version: list afresh after a pause
            if not (isinstance(error, ApiError) and error.status == _GONE):
                log.warning(
                    "watch failed; listing again", path=path, error=str(error) or type(error).__name__
                )
                await asyncio.sleep(retry_seconds)


async def _deliver(on_event: Callable[[str, Json], Awaitable[None] | None], kind: str, obj: Json) -> None:
    result = on_event(kind, obj)
    if result is not None:
        await result
