"""An in-memory API server for the ComputeDomain components' tests: objects by path, a collection
being the path's parent; optimistic concurrency (resourceVersion, 409 on a stale write or on
creating what exists), JSON merge patch, label and driver field selectors."""

from __future__ import annotations

import asyncio
import copy
import itertools
from typing import Any

from dra_driver.apiserver.rest import ApiError


def _matches(obj: dict[str, Any], query: dict[str, str]) -> bool:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    for term in filter(None, query.get("labelSelector", "").split(",")):
        key, _, value = term.partition("=")
        if key not in labels or (value and labels[key] != value):
            return False
    field = query.get("fieldSelector", "")
    if field.startswith("spec.driver="):
        return bool((obj.get("spec") or {}).get("driver") == field.removeprefix("spec.driver="))
    return True


class FakeApi:
    """Objects by path; a collection is the path's parent. Writes bump resourceVersion."""

    def __init__(self) -> None:
        self.objects: dict[str, dict[str, Any]] = {}
        self.as_kubectl: set[str] = set()  # created with the body as kubectl sends it
        self._versions = itertools.count(1)

    def put(self, path: str, obj: dict[str, Any]) -> None:
        obj = copy.deepcopy(obj)
        obj.setdefault("metadata", {})["resourceVersion"] = str(next(self._versions))
        self.objects[path] = obj

    def under(self, collection: str) -> list[dict[str, Any]]:
        """The collection's objects; a namespaced kind's cluster-wide path lists every namespace's."""
        prefix, _, plural = collection.rpartition("/")

        def inside(parent: str) -> bool:
            if parent == collection:
                return True
            head, _, kind = parent.rpartition("/")
            return kind == plural and head.rpartition("/")[0] == f"{prefix}/namespaces"

        return [o for p, o in self.objects.items() if inside(p.rsplit("/", 1)[0])]

    async def get(self, path: str) -> dict[str, Any] | None:
        await asyncio.sleep(0)
        return copy.deepcopy(self.objects.get(path.removesuffix("/status")))

    async def list(self, path: str, **query: str) -> dict[str, Any]:
        items = [copy.deepcopy(o) for o in self.under(path) if _matches(o, query)]
        return {"metadata": {"resourceVersion": "1"}, "items": items}

    async def create(self, collection: str, body: dict[str, Any]) -> dict[str, Any]:
        meta = body["metadata"]
        path = f"{collection}/{meta.get('name') or meta['generateName'] + str(next(self._versions))}"
        if path in self.objects:
            raise ApiError(409, "AlreadyExists", path)
        self.put(path, body)
        return copy.deepcopy(self.objects[path])

    async def create_as_kubectl(self, collection: str, body: dict[str, Any]) -> dict[str, Any]:
        created = await self.create(collection, body)
        self.as_kubectl.add(f"{collection}/{body['metadata']['name']}")
        return created

    async def merge_patch(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        target = path.removesuffix("/status")
        obj = self.objects[target]
        version = (body.get("metadata") or {}).get("resourceVersion")
        if version and version != obj["metadata"]["resourceVersion"]:
            raise ApiError(409, "Conflict", target)
        merged = _merge(copy.deepcopy(obj), body)
        self.put(target, merged)
        return copy.deepcopy(self.objects[target])

    async def replace(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        target = path.removesuffix("/status")
        if body["metadata"].get("resourceVersion") != self.objects[target]["metadata"]["resourceVersion"]:
            raise ApiError(409, "Conflict", target)
        self.put(target, body)
        return copy.deepcopy(self.objects[target])

    async def delete(self, path: str) -> None:
        self.objects.pop(path, None)


def _merge(obj: Any, patch: Any) -> Any:
    if not isinstance(patch, dict) or not isinstance(obj, dict):
        return patch
    for key, value in patch.items():
        if value is None:
            obj.pop(key, None)
        else:
            obj[key] = _merge(obj.get(key), value)
    return obj
