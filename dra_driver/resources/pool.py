"""What to write so that the node's pool on the API server becomes the desired one. Pure.

The publisher lists the pool's slices, asks :func:`plan_pool` what to change, and does it.
Keeping the decision here makes the rules testable without a server:

* Slices have deterministic names, ``<driver>-<node>-<index>``, so writing one is idempotent:
  a retried or timed-out create can never leave a duplicate behind, as ``generateName``
  could. They are written with server-side apply, which creates or updates in one call and
  never drops fields that other managers own.
* Whether a live slice is up to date is decided by a fingerprint of what we applied, kept in
  an annotation, not by comparing the stored spec: the server canonicalizes quantities,
  fills in taint timestamps and silently drops fields of disabled features, and a field by
  field comparison would then rewrite the slice forever.
* The generation follows the upstream ResourceSlice controller: it stays when at most one
  existing slice changes and none is added, because consumers see such a change atomically;
  otherwise it goes up, so that consumers ignore the pool until every slice of the new
  generation is there. All slices are rewritten whenever it goes up.
* Slices that are no longer wanted are deleted first (with UID and resourceVersion
  preconditions, so a slice re-created meanwhile is not lost): a device the node no longer
  has must disappear even if publishing the new slices then fails.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dra_driver.resources.slices import SliceContent, slice_spec
from dra_driver.resources.wire import OwnerReference, ResourceSlice, ResourceSliceSpec

API_VERSION = "resource.k8s.io/v1"
NAME_MAX_LENGTH = 253  # object names are DNS subdomains


@dataclass(frozen=True)
class PoolOwner:
    """Who publishes the pool: the driver on one node. The pool is named after the node."""

    driver: str
    node_name: str
    # The Node's UID, for an owner reference that lets the garbage collector delete the
    # slices with the Node. None publishes without one.
    node_uid: str | None = None

    @property
    def fingerprint_annotation(self) -> str:
        return f"{self.driver}/applied-fingerprint"

    @property
    def field_selector(self) -> str:
        return f"spec.nodeName={self.node_name},spec.driver={self.driver}"


@dataclass(frozen=True)
class SliceRef:
    """A live slice to delete, with the preconditions that make the delete safe."""

    name: str
    uid: str
    resource_version: str


@dataclass(frozen=True)
class PoolPlan:
    generation: int
    delete: tuple[SliceRef, ...]  # first
    apply: tuple[ResourceSlice, ...]  # then, each with server-side apply

    @property
    def in_sync(self) -> bool:
        return not self.delete and not self.apply


def slice_name(owner: PoolOwner, index: int) -> str:
    """``<driver>-<node>-<index>``; a digest stands in for a node name too long to fit."""
    name = f"{owner.driver}-{owner.node_name}-{index}"
    if len(name) <= NAME_MAX_LENGTH:
        return name
    digest = hashlib.sha256(owner.node_name.encode()).hexdigest()[:16]
    return f"{owner.driver}-{digest}-{index}"


def plan_pool(
    desired: Sequence[SliceContent],
    live: Sequence[Mapping[str, Any]],
    *,
    owner: PoolOwner,
    min_generation: int = 0,
) -> PoolPlan:
    """The changes that turn ``live`` (the pool's slices as listed) into ``desired``.

    ``min_generation`` is the highest generation this publisher wrote before; the pool never
    goes below it, even when all its slices were deleted meanwhile (the kubelet does that),
    so that a consumer that still sees an old slice never mistakes it for the newest.
    """
    generation = max([min_generation, *(_generation_of(item) for item in live)])
    wanted = [_manifest(owner, index, content, len(desired)) for index, content in enumerate(desired)]
    wanted_names = {manifest["metadata"]["name"] for manifest in wanted}
    live_by_name = {item["metadata"]["name"]: item for item in live}

    obsolete = [item for item in live if _name_of(item) not in wanted_names or not _same_pool(item, owner)]
    obsolete_names = {_name_of(item) for item in obsolete}
    matched = [m for m in wanted if m["metadata"]["name"] in live_by_name.keys() - obsolete_names]
    added = [
        m
        for m in wanted
        if m["metadata"]["name"] not in live_by_name or m["metadata"]["name"] in obsolete_names
    ]
    changed = [
        m for m in matched if not _up_to_date(live_by_name[m["metadata"]["name"]], m, owner, generation)
    ]

    if added or len(changed) > 1:
        generation += 1
        to_write = wanted
    else:
        to_write = changed
    return PoolPlan(
        generation=generation,
        delete=tuple(
            SliceRef(_name_of(item), item["metadata"]["uid"], item["metadata"]["resourceVersion"])
            for item in obsolete
        ),
        apply=tuple(_at_generation(manifest, generation) for manifest in to_write),
    )


def dropped_fields(applied: ResourceSliceSpec, stored: Mapping[str, Any]) -> list[str]:
    """Fields of ``applied`` that the API server did not store.

    A server drops the fields of features that are disabled on it; for counters and taints
    that would silently change what the scheduler may allocate, so the publisher reports it.
    """
    missing = []
    if "sharedCounters" in applied and not stored.get("sharedCounters"):
        missing.append("spec.sharedCounters")
    stored_devices = {device.get("name"): device for device in stored.get("devices") or []}
    for device in applied.get("devices", []):
        stored_device = stored_devices.get(device["name"], {})
        for field in ("consumesCounters", "taints"):
            if field in device and not stored_device.get(field):
                missing.append(f"spec.devices[{device['name']}].{field}")
    return missing


def _manifest(owner: PoolOwner, index: int, content: SliceContent, slice_count: int) -> ResourceSlice:
    """The slice as applied, at generation 0 and with its fingerprint (taken at generation 0)."""
    manifest: ResourceSlice = {
        "apiVersion": API_VERSION,
        "kind": "ResourceSlice",
        "metadata": {"name": slice_name(owner, index), "annotations": {}},
        "spec": slice_spec(
            content, driver=owner.driver, node_name=owner.node_name, generation=0, slice_count=slice_count
        ),
    }
    if owner.node_uid is not None:
        node: OwnerReference = {
            "apiVersion": "v1",
            "kind": "Node",
            "name": owner.node_name,
            "uid": owner.node_uid,
            "controller": True,
        }
        manifest["metadata"]["ownerReferences"] = [node]
    manifest["metadata"]["annotations"] = {owner.fingerprint_annotation: _fingerprint(manifest)}
    return manifest


def _fingerprint(manifest: ResourceSlice) -> str:
    canonical = json.dumps(manifest, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def _at_generation(manifest: ResourceSlice, generation: int) -> ResourceSlice:
    spec = manifest["spec"]
    return {**manifest, "spec": {**spec, "pool": {**spec["pool"], "generation": generation}}}


def _up_to_date(item: Mapping[str, Any], manifest: ResourceSlice, owner: PoolOwner, generation: int) -> bool:
    annotations = item["metadata"].get("annotations") or {}
    return (
        annotations.get(owner.fingerprint_annotation)
        == manifest["metadata"]["annotations"][owner.fingerprint_annotation]
        and _generation_of(item) == generation
    )


def _same_pool(item: Mapping[str, Any], owner: PoolOwner) -> bool:
    # The pool name is immutable: a slice of another pool (an older naming) cannot be
    # updated into ours, only replaced.
    return bool(item["spec"].get("pool", {}).get("name") == owner.node_name)


def _name_of(item: Mapping[str, Any]) -> str:
    return str(item["metadata"]["name"])


def _generation_of(item: Mapping[str, Any]) -> int:
    return int(item["spec"].get("pool", {}).get("generation", 0))
