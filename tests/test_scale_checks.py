"""``make scale``'s own judgement (bench/scale_checks.py): when a node's pool counts as valid, and how the
API server's request counters become requests per node per minute."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from bench.scale_checks import (
    CONTROL_PLANE,
    DRIVER,
    KUBELET,
    expected_devices,
    gpu_uuids,
    open_watches,
    pool_problems,
    request_counts,
    steady_requests,
)
from dra_driver.gpu_plugin.policies import desired_slices
from dra_driver.resources.pool import PoolOwner, plan_pool
from dra_driver.settings import DEFAULT_DRIVER_NAME, Settings
from dra_driver.simulated.gpus import SimulatedBackend

NODE = "scale-000"


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], frozenset[str]]:
    """What the daemon publishes for a simulated DGX H100 (MIG partitions on), and what its GPUs call for."""
    backend = SimulatedBackend("dgx-h100", NODE, Path(tmp_path_factory.mktemp("gpus")))
    try:
        inventory = backend.inventory()
    finally:
        backend.close()
    settings = Settings(node_name=NODE)
    owner = PoolOwner(driver=DEFAULT_DRIVER_NAME, node_name=NODE)
    slices = [dict(item) for item in plan_pool(desired_slices(settings, inventory), [], owner=owner).apply]
    return copy.deepcopy(slices), expected_devices(inventory)


def problems(slices: list[dict[str, Any]], expected: frozenset[str]) -> list[str]:
    return pool_problems(NODE, slices, expected, DEFAULT_DRIVER_NAME)


def test_a_dgx_h100_calls_for_every_gpu_its_mig_placements_and_its_maintenance_device(
    published: tuple[list[dict[str, Any]], frozenset[str]],
) -> None:
    _, expected = published
    assert len(expected) == 8 * (1 + 25 + 1)
    assert {
        "gpu-0",
        "gpu-7",
        "gpu-7-maintenance",
        "gpu-3-mig-7g80gb-0-0",
        "gpu-3-mig-1g10gb-19-6",
    } <= expected


def test_without_mig_partitions_a_dgx_h100_calls_for_its_gpus_and_maintenance_devices(tmp_path: Path) -> None:
    backend = SimulatedBackend("dgx-h100", NODE, tmp_path)
    try:
        expected = expected_devices(backend.inventory(), mig=False)
    finally:
        backend.close()
    assert expected == {f"gpu-{i}" for i in range(8)} | {f"gpu-{i}-maintenance" for i in range(8)}


def test_the_daemons_pool_is_valid(published: tuple[list[dict[str, Any]], frozenset[str]]) -> None:
    slices, expected = published
    assert problems(slices, expected) == []
    assert len(set(gpu_uuids(slices, DEFAULT_DRIVER_NAME))) == 8


def test_a_missing_slice_is_an_incomplete_pool_and_lacks_devices(
    published: tuple[list[dict[str, Any]], frozenset[str]],
) -> None:
    slices, expected = copy.deepcopy(published)
    found = problems(slices[:-1], expected)
    assert found[0] == f"{NODE}: 4 slices of the newest generation, resourceSliceCount {{5}}"
    assert found[1].startswith(f"{NODE}: devices missing: ")


def test_a_missing_mig_placement_is_named(published: tuple[list[dict[str, Any]], frozenset[str]]) -> None:
    slices, expected = copy.deepcopy(published)
    for item in slices:
        devices = item["spec"].get("devices") or []
        item["spec"]["devices"] = [d for d in devices if d["name"] != "gpu-2-mig-3g40gb-9-4"]
    assert problems(slices, expected) == [f"{NODE}: devices missing: gpu-2-mig-3g40gb-9-4"]


def test_two_generations_side_by_side_are_not_a_valid_pool(
    published: tuple[list[dict[str, Any]], frozenset[str]],
) -> None:
    slices, expected = copy.deepcopy(published)
    slices[0]["spec"]["pool"]["generation"] = 2
    found = problems(slices, expected)
    assert found[0] == f"{NODE}: slices of generations [1, 2] side by side"


def test_a_device_twice_a_stranger_and_a_slice_of_another_node_are_each_reported(
    published: tuple[list[dict[str, Any]], frozenset[str]],
) -> None:
    slices, expected = copy.deepcopy(published)
    devices = slices[-1]["spec"]["devices"]
    devices.append(copy.deepcopy(devices[0]))
    devices.append({"name": "gpu-9"})
    slices[1]["spec"]["nodeName"] = "elsewhere"
    found = problems(slices, expected)
    assert f"{NODE}: devices published more than once: {devices[0]['name']}" in found
    assert f"{NODE}: devices no GPU calls for: gpu-9" in found
    assert any("is for (node, driver, pool) ('elsewhere'" in problem for problem in found)


def test_a_device_consuming_an_undefined_counter_set_is_reported(
    published: tuple[list[dict[str, Any]], frozenset[str]],
) -> None:
    slices, expected = copy.deepcopy(published)
    (counters,) = [item for item in slices if item["spec"].get("sharedCounters")]
    counters["spec"]["sharedCounters"] = [
        cs for cs in counters["spec"]["sharedCounters"] if cs["name"] != "gpu-5-counter-set"
    ]
    (found,) = problems(slices, expected)
    assert found.startswith(
        f"{NODE}: devices consume counter sets the pool lacks: gpu-5 -> gpu-5-counter-set"
    )


def test_no_slices_at_all() -> None:
    assert pool_problems(NODE, [], frozenset({"gpu-0"}), DEFAULT_DRIVER_NAME) == [
        f"{NODE}: no ResourceSlices"
    ]


METRICS_BEFORE = """\
# HELP apiserver_request_total [STABLE] Counter of apiserver requests
# TYPE apiserver_request_total counter
apiserver_request_total{code="200",component="apiserver",dry_run="",group="resource.k8s.io",resource="resourceslices",scope="cluster",subresource="",verb="LIST",version="v1"} 10
apiserver_request_total{code="200",component="apiserver",dry_run="",group="resource.k8s.io",resource="resourceslices",scope="cluster",subresource="",verb="WATCH",version="v1"} 4
apiserver_request_total{code="200",component="apiserver",dry_run="",group="",resource="nodes",scope="resource",subresource="",verb="GET",version="v1"} 100
apiserver_request_total{code="200",component="apiserver",dry_run="",group="",resource="nodes",scope="resource",subresource="status",verb="PATCH",version="v1"} 100
apiserver_request_total{code="200",component="apiserver",dry_run="",group="coordination.k8s.io",resource="leases",scope="namespace",subresource="",verb="PUT",version="v1"} 7
apiserver_longrunning_requests{component="apiserver",group="resource.k8s.io",resource="resourceslices",scope="cluster",subresource="",verb="WATCH",version="v1"} 3
"""  # noqa: E501


def after(**increments: float) -> str:
    """METRICS_BEFORE with the counters of the named rows (first word of the key) raised."""
    lines = []
    for line in METRICS_BEFORE.splitlines():
        for row, extra in increments.items():
            verb, resource, subresource = row.split("_")
            if (
                f'resource="{resource}"' in line
                and f'subresource="{subresource}"' in line
                and f'verb="{verb}"' in line
            ):
                name, value = line.rsplit(" ", 1)
                line = f"{name} {float(value) + extra}"
        lines.append(line)
    return "\n".join(lines)


def test_watches_are_not_counted_as_requests() -> None:
    counts = request_counts(METRICS_BEFORE)
    assert counts[("LIST", "resourceslices", "")] == 10
    assert ("WATCH", "resourceslices", "") not in counts
    assert open_watches(METRICS_BEFORE) == {"resourceslices": 3}


def test_heartbeats_are_the_kubelets_and_the_lists_of_slices_the_drivers() -> None:
    before = request_counts(METRICS_BEFORE)
    # Two minutes, 2 nodes: each node's kubelet beat 12 times (GET + PATCH), each driver listed 2 times.
    later = request_counts(
        after(
            GET_nodes_=24,
            PATCH_nodes_status=24,
            LIST_resourceslices_=4,
            WATCH_resourceslices_=9,
            PUT_leases_=12,
        )
    )
    steady = steady_requests(before, later, seconds=120, nodes=2)
    assert steady.per_node_per_min == {DRIVER: 1.0, KUBELET: 12.0, CONTROL_PLANE: 3.0, "all": 16.0}
    assert steady.driver_per_node_per_min == 1.0
    rows = {(row["verb"], row["resource"], row["subresource"]): row for row in steady.rows}
    assert rows["LIST", "resourceslices", ""]["by"] == DRIVER
    assert rows["LIST", "resourceslices", ""]["requests"] == 4


def test_a_get_of_the_node_beyond_the_heartbeats_is_the_drivers() -> None:
    before = request_counts(METRICS_BEFORE)
    later = request_counts(after(GET_nodes_=26, PATCH_nodes_status=24))
    steady = steady_requests(before, later, seconds=60, nodes=2)
    assert steady.per_node_per_min[DRIVER] == 1.0
    assert steady.per_node_per_min[KUBELET] == 24.0


def test_nothing_but_watches_is_zero_requests() -> None:
    before = request_counts(METRICS_BEFORE)
    steady = steady_requests(before, request_counts(after(WATCH_resourceslices_=50)), seconds=60, nodes=100)
    assert steady.per_node_per_min == {DRIVER: 0.0, KUBELET: 0.0, CONTROL_PLANE: 0.0, "all": 0.0}
    assert steady.rows == []
