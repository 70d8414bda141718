"""ResourceSlice calls in plain JSON (:mod:`dra_driver.apiserver.rest`): list, apply, delete, watch."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any

from dra_driver.apiserver.rest import ApiError, JsonApi
from dra_driver.resources.wire import ResourceSlice

if TYPE_CHECKING:  # only for the annotations: dra_driver.apiserver.kube imports the client's machinery
    from kubernetes.aio.client import ApiClient

_COLLECTION = "/apis/resource.k8s.io/v1/resourceslices"


class ResourceSliceApi:
    def __init__(self, client: ApiClient) -> None:
        self._api = JsonApi(client)

    async def list_slices(self, field_selector: str) -> tuple[list[dict[str, Any]], str]:
        """The matching slices and the list's resourceVersion, to start a watch from."""
        body = await self._api.list(_COLLECTION, fieldSelector=field_selector)
        return list(body.get("items") or []), str(body["metadata"]["resourceVersion"])

    async def apply(self, manifest: ResourceSlice, field_manager: str) -> dict[str, Any]:
        """Create or update the slice with server-side apply; returns the stored object."""
        return await self._api.apply(f"{_COLLECTION}/{manifest['metadata']['name']}", manifest, field_manager)

    async def delete(self, name: str, uid: str, resource_version: str) -> None:
        """Delete the slice only if it is still the object we saw; one already gone is fine."""
        options = {
            "apiVersion": "v1",
            "kind": "DeleteOptions",
            "preconditions": {"uid": uid, "resourceVersion": resource_version},
        }
        try:
            await self._api.call("DELETE", f"{_COLLECTION}/{name}", body=options)
        except ApiError as error:
            if error.status != 404:
                raise

    def watch(
        self, field_selector: str, resource_version: str, timeout_seconds: int
    ) -> AsyncGenerator[dict[str, Any], None]:
        """Watch events (``{"type", "object"}``) until the server ends the watch.

        An expired ``resource_version`` raises ApiError 410: list again and watch from there.
        """
        return self._api.watch(
            _COLLECTION, resource_version, field_selector=field_selector, timeout_seconds=timeout_seconds
        )
