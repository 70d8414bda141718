"""What the daemon follows while it serves: the GPUs, their health, and the claims' binding conditions.

Each watch keeps the latest state and hands a change on through a callback given by the wiring
(:mod:`.app`); none of them publishes or prepares anything itself.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog

from dra_driver.apiserver.informer import list_and_watch
from dra_driver.apiserver.rest import JsonApi
from dra_driver.devices.backend import Backend
from dra_driver.devices.faults import NodeFaults
from dra_driver.devices.health import HealthSource
from dra_driver.devices.types import Inventory
from dra_driver.gpu_plugin.policies import binding_conditions_on
from dra_driver.node.binding import CLAIMS_PATH, RESYNC_S, BindingWatcher
from dra_driver.node.claim_status import ApiServerClaimStatus
from dra_driver.node.preparer import NodePreparer
from dra_driver.resources.server_rules import ServerRules
from dra_driver.resources.taints import TaintPolicy, faults_to_taint, unknown_gpus
from dra_driver.settings import Settings

if TYPE_CHECKING:  # only for the annotations: dra_driver.apiserver.kube imports the client's machinery
    from kubernetes.aio.client import ApiClient

    from dra_driver.computedomain.plugin import ComputeDomainPlugin


log = structlog.get_logger(__name__)


class InventoryWatch:
    """The current inventory: re-read periodically, and replaced at once when MIG devices change."""

    def __init__(
        self, backend: Backend, first: Inventory, on_change: Callable[[Inventory], None], period: float
    ) -> None:
        self._backend = backend
        self.current = first
        self._on_change = on_change
        self._period = period
        self._version = 0  # counts deliveries, so a read overtaken by a newer one is dropped

    def deliver(self, latest: Inventory) -> None:
        """Take ``latest`` (read by whoever changed the GPUs) and republish."""
        self._version += 1
        self.current = latest
        self._on_change(latest)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self._period)
            started_at = self._version
            try:
                latest = await asyncio.to_thread(self._backend.inventory)
            except Exception as err:  # a transient hardware read error must not kill the daemon
                log.warning("re-reading GPUs failed; keeping the last inventory", error=str(err))
                continue
            if self._version != started_at:
                continue  # a MIG change delivered a newer inventory while this read ran
            if latest != self.current:
                log.info("GPU inventory changed; republishing", gpus=len(latest.gpus))
                self.deliver(latest)


class HealthWatch:
    """Follows the GPUs' faults and hands them on: taints in the slices, health to the kubelet.

    Changes are coalesced: the first one is applied at once, later ones at most every
    ``min_interval`` seconds, each time the latest state. A flood of Xid events thus costs a
    few republishes, not one API write per event, and nothing is lost: the publisher retries
    the latest desired slices until the API server has them.
    """

    def __init__(
        self,
        source: HealthSource,
        policy: TaintPolicy,
        inventory: Callable[[], Inventory],
        on_change: Callable[[], None],
        min_interval: float = 0.2,
    ) -> None:
        self.faults: NodeFaults = {}  # what is wrong now
        self.tainted: NodeFaults = {}  # what the published taints are for
        self._updates = source.watch()
        self._policy = policy
        self._inventory = inventory
        self._on_change = on_change
        self._min_interval = min_interval
        self._warned_unknown: set[str] = set()

    async def start(self) -> None:
        """Take the first report, so that the first slices published carry the taints already."""
        self._apply(await anext(self._updates))

    async def run(self) -> None:
        latest: NodeFaults | None = None
        arrived = asyncio.Event()

        async def follow() -> None:
            nonlocal latest
            async for faults in self._updates:
                latest = faults
                arrived.set()

        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(follow())
            while True:
                await arrived.wait()
                arrived.clear()
                if latest is not None:
                    self._apply(latest)
                await asyncio.sleep(self._min_interval)  # a rate limit, not a synchronisation

    def _apply(self, faults: NodeFaults) -> None:
        if faults == self.faults:
            return
        for uuid in sorted({*faults, *self.faults}):
            if faults.get(uuid) == self.faults.get(uuid):
                continue
            if uuid in faults:
                log.warning("GPU unhealthy", gpu=uuid, faults=[fault.describe() for fault in faults[uuid]])
            else:
                log.info("GPU healthy again", gpu=uuid)
        unknown = set(unknown_gpus(self._inventory(), faults)) - self._warned_unknown
        if unknown:
            log.warning("faults reported for GPUs the node does not have; ignored", gpus=sorted(unknown))
            self._warned_unknown |= unknown
        self.faults = faults
        self.tainted = faults_to_taint(self.tainted, faults, self._policy)
        self._on_change()


@dataclass(frozen=True)
class BindingWatch:
    """The watch of the claims allocated from the node's pools, for their binding conditions: one
    watch of the claims, fed to a watcher per driver (the GPUs', and the ComputeDomain channel's)."""

    watchers: tuple[BindingWatcher, ...]
    api: JsonApi

    async def run(self) -> None:
        await list_and_watch(
            self.api,
            CLAIMS_PATH,
            self._on_event,
            resync_seconds=RESYNC_S,
            on_listed=self._on_listed,
            retry_seconds=5.0,  # a refusal (a chart without list on claims) logs every 5 s, not every 1 s
        )

    async def _on_event(self, kind: str, claim: Mapping[str, Any]) -> None:
        for watcher in self.watchers:
            await watcher.on_event(kind, claim)

    def _on_listed(self, claims: list[dict[str, Any]]) -> None:
        for watcher in self.watchers:
            watcher.on_listed(claims)

    async def stop(self) -> None:
        for watcher in self.watchers:
            await watcher.stop()


def binding_watch(
    settings: Settings,
    rules: ServerRules,
    api: ApiClient,
    preparer: NodePreparer,
    compute_domains: ComputeDomainPlugin | None = None,
) -> BindingWatch | None:
    """The binding conditions' watch when the placements carry them (:mod:`dra_driver.node.binding`);
    ``compute_domains``, started, when its channel carries them too."""
    if not binding_conditions_on(settings, rules):
        return None
    status = ApiServerClaimStatus(api)
    watchers = [BindingWatcher(preparer, status, driver_name=settings.driver_name, pool=settings.node_name)]
    if compute_domains is not None and compute_domains.binding_conditions and compute_domains.preparer:
        watchers.append(
            BindingWatcher(
                compute_domains.preparer,
                status,
                driver_name=compute_domains.names.driver,
                pool=settings.node_name,
            )
        )
    return BindingWatch(tuple(watchers), JsonApi(api))
