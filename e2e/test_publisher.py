"""SlicePublisher against the real kube-apiserver (the `cluster` fixture of e2e/), and offline."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from typing import Any

import pytest
import structlog
from kubernetes.aio.client import ApiClient, Configuration

from dra_driver.resources.devices import build_devices
from dra_driver.resources.publisher import SlicePublisher
from dra_driver.resources.server_rules import ServerRules, rules_for
from dra_driver.resources.slices import SliceContent, split_pool
from dra_driver.resources.wire import DeviceTaint
from tests.background import running
from tests.resources.factories import DRIVER, a100_40gb, h100, inventory, mig_device, with_mig_devices

SLICES = "/apis/resource.k8s.io/v1/resourceslices"
GUARD_S = 60  # against a hang only; nothing here measures time


def aio_client(server: str, token: str, ca_file: str | None) -> ApiClient:
    configuration = Configuration(
        host=server,
        api_key={"BearerToken": token},
        api_key_prefix={"BearerToken": "Bearer"},
        ssl_ca_cert=ca_file,
    )
    return ApiClient(configuration)


def pool(rest: Any, node: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = rest.request(
        "GET", SLICES, query={"fieldSelector": f"spec.nodeName={node},spec.driver={DRIVER}"}
    )["items"]
    # In index order ("-10" after "-9"): the slices are named <driver>-<node>-<index>.
    return sorted(items, key=lambda item: int(str(item["metadata"]["name"]).rsplit("-", 1)[1]))


def layout(cluster: Any) -> ServerRules:
    """The slice layout the test cluster's release accepts (1.34 keeps counters beside devices)."""
    return rules_for(cluster.kube_version)


def partitioned(*minors: int, rules: ServerRules | None = None) -> list[SliceContent]:
    """The slices of partitioned H100s, laid out for ``rules`` (the newest release's by default)."""
    beside = rules is not None and rules.counters_beside_devices
    return split_pool(
        build_devices(inventory(*(h100(minor) for minor in minors))), counters_beside_devices=beside
    )


@pytest.fixture
def node(fake_node: Callable[..., Any]) -> Any:
    return fake_node(f"gpu-node-{uuid.uuid4().hex[:6]}")


@pytest.mark.cluster
async def test_partitioned_gpus_are_stored_exactly_as_published(cluster: Any, rest: Any, node: Any) -> None:
    name, uid = node.metadata.name, node.metadata.uid
    desired = partitioned(0, 1, rules=layout(cluster))
    async with aio_client(cluster.server, cluster.admin_token, str(cluster.ca_file)) as client:
        publisher = SlicePublisher(client, driver=DRIVER, node_name=name, node_uid=uid)
        publisher.set_desired(desired)
        async with running(publisher.run):
            await asyncio.wait_for(publisher.wait_synced(), GUARD_S)
            assert publisher.published_devices == 52

    # Two slices either way: one of counters and one of devices, or on 1.34 one per GPU with both.
    stored = pool(rest, name)
    assert [item["metadata"]["name"] for item in stored] == [f"{DRIVER}-{name}-0", f"{DRIVER}-{name}-1"]
    for item, content in zip(stored, desired, strict=True):
        assert item["spec"].get("sharedCounters", []) == list(content.shared_counters)
        assert item["spec"].get("devices", []) == list(content.devices)
    for item in stored:
        assert item["spec"]["pool"] == {"name": name, "generation": 1, "resourceSliceCount": 2}
        assert item["spec"]["nodeName"] == name
        assert item["metadata"]["ownerReferences"] == [
            {"apiVersion": "v1", "kind": "Node", "name": name, "uid": uid, "controller": True}
        ]


@pytest.mark.cluster
async def test_every_kind_of_device_passes_api_validation_unchanged(
    cluster: Any, rest: Any, node: Any
) -> None:
    name = node.metadata.name
    a100 = a100_40gb(10)
    static = mig_device(a100, "3g.20gb", 4)
    gpus = [*(h100(minor) for minor in range(9)), with_mig_devices(a100, static), a100_40gb(11)]
    taint: DeviceTaint = {"key": f"{DRIVER}/xid", "value": "79", "effect": "NoSchedule"}
    rules = layout(cluster)
    desired = split_pool(
        build_devices(inventory(*gpus), taints={"gpu-3": [taint], "gpu-11": [taint]}),
        counters_beside_devices=rules.counters_beside_devices,
    )
    async with aio_client(cluster.server, cluster.admin_token, str(cluster.ca_file)) as client:
        publisher = SlicePublisher(client, driver=DRIVER, node_name=name, node_uid=node.metadata.uid)
        publisher.set_desired(desired)
        async with running(publisher.run):
            await asyncio.wait_for(publisher.wait_synced(), GUARD_S)

    stored = pool(rest, name)
    # 2 counter slices (10 sets); 9 H100s x 26 devices two to a slice, the A100s join the last one.
    # On 1.34 each of the 11 partitioned GPUs gets one slice with its counter set and its devices.
    assert len(stored) == len(desired) == (11 if rules.counters_beside_devices else 7)
    for item, content in zip(stored, desired, strict=True):
        assert item["spec"].get("sharedCounters", []) == list(content.shared_counters)
        devices = [{k: v for k, v in d.items() if k != "taints"} for d in item["spec"].get("devices", [])]
        assert devices == [{k: v for k, v in d.items() if k != "taints"} for d in content.devices]
        for stored_device, device in zip(item["spec"].get("devices", []), content.devices, strict=True):
            # The server stamps timeAdded on a taint that has none; everything else is kept.
            assert [
                {k: v for k, v in t.items() if k != "timeAdded"} for t in stored_device.get("taints", [])
            ] == (device.get("taints", []))


@pytest.mark.cluster
async def test_slices_deleted_by_the_kubelet_come_back_through_the_watch(
    cluster: Any, rest: Any, node: Any
) -> None:
    name = node.metadata.name
    desired = partitioned(0, rules=layout(cluster))  # 2 slices, or 1 on 1.34
    async with aio_client(cluster.server, cluster.admin_token, str(cluster.ca_file)) as client:
        # No periodic resync within the test: only the watch can notice the deletion.
        publisher = SlicePublisher(
            client, driver=DRIVER, node_name=name, node_uid=node.metadata.uid, resync_period=3600
        )
        publisher.set_desired(desired)
        async with running(publisher.run):
            await asyncio.wait_for(publisher.wait_synced(), GUARD_S)
            for item in pool(rest, name):  # what the kubelet does at its start
                rest.delete(f"{SLICES}/{item['metadata']['name']}")
            for index in range(len(desired)):
                back = await asyncio.to_thread(
                    rest.wait_for,
                    SLICES,
                    f"{DRIVER}-{name}-{index}",
                    lambda item: item["spec"]["pool"]["generation"] == 2,
                    timeout_seconds=GUARD_S,
                )
                assert back["spec"]["pool"]["resourceSliceCount"] == len(desired)


@pytest.mark.cluster
async def test_a_shrinking_node_loses_its_obsolete_slices_at_a_new_generation(
    cluster: Any, rest: Any, node: Any
) -> None:
    name = node.metadata.name
    rules = layout(cluster)
    # Two GPUs stay, so that two slices change (one changed slice alone keeps the generation).
    before, after = partitioned(0, 1, 2, 3, rules=rules), partitioned(0, 1, rules=rules)
    async with aio_client(cluster.server, cluster.admin_token, str(cluster.ca_file)) as client:
        publisher = SlicePublisher(client, driver=DRIVER, node_name=name, node_uid=node.metadata.uid)
        publisher.set_desired(before)
        async with running(publisher.run):
            await asyncio.wait_for(publisher.wait_synced(), GUARD_S)
            # 1 counter slice and 2 of devices; on 1.34 one slice per GPU.
            assert len(pool(rest, name)) == len(before) == (4 if rules.counters_beside_devices else 3)
            publisher.set_desired(after)
            await asyncio.wait_for(publisher.wait_synced(), GUARD_S)
            assert publisher.published_devices == 52

    slices = pool(rest, name)
    assert [item["spec"]["pool"] for item in slices] == [
        {"name": name, "generation": 2, "resourceSliceCount": len(after)}
    ] * len(after)
    expected = [26, 26] if rules.counters_beside_devices else [0, 52]
    assert [len(item["spec"].get("devices", [])) for item in slices] == expected


class LogWaiter:
    """A structlog processor that records events and wakes the test when enough have been seen."""

    def __init__(self, event: str, count: int) -> None:
        self.events: list[str] = []
        self.reached = asyncio.Event()
        self._event = event
        self._count = count

    def __call__(
        self, logger: object, method: str, event_dict: MutableMapping[str, Any]
    ) -> Mapping[str, Any]:
        self.events.append(event_dict["event"])
        if self.events.count(self._event) >= self._count:
            self.reached.set()
        raise structlog.DropEvent


@contextlib.contextmanager
def logging_to(processor: LogWaiter) -> Iterator[None]:
    # In place, like structlog.testing.capture_logs: loggers bound earlier share this very list.
    processors = structlog.get_config()["processors"]
    saved = list(processors)
    processors[:] = [processor]
    try:
        yield
    finally:
        processors[:] = saved


async def test_an_unreachable_api_server_is_retried_and_never_crashes_the_publisher() -> None:
    async with aio_client("https://127.0.0.1:1", "token", None) as client:
        publisher = SlicePublisher(
            client, driver=DRIVER, node_name="node-1", node_uid=None, retry_initial=0.01, retry_cap=0.02
        )
        publisher.set_desired(partitioned(0))
        waiter = LogWaiter("resourceslice sync failed", count=3)
        with logging_to(waiter):
            async with running(publisher.run):
                await asyncio.wait_for(waiter.reached.wait(), GUARD_S)
                assert not publisher.synced
        assert "resourceslice watch failed" in waiter.events
        assert publisher.published_devices == 0
