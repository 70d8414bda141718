"""The kubelet-plugin daemon: wires discovery, publishing, the kubelet sockets and prepare together.

Start-up order matters to the kubelet: the sockets are already open when this runs
(:mod:`.launch`), and claim calls wait until the store is repaired (so a re-prepare after a crash
sees the truth); slices are published in the background so an API outage delays nothing on the
node. What only some nodes use is imported only there: ComputeDomains behind their gate, the
status server and its metrics behind an HTTP address.

In the order it runs: :func:`serve_node` opens what must be closed again (the API client, the
status server, the GPU backend: :class:`Handles`); :class:`GpuNode` builds the node's parts from
the decisions of :mod:`.policies` and the watches of :mod:`.watches`; :func:`_serve` starts them,
adds the ComputeDomains plugin and the binding-condition watch, and runs until stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from dra_driver.apiserver.connect import api_client
from dra_driver.apiserver.rest import JsonApi
from dra_driver.cdi.metadata import MetadataFiles
from dra_driver.cdi.store import SpecStore
from dra_driver.devices.backend import Backend
from dra_driver.devices.backends import open_backend, open_health_source, open_host_imex
from dra_driver.devices.host_imex import HostImex
from dra_driver.devices.pci import PassthroughGpu
from dra_driver.devices.types import HealthState, Inventory
from dra_driver.gpu_plugin import tuning
from dra_driver.gpu_plugin.policies import (
    binding_conditions_on,
    check_taint_effects,
    desired_slices,
    edits_for,
    node_labels,
    partition_policy,
    taint_policy,
)
from dra_driver.gpu_plugin.startup import check_mig_partitions, start_status_server
from dra_driver.gpu_plugin.tuning import HeapTrimmer
from dra_driver.gpu_plugin.watches import BindingWatch, HealthWatch, InventoryWatch, binding_watch
from dra_driver.labels.labeller import NodeLabeller
from dra_driver.node.claim_fetcher import ApiServerClaimFetcher
from dra_driver.node.claim_status import ApiServerClaimStatus, ClaimStatusWriter
from dra_driver.node.events import report_conflicts
from dra_driver.node.preparer import NodePreparer
from dra_driver.node.sharing.mps import MpsDaemons
from dra_driver.node.sharing.mps_deployment import DeploymentMpsDaemons
from dra_driver.node.store import STORE_FILE
from dra_driver.resources.publisher import SlicePublisher
from dra_driver.resources.server_rules import NEWEST, ServerRules, rules_for
from dra_driver.resources.taints import DeviceHealth, device_health, device_taints
from dra_driver.settings import Settings, shm_size_bytes, xid_numbers
from dra_driver.simulated.mps_daemons import LocalMpsDaemons

if TYPE_CHECKING:  # only for the annotations: dra_driver.apiserver.kube imports the client's machinery
    from kubernetes.aio.client import ApiClient

    from dra_driver.computedomain.plugin import ComputeDomainPlugin
    from dra_driver.gpu_plugin.http import StatusServer
    from dra_driver.gpu_plugin.metrics import Metrics
    from dra_driver.kubelet.front import KubeletFront

log = structlog.get_logger("dra_driver.gpu_plugin.app")

# How long shutdown waits for claim operations the kubelet no longer waits for (a MIG device
# being created, a claim being read): with the DRA socket's 5 s grace this stays within the
# pod's default 30 s termination grace period, before the backend and the API client close.
DRAIN_SECONDS = 20.0


async def server_rules(api: ApiClient) -> ServerRules:
    """The API rules of the API server's release (``/version``); the newest when it cannot be read,
    so an outage at start never stops the node from serving."""
    try:
        version = await JsonApi(api).get("/version", request_timeout_s=10)
        git_version = str((version or {}).get("gitVersion", ""))
    except Exception as err:
        log.warning("API server version not readable; assuming the newest API rules", error=str(err))
        return NEWEST
    log.info("API server version", version=git_version)
    return rules_for(git_version)


async def node_uid(api: ApiClient, node_name: str) -> str | None:
    """The Node's UID for the slices' owner reference; ``None`` (no owner) if it cannot be read yet."""
    try:
        node = await JsonApi(api).get(f"/api/v1/nodes/{node_name}", request_timeout_s=10)
        if node is None:
            raise RuntimeError("no such Node")
        uid = node["metadata"]["uid"]
    except Exception as err:  # an outage must not stop the node from serving claims
        log.warning("node not readable; slices get no owner reference", node=node_name, error=str(err))
        return None
    return uid if isinstance(uid, str) else None


def mps_daemons(settings: Settings, api: ApiClient) -> MpsDaemons | None:
    """Where the node's MPS control daemons run (docs/sharing.md); None: MPS claims are refused.

    A simulated node runs stand-in processes (no kubelet there runs pods); a real node runs a
    Deployment per daemon in the plugin's namespace, which needs that namespace and an image.
    """
    if settings.simulate:
        return LocalMpsDaemons.of_node(settings.state_dir)
    if not (settings.pod_namespace and settings.mps_daemon_image):
        log.info("MPS claims are refused: --pod-namespace and --mps-daemon-image are not both set")
        return None
    return DeploymentMpsDaemons(
        JsonApi(api),
        namespace=settings.pod_namespace,
        node_name=settings.node_name,
        image=settings.mps_daemon_image,
        driver_root=str(settings.driver_root),
        root=settings.state_dir / "mps",
        shm_size_bytes=shm_size_bytes(settings.mps_shm_size) if settings.mps_shm_size else None,
    )


def host_imex(settings: Settings) -> HostImex | None:
    """The check of the host's nvidia-imex daemon in the host-managed IMEX mode; None: driver-managed."""
    if not settings.host_managed_imex:
        return None
    return open_host_imex(
        settings.simulate or None,
        settings.state_dir,
        settings.driver_root_mount or settings.driver_root,
        settings.imex_host_socket_path,
    )


def compute_domain_plugin(
    settings: Settings, api: ApiClient, inventory: Inventory, node_uid: str | None, rules: ServerRules
) -> ComputeDomainPlugin | None:
    """The ComputeDomains plugin when their gate is on; its module is imported only then."""
    if not settings.compute_domains:
        return None
    from dra_driver.computedomain.plugin import ComputeDomainPlugin

    return ComputeDomainPlugin(
        gpu_driver=settings.driver_name,
        node_name=settings.node_name,
        node_uid=node_uid,
        api=api,
        inventory=inventory,
        state_dir=settings.state_dir / "compute-domains",
        store_path=settings.state_dir / STORE_FILE,
        boot_id_path=settings.boot_id_file,
        cdi_dir=settings.cdi_dir,
        plugins_dir=settings.plugins_dir,
        registry_dir=settings.registry_dir,
        pod_uid=settings.pod_uid or None,
        simulated=bool(settings.simulate),
        host_imex=host_imex(settings),
        binding_conditions=binding_conditions_on(settings, rules),
    )


@dataclass(frozen=True)
class Handles:
    """What :func:`serve_node` opened before the node's parts are built (the API client, the status
    server, the GPU backend), and closes after them; with the settings and the kubelet's front."""

    settings: Settings
    kubelet: KubeletFront
    backend: Backend
    inventory: Inventory  # as read at start
    api: ApiClient
    metrics: Metrics | None
    status: StatusServer | None


class GpuNode:
    """The GPU driver's parts on this node, built in the order they need each other.

    The inventory watch, the health watch and the preparer feed one another (a MIG prepare changes
    the inventory, a fault changes the slices, both change what is published): each gets a method
    of this object, or a lambda over its attributes, as its callback. None is called while the
    parts are built, only from :meth:`start` on, when every part exists.
    """

    def __init__(
        self,
        handles: Handles,
        rules: ServerRules,
        node_uid: str | None,
        passthrough: Mapping[str, PassthroughGpu] | None,
    ) -> None:
        settings, api = handles.settings, handles.api
        self._settings = settings
        self._rules = rules
        self._passthrough = passthrough
        self._health_board = handles.kubelet.health
        self._metrics = handles.metrics
        self._node_uid = node_uid
        self._api = api
        self.taint_policy = taint_policy(settings)
        self.publisher = SlicePublisher(
            api, driver=settings.driver_name, node_name=settings.node_name, node_uid=node_uid
        )
        self.labeller = NodeLabeller(api, settings.node_name) if settings.node_labels else None
        self.inventory_watch = InventoryWatch(
            handles.backend, handles.inventory, self.publish, settings.inventory_refresh_seconds
        )
        self.health_watch = HealthWatch(
            open_health_source(
                handles.backend,
                ignored_xids=xid_numbers(settings.ignored_xids),
                poll_seconds=settings.health_poll_seconds,
            ),
            self.taint_policy,
            lambda: self.inventory_watch.current,
            self._health_changed,
        )
        self.claim_status = ClaimStatusWriter(
            ApiServerClaimStatus(api),
            driver_name=settings.driver_name,
            inventory=lambda: self.inventory_watch.current,
            faults=lambda: self.health_watch.faults,
            busy=lambda: self.preparer.busy,  # writes wait for a pause in the kubelet's calls
        )
        self.preparer = NodePreparer(
            driver_name=settings.driver_name,
            node_name=settings.node_name,
            backend=handles.backend,
            inventory=lambda: self.inventory_watch.current,
            claims=ApiServerClaimFetcher(api),
            specs=SpecStore(settings.cdi_dir, settings.driver_name),
            common_edits=edits_for(settings, handles.inventory),
            store_path=settings.state_dir / STORE_FILE,
            boot_id_path=settings.boot_id_file,
            partition=partition_policy(settings.mig_partitions, settings.driver_name),
            consumable=settings.consumable_capacity,
            on_inventory_changed=self.inventory_watch.deliver,  # MIG devices made or destroyed: publish now
            observer=handles.metrics,
            on_prepared=self.claim_status.prepared,
            on_unprepared=self.claim_status.unprepared,
            on_idle=lambda: self.trimmer.idle(),
            mps=mps_daemons(settings, api),
            metadata=MetadataFiles(settings.plugins_dir / settings.driver_name)
            if settings.device_metadata
            else None,
            passthrough=passthrough,
        )
        self.trimmer = HeapTrimmer(lambda: self.preparer.busy)  # a burst's freed memory goes back

    async def start(self) -> None:
        """Repair the store, take the first health report, publish; then the kubelet's calls may go on."""
        await self.preparer.start()  # before publishing: it knows which MIG devices are the driver's own
        await report_conflicts(
            JsonApi(self._api),
            self.preparer.recovery_conflicts,
            node_name=self._settings.node_name,
            node_uid=self._node_uid,
            driver=self._settings.driver_name,
        )
        await self.health_watch.start()  # before publishing too: a faulty GPU is never offered untainted
        self.publish(self.inventory_watch.current)  # as the preparer's start left it (orphans destroyed)
        for ref, devices in self.preparer.prepared():  # a restarted plugin refreshes what it holds
            self.claim_status.prepared(ref, devices)
        if self._metrics is not None:
            self._metrics.follow(
                self.claim_status,
                published=lambda: self.publisher.published_devices,
                prepared=lambda: self.preparer.prepared_claims,
            )

    def publish(self, latest: Inventory) -> None:
        """The slices, labels and kubelet health for ``latest`` and the faults known now."""
        settings = self._settings
        self.preparer.remember_orphans()  # the read destroyed some, or a failed rollback left one
        if self.labeller is not None:
            self.labeller.set_desired(node_labels(settings, latest, self.health_watch.faults))
        taints = device_taints(latest, self.health_watch.tainted, self.taint_policy)
        slices = desired_slices(
            settings, latest, self.preparer.owned_mig_uuids(), taints, self._rules, self._passthrough
        )
        self.publisher.set_desired(slices)
        names = [d["name"] for s in slices for d in s.devices]
        self._health_board.set_devices(settings.node_name, names)
        unhealthy = device_health(latest, self.health_watch.faults)
        for name in names:
            device = unhealthy.get(name, DeviceHealth(HealthState.HEALTHY))
            self._health_board.mark(settings.node_name, name, device.state, device.message)

    def _health_changed(self) -> None:
        self.publish(self.inventory_watch.current)
        self.claim_status.health_changed()

    def tasks(self) -> list[Coroutine[Any, Any, None]]:
        """What runs while the node serves."""
        return [
            self.publisher.run(),
            self.inventory_watch.run(),
            self.health_watch.run(),
            self.claim_status.run(),
            *([self.labeller.run()] if self.labeller else []),
        ]


def readiness(
    kubelet: KubeletFront, node: GpuNode, compute_domains: ComputeDomainPlugin | None
) -> Callable[[], str | None]:
    """``/readyz``'s answer: why the node is not ready yet, or None."""
    plugin = kubelet.plugin

    def why_not_ready() -> str | None:
        if not plugin.registration.registered.is_set():
            return plugin.registration.error or "not registered with the kubelet yet"
        # Published once, not in sync now: slices change at every MIG prepare (publisher.published).
        if not node.publisher.published or (compute_domains is not None and not compute_domains.synced):
            return "ResourceSlices not published yet"
        return None

    return why_not_ready


async def _until_stopped(stop: asyncio.Event, tasks: list[asyncio.Task[None]]) -> None:
    """Wait for the stop signal; a background task that dies is a bug worth exiting for."""
    stopper = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait([stopper, *tasks], return_when=asyncio.FIRST_COMPLETED)
    stopper.cancel()
    for task in done:
        if task is not stopper:
            task.result()  # re-raise what killed it


async def _serve(handles: Handles, stop: asyncio.Event, started: float) -> None:
    """Build and start the node's parts, let the held claim calls go on, serve until ``stop``."""
    settings, api = handles.settings, handles.api
    own_node_uid = await node_uid(api, settings.node_name)
    rules = await server_rules(api)
    check_taint_effects(settings, rules)
    # Which GPUs can be passed through, and their indexes: fixed until a reboot, so read once.
    passthrough = (
        await asyncio.to_thread(handles.backend.pci().passthrough_gpus) if settings.passthrough else None
    )
    node = GpuNode(handles, rules, own_node_uid, passthrough)
    await node.start()
    plugin = handles.kubelet.plugin
    handles.kubelet.claims.ready(node.preparer)  # the claim calls held since the sockets opened go on now

    # The second driver, compute-domain.<domain>, on nodes of a multi-node NVLink clique.
    compute_domains = compute_domain_plugin(settings, api, handles.inventory, own_node_uid, rules)
    binding: BindingWatch | None = None
    if handles.status is not None:
        handles.status.readiness = readiness(handles.kubelet, node, compute_domains)
    tasks: list[asyncio.Task[None]] = []
    try:
        serving_domains = compute_domains is not None and await compute_domains.start()
        binding = binding_watch(
            settings, rules, api, node.preparer, compute_domains if serving_domains else None
        )
        log.info(
            "serving the kubelet",
            dra_socket=str(plugin.dra_socket),
            registration_socket=str(plugin.registration_socket),
            http_port=handles.status.port if handles.status else None,
            startup_seconds=round(time.monotonic() - started, 3),
        )
        tuning.settle_after_start(node.trimmer)
        tasks = [
            asyncio.create_task(task)
            for task in [
                *node.tasks(),
                *([binding.run()] if binding else []),
                *(compute_domains.tasks() if compute_domains is not None else []),
            ]
        ]
        await _until_stopped(stop, tasks)
    finally:
        log.info("shutting down")
        if compute_domains is not None:
            await compute_domains.stop()
        await plugin.stop()
        if binding is not None:
            await binding.stop()
        await node.preparer.drain(DRAIN_SECONDS)  # before serve_node closes the backend and the client
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def serve_node(settings: Settings, kubelet: KubeletFront, stop: asyncio.Event, started: float) -> None:
    """Build the daemon behind the open kubelet sockets and serve until ``stop``.

    ``started`` is when the process began (for the log). Whatever fails here propagates; the
    caller (:func:`dra_driver.gpu_plugin.launch.run_plugin`) answers held claim calls and removes the sockets.
    """
    async with contextlib.AsyncExitStack() as held:
        api = await api_client(settings.kubeconfig)
        held.push_async_callback(api.close)
        metrics = None
        status = None
        if settings.http_address:
            # aiohttp.web and prometheus_client: imported only by a daemon that serves probes.
            from dra_driver.gpu_plugin.http import StatusServer
            from dra_driver.gpu_plugin.metrics import Metrics

            # Bound first: a wrong address fails at once, and probes get answers while GPUs are read.
            metrics = Metrics()
            status = StatusServer(
                settings.http_address, metrics, lambda: "starting", metrics_public=settings.metrics_public
            )
            await start_status_server(status, settings.http_address)
            held.push_async_callback(status.stop)
        backend = await asyncio.to_thread(
            open_backend,
            settings.simulate or None,
            settings.state_dir,
            settings.node_name,
            driver_root=settings.driver_root_mount or settings.driver_root,
            sysfs_root=settings.sysfs_root or Path("/sys"),
            procfs_root=settings.procfs_root,
            simulated_fabric=settings.simulate_fabric,
        )
        held.push_async_callback(asyncio.to_thread, backend.close)
        inventory = await asyncio.to_thread(backend.inventory)
        check_mig_partitions(settings, inventory)
        log.info(
            "GPUs discovered",
            backend="simulated:" + settings.simulate if settings.simulate else "nvml",
            gpus=len(inventory.gpus),
            driver_version=inventory.driver_version,
        )
        await _serve(Handles(settings, kubelet, backend, inventory, api, metrics, status), stop, started)
