"""The kubelet-plugin daemon: wires discovery, publishing, the kubelet sockets and prepare together.

Start-up order matters to the kubelet: the checkpoint is repaired before any socket exists (so a
re-prepare after a crash sees the truth), the DRA socket serves before the registration socket
appears (the kubelet dials the endpoint right after GetInfo), and slices are published in the
background so an API outage delays nothing on the node.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Callable, Collection

import structlog
from kubernetes.aio import client as kube_client
from kubernetes.aio import config as kube_config

from dra_driver.cdi.spec import CommonEdits, common_edits
from dra_driver.cdi.store import SpecStore
from dra_driver.devices.backend import Backend, DeviceError
from dra_driver.devices.backends import open_backend
from dra_driver.devices.driver_root import find_driver_files
from dra_driver.devices.types import Inventory
from dra_driver.http import StatusServer
from dra_driver.kubelet.health import HealthBoard
from dra_driver.kubelet.server import KubeletPlugin
from dra_driver.metrics import Metrics
from dra_driver.node.claim_fetcher import ApiServerClaimFetcher
from dra_driver.node.preparer import NodePreparer
from dra_driver.resources.devices import (
    PartitionPolicy,
    build_devices,
    partition_all,
    partition_none,
    partition_selected,
)
from dra_driver.resources.publisher import SlicePublisher
from dra_driver.resources.slices import SliceContent, split_pool
from dra_driver.settings import Settings

log = structlog.get_logger("dra_driver.app")

CHECKPOINT_FILE = "checkpoint.json"


def partition_policy(setting: str) -> PartitionPolicy:
    """The ``--mig-partitions`` value as a policy: all, none, or a list of GPU UUIDs / minors."""
    if setting == "all":
        return partition_all
    if setting == "none":
        return partition_none
    return partition_selected([part.strip() for part in setting.split(",") if part.strip()])


def desired_slices(
    settings: Settings, inventory: Inventory, owned_mig_uuids: Collection[str] = frozenset()
) -> list[SliceContent]:
    """What the pool should contain for ``inventory``: the one rule shared by daemon and CLI.

    ``owned_mig_uuids`` are the MIG devices the driver created for claims; they stay published
    as the placements they were created from.
    """
    policy = partition_policy(settings.mig_partitions)
    return split_pool(build_devices(inventory, partition=policy, owned_mig_uuids=owned_mig_uuids))


def edits_for(settings: Settings, inventory: Inventory) -> CommonEdits:
    """What every container with one of our GPUs needs from the host."""
    try:
        files = find_driver_files(
            settings.driver_root, inventory.driver_version, seen_at=settings.driver_root_mount
        )
    except DeviceError as err:
        if not settings.simulate:
            raise
        # Simulated GPUs on a machine without the NVIDIA driver: nothing to mount, and that is fine.
        log.info("no NVIDIA driver files for the simulated GPUs; specs mount none", reason=str(err))
        files = None
    return common_edits(inventory, files)


async def api_client(settings: Settings) -> kube_client.ApiClient:
    configuration = kube_client.Configuration()
    if settings.kubeconfig is not None:
        await kube_config.load_kube_config(  # type: ignore[no-untyped-call]
            config_file=str(settings.kubeconfig), client_configuration=configuration
        )
    else:
        kube_config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
    return kube_client.ApiClient(configuration)


async def node_uid(api: kube_client.ApiClient, node_name: str) -> str | None:
    """The Node's UID for the slices' owner reference; ``None`` (no owner) if it cannot be read yet."""
    try:
        node = await kube_client.CoreV1Api(api).read_node(node_name)
    except Exception as err:  # an outage must not stop the node from serving claims
        log.warning("node not readable; slices get no owner reference", node=node_name, error=str(err))
        return None
    return node.metadata.uid if node.metadata else None


class InventoryWatch:
    """Re-reads the GPUs periodically and republishes when anything changed."""

    def __init__(
        self, backend: Backend, first: Inventory, on_change: Callable[[Inventory], None], period: float
    ) -> None:
        self._backend = backend
        self.current = first
        self._on_change = on_change
        self._period = period

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self._period)
            try:
                latest = await asyncio.to_thread(self._backend.inventory)
            except Exception as err:  # a transient hardware read error must not kill the daemon
                log.warning("re-reading GPUs failed; keeping the last inventory", error=str(err))
                continue
            if latest != self.current:
                log.info("GPU inventory changed; republishing", gpus=len(latest.gpus))
                self.current = latest
                self._on_change(latest)


async def run_plugin(settings: Settings, stop: asyncio.Event | None = None) -> None:
    """Run the daemon until SIGTERM/SIGINT (or ``stop``); leaves no socket of its own behind."""
    started = time.monotonic()
    stop = stop or _stop_on_signals()
    state_dir = settings.state_dir
    state_dir.mkdir(parents=True, exist_ok=True)
    async with contextlib.AsyncExitStack() as held:
        backend = await asyncio.to_thread(
            open_backend, settings.simulate or None, state_dir, settings.node_name
        )
        held.push_async_callback(asyncio.to_thread, backend.close)
        inventory = await asyncio.to_thread(backend.inventory)
        log.info(
            "GPUs discovered",
            backend="simulated:" + settings.simulate if settings.simulate else "nvml",
            gpus=len(inventory.gpus),
            driver_version=inventory.driver_version,
        )
        api = await api_client(settings)
        held.push_async_callback(api.close)
        await _serve(settings, backend, inventory, api, stop, started)


async def _serve(
    settings: Settings,
    backend: Backend,
    inventory: Inventory,
    api: kube_client.ApiClient,
    stop: asyncio.Event,
    started: float,
) -> None:
    state_dir = settings.state_dir
    metrics = Metrics()
    health = HealthBoard()
    publisher = SlicePublisher(
        api,
        driver=settings.driver_name,
        node_name=settings.node_name,
        node_uid=await node_uid(api, settings.node_name),
    )

    def publish(latest: Inventory) -> None:
        slices = desired_slices(settings, latest, preparer.owned_mig_uuids())
        publisher.set_desired(slices)
        health.set_devices(settings.node_name, [d["name"] for s in slices for d in s.devices])

    def mig_devices_changed(latest: Inventory) -> None:
        """The preparer created or destroyed a MIG device: plan and publish from the new state now."""
        watch.current = latest
        publish(latest)

    watch = InventoryWatch(backend, inventory, publish, settings.inventory_refresh_seconds)
    preparer = NodePreparer(
        driver_name=settings.driver_name,
        node_name=settings.node_name,
        backend=backend,
        inventory=lambda: watch.current,
        claims=ApiServerClaimFetcher(api),
        specs=SpecStore(settings.cdi_dir, settings.driver_name),
        common_edits=edits_for(settings, inventory),
        checkpoint_path=state_dir / CHECKPOINT_FILE,
        boot_id_path=settings.boot_id_file,
        partition=partition_policy(settings.mig_partitions),
        on_inventory_changed=mig_devices_changed,
        observer=metrics,
    )
    await preparer.start()  # before publishing: it knows which MIG devices are the driver's own
    publish(inventory)
    metrics.devices_published.set_function(lambda: publisher.published_devices)
    metrics.prepared_claims.set_function(lambda: preparer.prepared_claims)

    plugin = KubeletPlugin(
        settings.driver_name,
        preparer,
        health_feed=health,
        plugins_dir=settings.plugins_dir,
        registry_dir=settings.registry_dir,
        pod_uid=settings.pod_uid or None,
    )

    def readiness() -> str | None:
        if not plugin.registration.registered.is_set():
            return plugin.registration.error or "not registered with the kubelet yet"
        if not publisher.synced:
            return "ResourceSlices not published yet"
        return None

    status = StatusServer(settings.http_address, metrics, readiness) if settings.http_address else None
    tasks: list[asyncio.Task[None]] = []
    try:
        if status is not None:
            await status.start()
        await plugin.start()
        log.info(
            "serving the kubelet",
            dra_socket=str(plugin.dra_socket),
            registration_socket=str(plugin.registration_socket),
            http_port=status.port if status else None,
            startup_seconds=round(time.monotonic() - started, 3),
        )
        tasks = [asyncio.create_task(publisher.run()), asyncio.create_task(watch.run())]
        await _until_stopped(stop, tasks)
    finally:
        log.info("shutting down")
        await plugin.stop()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if status is not None:
            await status.stop()


async def _until_stopped(stop: asyncio.Event, tasks: list[asyncio.Task[None]]) -> None:
    """Wait for the stop signal; a background task that dies is a bug worth exiting for."""
    stopper = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait([stopper, *tasks], return_when=asyncio.FIRST_COMPLETED)
    stopper.cancel()
    for task in done:
        if task is not stopper:
            task.result()  # re-raise what killed it


def _stop_on_signals() -> asyncio.Event:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop
