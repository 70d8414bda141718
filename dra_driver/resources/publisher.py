"""Keeps the node's pool of ResourceSlices on the API server equal to the desired one.

Two loops on the event loop:

* the sync loop lists the pool's slices, lets :func:`~dra_driver.resources.pool.plan_pool`
  decide what to change, and does it; it runs when the desired state changes, when the
  watch reports any change to the pool, and every ``resync_period`` while the watch is not
  following the pool (a safety net for an outage);
* the watch loop follows the pool's slices from the list's resourceVersion, so that slices
  deleted by anyone (the kubelet deletes them at its start and 30 s after the plugin goes
  away) are re-created within a round trip, not at the next resync. An expired
  resourceVersion (410) means: list again and watch from there.

While the watch follows the pool, every change on the server reaches the sync loop as an
event, so a periodic list would only read back what is already known: in steady state the
publisher makes no API request but its watch (at 100 nodes, a list a minute per node would
be 100 requests a minute of ~50 KiB answers for nothing; ``make scale`` measures this).

API errors and outages never end either loop: they are logged and retried with capped
exponential backoff and jitter. Cancelling :meth:`SlicePublisher.run` stops both loops;
what was published stays (the kubelet, not the plugin, cleans a node's slices).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Sequence
from typing import TYPE_CHECKING

import structlog

from dra_driver.apiserver.rest import ApiError
from dra_driver.resources.pool import PoolOwner, dropped_fields, plan_pool
from dra_driver.resources.slice_api import ResourceSliceApi
from dra_driver.resources.slices import SliceContent

if TYPE_CHECKING:  # only for the annotations: dra_driver.apiserver.kube imports the client's machinery
    from kubernetes.aio.client import ApiClient

_log = structlog.get_logger(__name__)

_GONE = 410


class _Backoff:
    """Exponential delays with jitter: ``initial`` doubling up to ``cap``, each drawn from [d/2, d]."""

    def __init__(self, initial: float, cap: float) -> None:
        self._initial = initial
        self._cap = cap
        self._next = initial

    def delay(self) -> float:
        current = self._next
        self._next = min(self._cap, current * 2)
        return random.uniform(current / 2, current)

    def reset(self) -> None:
        self._next = self._initial


class SlicePublisher:
    """Owns the driver's pool for one node: ``pool = node name``, slices ``<driver>-<node>-<i>``."""

    def __init__(
        self,
        client: ApiClient,
        *,
        driver: str,
        node_name: str,
        node_uid: str | None,
        resync_period: float = 60.0,
        watch_timeout_seconds: int = 300,
        retry_initial: float = 0.2,
        retry_cap: float = 10.0,
    ) -> None:
        self._api = ResourceSliceApi(client)
        self._owner = PoolOwner(driver=driver, node_name=node_name, node_uid=node_uid)
        self._resync_period = resync_period
        self._watch_timeout_seconds = watch_timeout_seconds
        self._retry_initial = retry_initial
        self._retry_cap = retry_cap
        self._log = _log.bind(driver=driver, node=node_name)

        self._desired: tuple[SliceContent, ...] | None = None
        self._desired_version = 0
        self._generation = 0  # the highest generation written so far
        self._published_devices = 0
        self._wakeup = asyncio.Event()
        self._synced = asyncio.Event()
        self._published = False
        # Whether the watch follows the pool now: set once a list gave it a resourceVersion to
        # start from, cleared by every failed watch call until one succeeds again. While it is
        # set the periodic resync has nothing to learn and is skipped.
        self._following = False

    @property
    def published_devices(self) -> int:
        """Devices in the pool as last confirmed on the API server (for a metrics gauge)."""
        return self._published_devices

    @property
    def synced(self) -> bool:
        """Whether the latest desired slices are on the API server, as far as the last sync saw."""
        return self._synced.is_set()

    @property
    def published(self) -> bool:
        """Whether desired slices have been on the API server at least once (never false again).

        What readiness rests on: ``synced`` is false from each new desired state (a MIG device made
        at prepare) until it is written, which under a burst of prepares is most of the time.
        """
        return self._published

    def set_desired(self, slices: Sequence[SliceContent]) -> None:
        """Publish ``slices`` (from :func:`~dra_driver.resources.slices.split_pool`) from now on."""
        desired = tuple(slices)
        if desired == self._desired:
            return
        self._desired = desired
        self._desired_version += 1
        self._synced.clear()
        self._wakeup.set()

    async def wait_synced(self) -> None:
        """Return once the latest desired slices are on the API server."""
        await self._synced.wait()

    async def run(self) -> None:
        """Publish until cancelled. Nothing is written before the first :meth:`set_desired`."""
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(self._sync_loop())
            tasks.create_task(self._watch_loop())

    async def _sync_loop(self) -> None:
        backoff = _Backoff(self._retry_initial, self._retry_cap)
        while True:
            self._wakeup.clear()
            try:
                await self._sync()
            except Exception as error:  # an outage or a rejected write: retry, never give up
                delay = backoff.delay()
                self._log.warning(
                    "resourceslice sync failed", error=_describe(error), retry_in_s=round(delay, 2)
                )
                # A new desired state (a taint) is worth a try at once; the backoff still grows.
                await self._woken_or_after(delay)
                continue
            backoff.reset()
            while not await self._woken_or_after(self._resync_period) and self._following:
                pass  # the watch would have reported any change: nothing to list

    async def _woken_or_after(self, seconds: float) -> bool:
        """Wait for a wake-up (new desired state, a watch event) or ``seconds``; whether woken.

        ``asyncio.timeout`` rather than ``wait_for``: on Python 3.11 ``wait_for`` can swallow
        a cancellation that arrives as the event fires, and a shutdown would then hang.
        """
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._wakeup.wait()
                return True
        return False

    async def _sync(self) -> None:
        if self._desired is None:
            return
        desired, version = self._desired, self._desired_version
        live, _ = await self._api.list_slices(self._owner.field_selector)
        plan = plan_pool(desired, live, owner=self._owner, min_generation=self._generation)
        if not plan.in_sync:
            self._synced.clear()
            for ref in plan.delete:
                await self._api.delete(ref.name, ref.uid, ref.resource_version)
            for manifest in plan.apply:
                stored = await self._api.apply(manifest, field_manager=self._owner.driver)
                missing = dropped_fields(manifest["spec"], stored.get("spec") or {})
                if missing:
                    self._log.error(
                        "api server dropped resourceslice fields",
                        slice=manifest["metadata"]["name"],
                        fields=missing[:5],
                        dropped=len(missing),
                        hint="enable the DRAPartitionableDevices / DRADeviceTaints feature gates on the "
                        "API server, or disable MIG partitions and health taints in the driver",
                    )
            self._log.info(
                "resourceslices published",
                generation=plan.generation,
                slices=len(desired),
                written=len(plan.apply),
                deleted=len(plan.delete),
            )
        self._generation = plan.generation
        self._published_devices = sum(len(content.devices) for content in desired)
        self._published = True
        if version == self._desired_version:
            self._synced.set()

    async def _watch_loop(self) -> None:
        backoff = _Backoff(self._retry_initial, self._retry_cap)
        resource_version: str | None = None
        while True:
            try:
                if resource_version is None:
                    self._following = False
                    _, resource_version = await self._api.list_slices(self._owner.field_selector)
                    self._wakeup.set()  # changes between the last watch and this list were missed
                    self._following = True  # from this resourceVersion on, the watch sees everything
                heard = False
                events = self._api.watch(
                    self._owner.field_selector, resource_version, self._watch_timeout_seconds
                )
                async with contextlib.aclosing(events):
                    async for event in events:
                        heard = True
                        self._following = True
                        backoff.reset()
                        resource_version = event["object"]["metadata"].get(
                            "resourceVersion", resource_version
                        )
                        if event["type"] != "BOOKMARK":
                            self._wakeup.set()
                # A watch the server ended (its timeout, or a proxy cutting it short) resumes from
                # the same resourceVersion, which replays whatever happened in between.
                self._following = True
                if not heard:  # but never in a tight loop
                    await asyncio.sleep(backoff.delay())
            except ApiError as error:
                if error.status == _GONE:
                    resource_version = None
                    continue
                await self._after_watch_failure(backoff, error)
            except Exception as error:  # connection lost, server restarting: resume from where we were
                await self._after_watch_failure(backoff, error)

    async def _after_watch_failure(self, backoff: _Backoff, error: Exception) -> None:
        self._following = False  # until a watch call succeeds again, the periodic resync lists
        delay = backoff.delay()
        self._log.warning("resourceslice watch failed", error=_describe(error), retry_in_s=round(delay, 2))
        await asyncio.sleep(delay)


def _describe(error: Exception) -> str:
    # Some errors (a timeout) have no message; their type is the message then.
    return str(error) or type(error).__name__
