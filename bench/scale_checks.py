"""What ``make scale`` judges and counts, apart from running the nodes: pure functions, unit-tested.

* :func:`pool_problems` checks one node's ResourceSlices the way a user (or the scheduler) reads
  them: one complete pool of one generation, on the right node, every device the GPUs call for
  present exactly once, every counter a device consumes defined in the pool.
* :func:`request_counts` and :func:`steady_requests` turn two scrapes of the API server's own
  ``/metrics`` into requests per node per minute, watches excluded, with each request attributed
  to the component that makes it in steady state.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dra_driver.devices.types import Inventory
from dra_driver.resources.device_names import gpu_device_name, maintenance_device_name, mig_device_name

JsonObject = dict[str, Any]
_EXAMPLES = 5  # names shown per kind of problem


def expected_devices(inventory: Inventory, *, mig: bool = True, maintenance: bool = True) -> frozenset[str]:
    """Every device a node with these GPUs publishes: each GPU whole, its maintenance device and, with
    MIG partitions on, each MIG placement of each of its profiles (what ``nvidia-smi mig -lgipp``
    lists). Derived from the hardware, not from the driver's slice code."""
    names: set[str] = set()
    for gpu in inventory.gpus:
        names.add(gpu_device_name(gpu.minor))
        if maintenance:
            names.add(maintenance_device_name(gpu.minor))
        for profile in gpu.mig_profiles if mig else ():
            for placement in profile.placements:
                names.add(mig_device_name(gpu.minor, profile.name, profile.profile_id, placement.start))
    return frozenset(names)


def _some(names: Iterable[str]) -> str:
    ordered = sorted(names)
    shown = ", ".join(ordered[:_EXAMPLES])
    return f"{shown}, ... ({len(ordered)} in all)" if len(ordered) > _EXAMPLES else shown


def pool_problems(
    node: str, slices: Sequence[Mapping[str, Any]], expected: frozenset[str], driver: str
) -> list[str]:
    """What is wrong with the node's published pool, in words; empty when it is valid."""
    if not slices:
        return [f"{node}: no ResourceSlices"]
    problems: list[str] = []
    generations = sorted({item["spec"]["pool"]["generation"] for item in slices})
    if len(generations) > 1:
        problems.append(f"{node}: slices of generations {generations} side by side")
    newest = [item for item in slices if item["spec"]["pool"]["generation"] == generations[-1]]
    counts = {item["spec"]["pool"]["resourceSliceCount"] for item in newest}
    if counts != {len(newest)}:
        problems.append(f"{node}: {len(newest)} slices of the newest generation, resourceSliceCount {counts}")
    for item in slices:
        spec, name = item["spec"], item["metadata"]["name"]
        where = (spec.get("nodeName"), spec.get("driver"), spec["pool"].get("name"))
        if where != (node, driver, node):
            problems.append(f"{node}: slice {name} is for (node, driver, pool) {where}")
    devices = [device for item in newest for device in item["spec"].get("devices") or []]
    names = Counter(device["name"] for device in devices)
    if duplicated := [name for name, count in names.items() if count > 1]:
        problems.append(f"{node}: devices published more than once: {_some(duplicated)}")
    if missing := expected - names.keys():
        problems.append(f"{node}: devices missing: {_some(missing)}")
    if unexpected := names.keys() - expected:
        problems.append(f"{node}: devices no GPU calls for: {_some(unexpected)}")
    counter_sets = {cs["name"] for item in newest for cs in item["spec"].get("sharedCounters") or []}
    undefined = {
        f"{device['name']} -> {consumed['counterSet']}"
        for device in devices
        for consumed in device.get("consumesCounters") or []
        if consumed["counterSet"] not in counter_sets
    }
    if undefined:
        problems.append(f"{node}: devices consume counter sets the pool lacks: {_some(undefined)}")
    return problems


def gpu_uuids(slices: Iterable[Mapping[str, Any]], driver: str) -> list[str]:
    """The UUIDs of the whole GPUs in the slices (no two devices anywhere may name the same GPU)."""
    uuids = []
    for item in slices:
        for device in item["spec"].get("devices") or []:
            attributes = device.get("attributes") or {}
            if attributes.get("type") == {"string": "gpu"} and "uuid" in attributes:
                uuids.append(attributes["uuid"]["string"])
    return uuids


# --- the API server's own request counters -----------------------------------------------------------

RequestKey = tuple[str, str, str]  # verb, resource, subresource
_SAMPLE = re.compile(r"^apiserver_request_total\{(?P<labels>[^}]*)\} (?P<value>\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
_LONG_RUNNING = re.compile(r"^apiserver_longrunning_requests\{(?P<labels>[^}]*)\} (?P<value>\S+)")
_WATCH_VERBS = frozenset({"WATCH", "WATCHLIST"})


def request_counts(metrics_text: str) -> dict[RequestKey, float]:
    """``apiserver_request_total`` summed over codes, scopes and versions, without watches.

    A watch is one request however long it runs; what costs the server per minute are the others.
    """
    counts: dict[RequestKey, float] = {}
    for line in metrics_text.splitlines():
        match = _SAMPLE.match(line)
        if not match:
            continue
        labels = dict(_LABEL.findall(match["labels"]))
        if labels.get("verb") in _WATCH_VERBS:
            continue
        key = (labels.get("verb", ""), labels.get("resource", ""), labels.get("subresource", ""))
        counts[key] = counts.get(key, 0.0) + float(match["value"])
    return counts


def open_watches(metrics_text: str) -> dict[str, float]:
    """Watches open now, by resource (``apiserver_longrunning_requests``, a gauge)."""
    watches: dict[str, float] = {}
    for line in metrics_text.splitlines():
        match = _LONG_RUNNING.match(line)
        if not match:
            continue
        labels = dict(_LABEL.findall(match["labels"]))
        if labels.get("verb") in _WATCH_VERBS:
            resource = labels.get("resource", "")
            watches[resource] = watches.get(resource, 0.0) + float(match["value"])
    return watches


# Who makes a request in steady state: the driver alone writes and lists ResourceSlices and reads
# its claims; the kubelet (the harness) posts the node's status with a GET + PATCH per heartbeat;
# what is not per node (discovery, the API server's own lease, controllers) is the control plane's.
DRIVER = "driver"
KUBELET = "kubelet"
CONTROL_PLANE = "control plane"


def attribute(key: RequestKey) -> str:
    verb, resource, subresource = key
    if resource in ("resourceslices", "resourceclaims"):
        return DRIVER
    if resource == "nodes" and subresource == "status":
        return KUBELET
    if resource == "nodes" and not subresource and verb != "GET":
        return DRIVER  # the node labeller's merge patch
    if resource == "nodes" and verb == "GET":
        return KUBELET  # its heartbeats; a GET beyond one per heartbeat is the driver's (below)
    if resource == "pods":
        return KUBELET
    return CONTROL_PLANE


@dataclass(frozen=True)
class SteadyRequests:
    seconds: float
    nodes: int
    rows: list[JsonObject]  # verb, resource, subresource, requests, per_node_per_min, by
    per_node_per_min: dict[str, float]  # by component, plus "all"

    @property
    def driver_per_node_per_min(self) -> float:
        return self.per_node_per_min[DRIVER]


def steady_requests(
    before: Mapping[RequestKey, float], after: Mapping[RequestKey, float], seconds: float, nodes: int
) -> SteadyRequests:
    """The requests made between two scrapes, per node per minute, by component."""
    minutes_nodes = seconds / 60.0 * nodes
    delta = {key: after[key] - before.get(key, 0.0) for key in after if after[key] > before.get(key, 0.0)}
    by: dict[str, float] = {DRIVER: 0.0, KUBELET: 0.0, CONTROL_PLANE: 0.0}
    rows = []
    for key in sorted(delta):
        component = attribute(key)
        count = delta[key]
        if key == ("GET", "nodes", ""):
            # One GET per heartbeat PATCH is the kubelet's; any further GET of a Node is the driver's.
            heartbeats = delta.get(("PATCH", "nodes", "status"), 0.0)
            beyond = max(0.0, count - heartbeats)
            by[DRIVER] += beyond
            count -= beyond
        by[component] += count
        verb, resource, subresource = key
        rows.append(
            {
                "verb": verb,
                "resource": resource,
                "subresource": subresource,
                "requests": delta[key],
                "per_node_per_min": round(delta[key] / minutes_nodes, 3),
                "by": component,
            }
        )
    per_node = {component: round(total / minutes_nodes, 3) for component, total in by.items()}
    per_node["all"] = round(sum(delta.values()) / minutes_nodes, 3)
    return SteadyRequests(seconds=seconds, nodes=nodes, rows=rows, per_node_per_min=per_node)
