"""The webhook's view of the driver's GPUs, kept by listing and watching slices and classes."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, cast

import yaml

from dra_driver.apiserver.rest import ApiError, JsonApi
from dra_driver.resources.capacity_fit import OfferIndex
from dra_driver.resources.devices import build_devices, partition_none
from dra_driver.webhook.server import CLASSES, SLICES, watch_offers
from tests.resources.factories import h100, inventory

DRIVER = "gpu.dra-driver.dev"
GPU_CLASS = yaml.safe_load((Path(__file__).parents[2] / "docs/examples/demo/deviceclass.yaml").read_text())
OVER = {"memory": "100Gi"}


def node_slice(name: str) -> dict[str, Any]:
    built = build_devices(inventory(h100(0)), partition=partition_none, consumable=True)
    devices = [device for gpu in built for device in gpu.devices]
    return {"metadata": {"name": name}, "spec": {"driver": DRIVER, "devices": devices}}


class Api:
    """Lists what ``listed`` holds; each watch yields what the test puts in its queue (an
    exception is raised, as the real watch raises a 410)."""

    def __init__(self, listed: dict[str, list[dict[str, Any]]]) -> None:
        self.listed = listed
        self.queries: list[tuple[str, dict[str, str]]] = []
        self.events: dict[str, asyncio.Queue[dict[str, Any] | Exception]] = {
            SLICES: asyncio.Queue(),
            CLASSES: asyncio.Queue(),
        }

    async def list(self, path: str, **query: str) -> dict[str, Any]:
        self.queries.append((path, query))
        return {"metadata": {"resourceVersion": "1"}, "items": copy.deepcopy(self.listed[path])}

    async def watch(self, path: str, version: str, **_selectors: Any) -> AsyncIterator[dict[str, Any]]:
        while True:
            event = await self.events[path].get()
            if isinstance(event, Exception):
                raise event
            yield event


async def until(condition: Callable[[], bool]) -> None:
    """Let the watch task run until ``condition`` holds (it only has queued events to handle)."""
    for _ in range(500):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the webhook's view did not change")


async def test_slices_listed_watched_and_listed_again_decide_what_is_refused() -> None:
    api = Api({SLICES: [node_slice("node-1")], CLASSES: [GPU_CLASS]})
    offers = OfferIndex(DRIVER)

    def refused() -> bool:
        return offers.problem("gpu", "gpu.dra-driver.dev", OVER) is not None

    assert not refused()  # nothing listed yet: nothing judged
    watching = asyncio.create_task(watch_offers(cast(JsonApi, api), offers))
    try:
        await until(refused)
        assert (SLICES, {"fieldSelector": f"spec.driver={DRIVER}"}) in api.queries  # only the driver's

        api.events[SLICES].put_nowait({"type": "DELETED", "object": node_slice("node-1")})
        await until(lambda: not refused())  # the node went: nothing to judge by
        api.events[SLICES].put_nowait({"type": "ADDED", "object": node_slice("node-2")})
        await until(refused)

        # A watch that expired lists afresh; what is gone meanwhile is forgotten.
        api.listed[SLICES] = []
        api.events[SLICES].put_nowait(ApiError(410, "Expired", "too old resource version"))
        await until(lambda: not refused())

        api.listed[SLICES] = [node_slice("node-3")]
        api.events[SLICES].put_nowait(ApiError(410, "Expired", "too old resource version"))
        await until(refused)
        api.events[CLASSES].put_nowait({"type": "DELETED", "object": GPU_CLASS})
        await until(lambda: not refused())  # the class is gone: not the driver's any more
    finally:
        watching.cancel()
        await asyncio.gather(watching, return_exceptions=True)
