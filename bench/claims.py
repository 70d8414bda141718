"""Allocated ResourceClaims, written straight into the API server as the scheduler would leave them.

The benchmark measures the node, not the scheduler: each claim is created and then given its
``status.allocation`` through the status subresource (one device of our driver in the node's pool,
and the node selector the scheduler sets), so that prepare throughput does not depend on how fast
the scheduler allocates. The API server validates these writes as it validates the scheduler's.
"""

from __future__ import annotations

from collections.abc import Mapping

from dra_driver.node.types import ClaimRef
from e2e.cluster import JsonObject, RestClient

ADMIN_ACCESS_LABEL = "resource.kubernetes.io/admin-access"
_CLAIMS = "/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims"


class AllocatedClaims:
    """Creates namespaces and single-device claims allocated from ``node``'s pool of ``driver``."""

    def __init__(self, rest: RestClient, driver: str, node: str) -> None:
        self._rest = rest
        self._driver = driver
        self._node = node

    def namespace(self, name: str, *, admin_access: bool) -> str:
        """A namespace; admin-access allocations are valid only in one with the admin-access label."""
        labels = {ADMIN_ACCESS_LABEL: "true"} if admin_access else {}
        self._rest.create("/api/v1/namespaces", {"metadata": {"name": name, "labels": labels}})
        return name

    def create(
        self,
        namespace: str,
        name: str,
        device: str,
        *,
        admin_access: bool,
        share_id: str | None = None,
        consumed: Mapping[str, str] | None = None,
        config: JsonObject | None = None,
    ) -> ClaimRef:
        """A claim for one GPU whose allocation is ``device`` (e.g. ``gpu-3``).

        ``share_id`` and ``consumed`` make it a share of the device (consumable capacity: the
        allocation's ``shareID`` and ``consumedCapacity``); ``config`` is an opaque config of the
        driver's (e.g. a ``GpuConfig`` with a sharing strategy), given to the claim's one request.
        """
        request: JsonObject = {"deviceClassName": self._driver}
        result: JsonObject = {"request": "gpu", "driver": self._driver, "pool": self._node, "device": device}
        if admin_access:
            request["adminAccess"] = True
            result["adminAccess"] = True
        if share_id is not None:
            result["shareID"] = share_id
        if consumed is not None:
            result["consumedCapacity"] = dict(consumed)
        allocation: JsonObject = {"devices": {"results": [result]}, "nodeSelector": self._selector()}
        spec: JsonObject = {"devices": {"requests": [{"name": "gpu", "exactly": request}]}}
        if config is not None:
            opaque = {"driver": self._driver, "parameters": config}
            spec["devices"]["config"] = [{"requests": ["gpu"], "opaque": opaque}]
            allocation["devices"]["config"] = [{"source": "FromClaim", "requests": ["gpu"], "opaque": opaque}]
        collection = _CLAIMS.format(namespace=namespace)
        created = self._rest.create(
            collection,
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaim",
                "metadata": {"name": name},
                "spec": spec,
            },
        )
        self._rest.request(
            "PATCH",
            f"{collection}/{name}/status",
            {"status": {"allocation": allocation}},
            content_type="application/merge-patch+json",
        )
        return ClaimRef(namespace=namespace, name=name, uid=created["metadata"]["uid"])

    def _selector(self) -> JsonObject:
        field = {"key": "metadata.name", "operator": "In", "values": [self._node]}
        return {"nodeSelectorTerms": [{"matchFields": [field]}]}
