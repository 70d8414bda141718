"""Which API requests the slice publisher makes, against an in-memory API server.

In steady state the publisher must cost the API server nothing but its watch: with a hundred nodes,
one list a minute per node is a hundred requests a minute that can learn nothing the watch has not
already said. The periodic resync is a safety net for when the watch is down, and only then lists.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import AsyncGenerator
from typing import Any

from dra_driver.apiserver.rest import ApiError
from dra_driver.resources.devices import build_devices
from dra_driver.resources.publisher import SlicePublisher
from dra_driver.resources.slices import split_pool
from dra_driver.resources.wire import ResourceSlice
from tests.background import running
from tests.resources.factories import DRIVER, NODE, h100, inventory

GUARD_S = 30  # against a hang only; nothing here measures time
RESYNC_S = 0.02


class FakeSliceApi:
    """ResourceSliceApi on a dict: counts lists, and serves a watch the test feeds or breaks."""

    def __init__(self) -> None:
        self.stored: dict[str, dict[str, Any]] = {}
        self.lists = 0
        self.watch_error: Exception | None = None
        self.watch_events: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.called = asyncio.Event()  # set by every list and write
        self._version = 0

    async def until(self, condition: Any) -> None:
        """Until ``condition()`` holds, checked after every request."""
        async with asyncio.timeout(GUARD_S):
            while not condition():
                self.called.clear()
                await self.called.wait()

    async def list_slices(self, field_selector: str) -> tuple[list[dict[str, Any]], str]:
        self.lists += 1
        self.called.set()
        return [copy.deepcopy(item) for item in self.stored.values()], str(self._version)

    async def apply(self, manifest: ResourceSlice, field_manager: str) -> dict[str, Any]:
        self._version += 1
        stored: dict[str, Any] = copy.deepcopy(dict(manifest))
        name = stored["metadata"]["name"]
        stored["metadata"] |= {"uid": f"uid-{name}", "resourceVersion": str(self._version)}
        self.stored[name] = stored
        self.called.set()
        return copy.deepcopy(stored)

    async def delete(self, name: str, uid: str, resource_version: str) -> None:
        self.stored.pop(name, None)

    async def watch(
        self, field_selector: str, resource_version: str, timeout_seconds: int
    ) -> AsyncGenerator[dict[str, Any], None]:
        if self.watch_error is not None:
            raise self.watch_error
        while True:
            yield await self.watch_events.get()


def publisher_on(api: FakeSliceApi) -> SlicePublisher:
    publisher = SlicePublisher(
        None,  # type: ignore[arg-type]  # every call goes to the fake below
        driver=DRIVER,
        node_name=NODE,
        node_uid=None,
        resync_period=RESYNC_S,
        retry_initial=0.01,
        retry_cap=0.02,
    )
    publisher._api = api  # type: ignore[assignment]
    publisher.set_desired(split_pool(build_devices(inventory(h100(0)))))
    return publisher


async def test_a_published_pool_costs_no_request_while_the_watch_follows_it() -> None:
    api = FakeSliceApi()
    publisher = publisher_on(api)
    async with running(publisher.run):
        await asyncio.wait_for(publisher.wait_synced(), GUARD_S)
        await api.until(lambda: api.lists >= 2)  # the sync's list and the watch's list to start from
        await asyncio.sleep(RESYNC_S)  # the watch's list may wake the sync loop once more
        settled = api.lists
        await asyncio.sleep(25 * RESYNC_S)  # 25 resync periods: each would have listed before
        assert api.lists == settled
        assert publisher.synced


async def test_a_change_the_watch_reports_is_listed_and_repaired() -> None:
    api = FakeSliceApi()
    publisher = publisher_on(api)
    async with running(publisher.run):
        await asyncio.wait_for(publisher.wait_synced(), GUARD_S)
        await api.until(lambda: api.lists >= 2)
        (name,) = [name for name in api.stored if name.endswith("-1")]
        deleted = api.stored.pop(name)  # what the kubelet does at its start
        await api.watch_events.put({"type": "DELETED", "object": deleted})
        await api.until(lambda: name in api.stored)


async def test_while_the_watch_fails_the_resync_lists_the_pool_every_period() -> None:
    api = FakeSliceApi()
    api.watch_error = ApiError(500, "InternalError", "etcd is down")
    publisher = publisher_on(api)
    async with running(publisher.run):
        await asyncio.wait_for(publisher.wait_synced(), GUARD_S)
        listed = api.lists
        await api.until(lambda: api.lists >= listed + 5)


async def test_a_new_desired_state_after_the_first_publish_keeps_the_pool_published() -> None:
    # Readiness rests on `published`: a plugin preparing a burst of MIG claims changes its slices
    # at every prepare, and its pod must not turn NotReady for it (a DaemonSet rollout replaces a
    # NotReady plugin pod at once, and the node is then without one; seen on the real node).
    api = FakeSliceApi()
    publisher = publisher_on(api)
    assert not publisher.published
    async with running(publisher.run):
        await asyncio.wait_for(publisher.wait_synced(), GUARD_S)
        assert publisher.published
        publisher.set_desired(split_pool(build_devices(inventory(h100(0), h100(1)))))
        assert (publisher.synced, publisher.published) == (False, True)
        await asyncio.wait_for(publisher.wait_synced(), GUARD_S)
