"""The compute-domain driver inside the node daemon: a second kubelet plugin next to the GPU one.

It shares the process, the API client and the kubelet plumbing (registration, DRA v1/v1beta1, the
slice publisher) with the GPU driver and has its own name, sockets, pool and CDI specs. It starts
only on a node whose GPUs are all on one NVLink clique; elsewhere it says why and stays away, so
the scheduler never offers such a node to a ComputeDomain.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import structlog

from dra_driver.apiserver.kube import ApiClient
from dra_driver.apiserver.rest import JsonApi
from dra_driver.cdi.store import SpecStore
from dra_driver.computedomain.api import (
    PLURAL,
    ComputeDomain,
    InvalidComputeDomain,
    Names,
    parse_compute_domain,
)
from dra_driver.computedomain.node import ComputeDomainPreparer, compute_domain_slices
from dra_driver.devices.fabric import node_clique
from dra_driver.devices.host_imex import HostImex
from dra_driver.devices.types import Inventory
from dra_driver.kubelet.server import KubeletPlugin
from dra_driver.kubelet.sockets import KubeletSocketError
from dra_driver.node.claim_fetcher import ApiServerClaimFetcher
from dra_driver.node.events import report_conflicts
from dra_driver.node.records import read_boot_id
from dra_driver.node.store import Store, open_store
from dra_driver.resources.publisher import SlicePublisher

log = structlog.get_logger(__name__)

# The simulator's major number of /dev/nvidia-caps-imex-channels/* (the kernel assigns a dynamic one,
# listed in /proc/devices; the real number is read there on a real node).
SIMULATED_CHANNEL_MAJOR = 234
_CHANNEL_DEVICE_NAME = "nvidia-caps-imex-channels"


def channel_major(procfs_root: Path = Path("/proc")) -> int | None:
    """The IMEX channels' major number from ``/proc/devices``; None when the driver created none."""
    try:
        lines = (procfs_root / "devices").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split()
        if len(parts) == 2 and parts[1] == _CHANNEL_DEVICE_NAME and parts[0].isdigit():
            return int(parts[0])
    return None


class ApiDomains:
    """The preparer's view of the API server: ComputeDomains and this node's label."""

    def __init__(self, kube: JsonApi, names: Names, node_name: str) -> None:
        self._kube = kube
        self._names = names
        self._node_path = f"/api/v1/nodes/{node_name}"

    async def by_uid(self, uid: str) -> ComputeDomain | None:
        listed = await self._kube.list(f"/apis/{self._names.api_version}/{PLURAL}")
        for item in listed.get("items") or []:
            if item.get("metadata", {}).get("uid") == uid:
                try:
                    return parse_compute_domain(item)
                except InvalidComputeDomain:
                    return None
        return None

    async def member_nodes(self, uid: str) -> set[str]:
        listed = await self._kube.list("/api/v1/nodes", labelSelector=f"{self._names.label}={uid}")
        return {item["metadata"]["name"] for item in listed.get("items") or []}

    async def label_node(self, uid: str) -> str | None:
        node = await self._kube.get(self._node_path)
        current = ((node or {}).get("metadata", {}).get("labels") or {}).get(self._names.label)
        if current and current != uid:
            return str(current)
        if current != uid:
            await self._kube.merge_patch(self._node_path, {"metadata": {"labels": {self._names.label: uid}}})
        return None

    async def unlabel_node(self, uid: str | None) -> None:
        node = await self._kube.get(self._node_path)
        current = ((node or {}).get("metadata", {}).get("labels") or {}).get(self._names.label)
        if current and current == (uid or current):
            await self._kube.merge_patch(self._node_path, {"metadata": {"labels": {self._names.label: None}}})


class ComputeDomainPlugin:
    """The second driver of the node daemon; :meth:`start` returns False where the node has no clique."""

    def __init__(
        self,
        *,
        gpu_driver: str,
        node_name: str,
        node_uid: str | None,
        api: ApiClient,
        inventory: Inventory,
        state_dir: Path,
        store_path: Path,
        boot_id_path: Path,
        cdi_dir: Path,
        plugins_dir: Path,
        registry_dir: Path,
        pod_uid: str | None,
        simulated: bool,
        host_imex: HostImex | None = None,
        binding_conditions: bool = False,
    ) -> None:
        self.names = Names(gpu_driver)
        self._node = node_name
        self._node_uid = node_uid
        self._api = api
        self._inventory = inventory
        self._state_dir = state_dir
        self._store_path = store_path
        self._boot_id_path = boot_id_path
        self._store: Store | None = None
        self._cdi_dir = cdi_dir
        self._plugins_dir = plugins_dir
        self._registry_dir = registry_dir
        self._pod_uid = pod_uid
        self._simulated = simulated
        self._host_imex = host_imex  # set: the host-managed IMEX mode, the host's daemon checked so
        # The channel waits in binding for its IMEX daemon; never in the host-managed mode, whose
        # host daemon is checked at the kubelet's prepare and brought by nothing the node does.
        self.binding_conditions = binding_conditions and host_imex is None
        self._plugin: KubeletPlugin | None = None
        self._publisher: SlicePublisher | None = None
        self.preparer: ComputeDomainPreparer | None = None

    @property
    def synced(self) -> bool:
        return self._publisher is None or self._publisher.synced

    async def start(self) -> bool:
        clique = node_clique(self._inventory)
        if not clique.clique:
            log.info("no ComputeDomains on this node", driver=self.names.driver, reason=clique.reason)
            return False
        major = SIMULATED_CHANNEL_MAJOR if self._simulated else await asyncio.to_thread(channel_major)
        if major is None:
            log.warning(
                "no ComputeDomains on this node: the NVIDIA driver created no IMEX channels "
                "(no nvidia-caps-imex-channels in /proc/devices)",
                driver=self.names.driver,
            )
            return False
        # Its own connection to the node's store, which the GPU driver's start has brought up to date.
        boot_id = await asyncio.to_thread(read_boot_id, self._boot_id_path)
        self._store = (await asyncio.to_thread(open_store, self._store_path, boot_id)).store
        self.preparer = ComputeDomainPreparer(
            names=self.names,
            node_name=self._node,
            clique=clique.clique,
            claims=ApiServerClaimFetcher(self._api),
            domains=ApiDomains(JsonApi(self._api), self.names, self._node),
            specs=SpecStore(self._cdi_dir, self.names.driver),
            store=self._store,
            state_dir=self._state_dir,
            channel_major=major,
            host_imex=self._host_imex,
        )
        await asyncio.to_thread(self.preparer.start, boot_id)
        await report_conflicts(
            JsonApi(self._api),
            self.preparer.recovery_conflicts,
            node_name=self._node,
            node_uid=self._node_uid,
            driver=self.names.driver,
        )
        try:
            plugin = KubeletPlugin(
                self.names.driver,
                self.preparer,
                plugins_dir=self._plugins_dir,
                registry_dir=self._registry_dir,
                pod_uid=self._pod_uid,
            )
            await plugin.start()
        except KubeletSocketError as error:
            # The GPUs are served all the same; only multi-node NVLink is off on this node.
            log.error("no ComputeDomains on this node", driver=self.names.driver, error=str(error))
            return False
        self._plugin = plugin
        self._publisher = SlicePublisher(
            self._api, driver=self.names.driver, node_name=self._node, node_uid=self._node_uid
        )
        host_managed = self._host_imex is not None
        self._publisher.set_desired(
            compute_domain_slices(
                clique.clique, daemon=not host_managed, binding_conditions=self.binding_conditions
            )
        )
        log.info(
            "serving ComputeDomains",
            driver=self.names.driver,
            clique=clique.clique,
            imex="host-managed" if host_managed else "driver-managed",
            binding_conditions=self.binding_conditions,
        )
        return True

    def tasks(self) -> list[Coroutine[Any, Any, None]]:
        return [self._publisher.run()] if self._publisher is not None else []

    async def stop(self) -> None:
        if self._plugin is not None:
            await self._plugin.stop()
        if self._store is not None:
            self._store.close()
            self._store = None
