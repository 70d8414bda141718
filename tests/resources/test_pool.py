from __future__ import annotations

import copy
from typing import Any

from dra_driver.resources.devices import build_devices, partition_none
from dra_driver.resources.pool import PoolOwner, SliceRef, dropped_fields, plan_pool, slice_name
from dra_driver.resources.slices import SliceContent, split_pool
from dra_driver.resources.wire import ResourceSlice

from .factories import DRIVER, NODE, h100, inventory

OWNER = PoolOwner(driver=DRIVER, node_name=NODE, node_uid="9e3c2b1a-0000-4000-8000-000000000001")


def pool_of(*minors: int, partitioned: bool = True) -> list[SliceContent]:
    gpus = inventory(*(h100(minor) for minor in minors))
    return split_pool(build_devices(gpus) if partitioned else build_devices(gpus, partition=partition_none))


def stored(manifests: tuple[ResourceSlice, ...], start: int = 0) -> list[dict[str, Any]]:
    """What listing returns after the manifests were applied: the same plus server metadata."""
    items = []
    for i, manifest in enumerate(manifests, start):
        item: dict[str, Any] = copy.deepcopy(dict(manifest))
        item["metadata"] |= {"uid": f"uid-{i}", "resourceVersion": str(100 + i), "managedFields": []}
        items.append(item)
    return items


def published(desired: list[SliceContent]) -> list[dict[str, Any]]:
    return stored(plan_pool(desired, [], owner=OWNER).apply)


def test_a_new_pool_is_created_at_generation_one() -> None:
    plan = plan_pool(pool_of(0, 1, 2), [], owner=OWNER)
    assert plan.generation == 1
    assert plan.delete == ()
    assert [m["metadata"]["name"] for m in plan.apply] == [
        f"{DRIVER}-{NODE}-0",
        f"{DRIVER}-{NODE}-1",
        f"{DRIVER}-{NODE}-2",
    ]
    for manifest in plan.apply:
        assert manifest["apiVersion"] == "resource.k8s.io/v1"
        assert manifest["kind"] == "ResourceSlice"
        assert manifest["spec"]["pool"] == {"name": NODE, "generation": 1, "resourceSliceCount": 3}
        assert manifest["metadata"]["ownerReferences"] == [
            {"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": OWNER.node_uid, "controller": True}
        ]


def test_without_a_node_uid_there_is_no_owner_reference() -> None:
    plan = plan_pool(pool_of(0), [], owner=PoolOwner(driver=DRIVER, node_name=NODE))
    assert all("ownerReferences" not in m["metadata"] for m in plan.apply)


def test_a_published_pool_is_in_sync_even_where_the_server_rewrote_values() -> None:
    desired = pool_of(0, 1)
    live = published(desired)
    # The server canonicalizes quantities and adds fields of its own; neither is a change.
    live[1]["spec"]["devices"][0]["capacity"]["memory"]["value"] = "81559Mi"
    live[1]["spec"]["devices"][0]["allowMultipleAllocations"] = False
    plan = plan_pool(desired, live, owner=OWNER)
    assert plan.in_sync
    assert plan.generation == 1


def test_one_changed_slice_is_updated_alone_at_the_same_generation() -> None:
    node = inventory(*(h100(minor) for minor in range(4)))  # a counter slice + two device slices
    live = published(split_pool(build_devices(node)))
    tainted = build_devices(
        node, taints={"gpu-3": [{"key": f"{DRIVER}/xid", "value": "79", "effect": "NoExecute"}]}
    )
    plan = plan_pool(split_pool(tainted), live, owner=OWNER)
    assert plan.generation == 1
    assert [m["metadata"]["name"] for m in plan.apply] == [f"{DRIVER}-{NODE}-2"]
    assert plan.delete == ()


def test_two_changed_slices_bump_the_generation_and_rewrite_every_slice() -> None:
    live = published(pool_of(0, 1, 2, 3))  # a counter slice + two device slices
    plan = plan_pool(pool_of(0, 1, 2, 4), live, owner=OWNER)  # counters and the second device slice change
    assert plan.generation == 2
    assert len(plan.apply) == 3
    assert {m["spec"]["pool"]["generation"] for m in plan.apply} == {2}


def test_an_added_slice_bumps_the_generation() -> None:
    live = published(pool_of(0, 1))
    plan = plan_pool(pool_of(0, 1, 2), live, owner=OWNER)
    assert plan.generation == 2
    assert [m["spec"]["pool"]["resourceSliceCount"] for m in plan.apply] == [3, 3, 3]


def test_an_obsolete_slice_is_deleted_first_with_preconditions() -> None:
    live = published(pool_of(0, 1, 2, 3))
    plan = plan_pool(pool_of(0, 1), live, owner=OWNER)
    assert plan.delete == (SliceRef(f"{DRIVER}-{NODE}-2", "uid-2", "102"),)
    assert [m["spec"]["pool"]["resourceSliceCount"] for m in plan.apply] == [2, 2]
    assert plan.generation == 2


def test_after_the_kubelet_wiped_the_pool_it_comes_back_at_a_higher_generation() -> None:
    plan = plan_pool(pool_of(0), [], owner=OWNER, min_generation=5)
    assert plan.generation == 6
    assert len(plan.apply) == 2


def test_a_slice_left_at_an_older_generation_is_rewritten() -> None:
    desired = pool_of(0, 1, 2)
    live = published(desired)
    live[1]["spec"]["pool"]["generation"] = 0
    plan = plan_pool(desired, live, owner=OWNER)
    assert plan.generation == 1
    assert [m["metadata"]["name"] for m in plan.apply] == [f"{DRIVER}-{NODE}-1"]


def test_a_slice_of_another_pool_or_naming_scheme_is_replaced() -> None:
    desired = pool_of(0)
    live = published(desired)
    live[0]["spec"]["pool"]["name"] = "old-pool-name"  # immutable: cannot be updated into ours
    stranger = copy.deepcopy(live[1])
    stranger["metadata"] |= {"name": f"00000-{DRIVER}-{NODE}-x7k2p", "uid": "uid-9", "resourceVersion": "9"}
    plan = plan_pool(desired, [*live, stranger], owner=OWNER)
    assert {ref.name for ref in plan.delete} == {f"{DRIVER}-{NODE}-0", f"00000-{DRIVER}-{NODE}-x7k2p"}
    assert [m["metadata"]["name"] for m in plan.apply] == [f"{DRIVER}-{NODE}-0", f"{DRIVER}-{NODE}-1"]
    assert plan.generation == 2


def test_a_different_owner_uid_is_a_change() -> None:
    desired = pool_of(0, partitioned=False)
    live = published(desired)
    plan = plan_pool(desired, live, owner=PoolOwner(driver=DRIVER, node_name=NODE, node_uid="new-uid"))
    assert [m["metadata"]["ownerReferences"][0]["uid"] for m in plan.apply] == ["new-uid"]


def test_slice_names_stay_valid_for_the_longest_node_names() -> None:
    long_node = "n" * 60 + "." + "o" * 60 + "." + "d" * 60 + "." + "e" * 60
    owner = PoolOwner(driver=DRIVER, node_name=long_node)
    names = {slice_name(owner, i) for i in range(3)}
    assert len(names) == 3
    assert all(len(name) <= 253 for name in names)
    assert slice_name(owner, 0) != slice_name(PoolOwner(driver=DRIVER, node_name=long_node + "x"), 0)


def test_fields_the_server_dropped_are_reported() -> None:
    [counters, devices] = plan_pool(pool_of(0), [], owner=OWNER).apply
    assert dropped_fields(counters["spec"], {**counters["spec"], "sharedCounters": None}) == [
        "spec.sharedCounters"
    ]
    stripped = copy.deepcopy(devices["spec"])
    for device in stripped["devices"][:2]:
        del device["consumesCounters"]
    assert dropped_fields(devices["spec"], stripped) == [
        "spec.devices[gpu-0].consumesCounters",
        "spec.devices[gpu-0-mig-1g10gb-19-0].consumesCounters",
    ]
    assert dropped_fields(devices["spec"], devices["spec"]) == []
