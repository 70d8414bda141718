"""The kubelet-plugin daemon: wires discovery, publishing, the kubelet sockets and prepare together.

Start-up order matters to the kubelet: the sockets are already open when this runs
(:mod:`dra_driver.gpu_plugin.launch`), and claim calls wait until the store is repaired (so a re-prepare
after a crash sees the truth); slices are published in the background so an API outage delays
nothing on the node. What only some nodes use is imported only there: ComputeDomains behind
their gate, the status server and its metrics behind an HTTP address.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from dra_driver.apiserver import kube
from dra_driver.apiserver.informer import list_and_watch
from dra_driver.apiserver.rest import JsonApi
from dra_driver.cdi.metadata import MetadataFiles
from dra_driver.cdi.spec import HOOK_COMMANDS, CommonEdits, common_edits
from dra_driver.cdi.store import SpecStore
from dra_driver.devices.backend import Backend, DeviceError
from dra_driver.devices.backends import open_backend, open_health_source, open_host_imex
from dra_driver.devices.driver_root import (
    cdi_hook_commands,
    find_cdi_hook,
    find_driver_files,
    parse_capabilities,
)
from dra_driver.devices.faults import FaultKind, NodeFaults
from dra_driver.devices.health import HealthSource
from dra_driver.devices.host_imex import HostImex
from dra_driver.devices.pci import PassthroughGpu
from dra_driver.devices.types import HealthState, Inventory
from dra_driver.errors import StartupError
from dra_driver.gpu_plugin.startup import check_mig_partitions, load_kube_configuration, start_status_server
from dra_driver.gpu_plugin.tuning import HeapTrimmer, settle_collector
from dra_driver.labels.gfd import gfd_labels
from dra_driver.labels.labeller import NodeLabeller
from dra_driver.node.binding import CLAIMS_PATH, RESYNC_S, BindingWatcher
from dra_driver.node.claim_fetcher import ApiServerClaimFetcher
from dra_driver.node.claim_status import ApiServerClaimStatus, ClaimStatusWriter
from dra_driver.node.events import report_conflicts
from dra_driver.node.nvidia_config import NVIDIA_DRIVER_NAME
from dra_driver.node.preparer import NodePreparer
from dra_driver.node.sharing.mps import MpsDaemons
from dra_driver.node.sharing.mps_deployment import DeploymentMpsDaemons
from dra_driver.node.store import STORE_FILE
from dra_driver.resources.devices import (
    PartitionPolicy,
    build_devices,
    partition_all,
    partition_mig_mode,
    partition_none,
    partition_selected,
)
from dra_driver.resources.publisher import SlicePublisher
from dra_driver.resources.server_rules import NEWEST, ServerRules, rules_for
from dra_driver.resources.slices import SliceContent, split_pool
from dra_driver.resources.taints import (
    DeviceHealth,
    TaintEffect,
    TaintPolicy,
    device_health,
    device_taints,
    faults_to_taint,
    unknown_gpus,
)
from dra_driver.resources.wire import DeviceTaint
from dra_driver.settings import (
    BindingConditions,
    Settings,
    TaintsOnRecovery,
    partition_gpus,
    shm_size_bytes,
    xid_numbers,
)
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


def partition_policy(setting: str, driver_name: str) -> PartitionPolicy:
    """The ``--mig-partitions`` value as a policy: all, none, mig-mode, auto, or GPU UUIDs / minors.

    ``auto`` is all under the driver's own name and mig-mode under NVIDIA's, whose driver offers no
    dynamic MIG by default: claims written for it, admin access included, find full GPUs without
    counters there (docs/maintenance.md says what each choice costs).
    """
    if setting == "auto":
        setting = "mig-mode" if driver_name == NVIDIA_DRIVER_NAME else "all"
    if setting == "all":
        return partition_all
    if setting == "none":
        return partition_none
    if setting == "mig-mode":
        return partition_mig_mode
    return partition_selected(partition_gpus(setting))


def desired_slices(
    settings: Settings,
    inventory: Inventory,
    owned_mig_uuids: Collection[str] = frozenset(),
    taints: Mapping[str, Sequence[DeviceTaint]] | None = None,
    rules: ServerRules = NEWEST,
    passthrough: Mapping[str, PassthroughGpu] | None = None,
) -> list[SliceContent]:
    """What the pool should contain for ``inventory``: the one rule shared by daemon and CLI.

    ``owned_mig_uuids`` are the MIG devices the driver created for claims; they stay published
    as the placements they were created from. ``taints`` are those of faulty GPUs' devices.
    ``rules`` are the API server's release's (the slice layout differs on 1.34). ``passthrough``
    (read from sysfs when ``--passthrough`` is on) gives the GPUs that can be passed through.
    """
    policy = partition_policy(settings.mig_partitions, settings.driver_name)
    return split_pool(
        build_devices(
            inventory,
            partition=policy,
            owned_mig_uuids=owned_mig_uuids,
            taints=taints,
            maintenance=settings.maintenance_devices,
            consumable=settings.consumable_capacity,
            passthrough=passthrough,
            binding_conditions=binding_conditions_on(settings, rules),
            share_binding_conditions=binding_conditions_on(settings, rules)
            and settings.share_binding_conditions,
        ),
        counters_beside_devices=rules.counters_beside_devices,
    )


def binding_conditions_on(settings: Settings, rules: ServerRules) -> bool:
    """Whether placements carry binding conditions: ``auto`` follows the release's default gate."""
    if settings.binding_conditions is BindingConditions.AUTO:
        return rules.binding_conditions
    return settings.binding_conditions is BindingConditions.ON


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


def check_taint_effects(settings: Settings, rules: ServerRules) -> None:
    """Taint effect None needs 1.35: 1.34 would refuse every slice with such a taint in it."""
    if rules.taint_effect_none:
        return
    for flag, env, effect in (
        ("--xid-taint-effect", "DRA_XID_TAINT_EFFECT", settings.xid_taint_effect),
        ("--gpu-lost-taint-effect", "DRA_GPU_LOST_TAINT_EFFECT", settings.gpu_lost_taint_effect),
    ):
        if effect is TaintEffect.NONE:
            raise StartupError(
                f"{flag} / {env}: the taint effect None needs Kubernetes 1.35 or newer, and this API "
                "server is older; use NoSchedule or NoExecute"
            )


DMI_PRODUCT_NAME = Path("/sys/class/dmi/id/product_name")


def node_labels(settings: Settings, inventory: Inventory, faults: NodeFaults) -> dict[str, str]:
    """GFD's labels for the node: lost GPUs (unreachable, or a gpu-lost Xid) left out; the
    machine from DMI, unless simulated."""
    lost_xids = frozenset(xid_numbers(settings.gpu_lost_xids))
    lost = {
        uuid
        for uuid, found in faults.items()
        if any(f.kind is FaultKind.GPU_LOST or f.xid in lost_xids for f in found)
    }
    machine = None
    if not settings.simulate:
        with contextlib.suppress(OSError):
            machine = DMI_PRODUCT_NAME.read_text().strip()
    return gfd_labels(inventory, lost=lost, machine=machine)


def taint_policy(settings: Settings) -> TaintPolicy:
    return TaintPolicy(
        driver_name=settings.driver_name,
        xid_effect=settings.xid_taint_effect,
        gpu_lost_effect=settings.gpu_lost_taint_effect,
        gpu_lost_xids=frozenset(xid_numbers(settings.gpu_lost_xids)),
        remove_on_recovery=settings.taints_on_recovery is TaintsOnRecovery.REMOVE,
    )


def edits_for(settings: Settings, inventory: Inventory) -> CommonEdits:
    """What every container with one of our GPUs needs from the host."""
    try:
        files = find_driver_files(
            settings.driver_root,
            inventory.driver_version,
            seen_at=settings.driver_root_mount,
            capabilities=parse_capabilities(settings.driver_capabilities),
        )
    except DeviceError as err:
        if not settings.simulate:
            raise
        # Simulated GPUs on a machine without the NVIDIA driver: nothing to mount, and that is fine.
        log.info("no NVIDIA driver files for the simulated GPUs; specs mount none", reason=str(err))
        files = None
    hook_path = settings.nvidia_cdi_hook_path or find_cdi_hook(
        settings.driver_root, seen_at=settings.driver_root_mount
    )
    if files is not None and hook_path is None:
        log.info(
            "no nvidia-cdi-hook: specs create no library symlinks and leave the linker cache alone",
            hint="set nvidia-cdi-hook-path, or install the NVIDIA container toolkit in the driver root",
        )
    if files is None or hook_path is None:
        return common_edits(inventory, files)
    return common_edits(
        inventory, files, hook_path=hook_path, hook_commands=hook_commands(settings, hook_path)
    )


# What every nvidia-cdi-hook has had (toolkit v1.14 on): all a spec runs when the hook is unreadable.
_OLDEST_HOOK_COMMANDS = ("create-symlinks", "update-ldcache")


def hook_commands(settings: Settings, hook_path: str) -> tuple[str, ...]:
    """The commands of HOOK_COMMANDS that the host's nvidia-cdi-hook at ``hook_path`` has."""
    seen = Path(hook_path)
    if settings.driver_root_mount is not None and seen.is_relative_to(settings.driver_root):
        seen = settings.driver_root_mount / seen.relative_to(settings.driver_root)
    try:
        found = cdi_hook_commands(seen, HOOK_COMMANDS)
    except DeviceError as err:
        log.warning(
            "nvidia-cdi-hook unreadable: specs run only the hook commands every version has",
            error=str(err),
            commands=list(_OLDEST_HOOK_COMMANDS),
        )
        return _OLDEST_HOOK_COMMANDS
    missing = [command for command in HOOK_COMMANDS if command not in found]
    if missing:
        log.info(
            "nvidia-cdi-hook lacks commands; specs leave them out",
            missing=missing,
            hint="NVIDIA container toolkit v1.18.0 or newer has them",
        )
    return tuple(command for command in HOOK_COMMANDS if command in found)


# HTTP/1.1 connections to the API server at most (the client's default is 100). A burst of 200
# prepares opened one per claim GET in flight: a TLS handshake each, on both sides of a busy
# node, and their buffers kept afterwards. A GET takes a few ms, so 16 connections carry
# thousands a second, and leave room for the long-lived watches (slices, ComputeDomains).
API_CONNECTIONS = 16


async def api_client(settings: Settings) -> ApiClient:
    """A client of the API server: from the kubeconfig if one is set, else the pod's service account."""
    configuration = kube.Configuration()
    await load_kube_configuration(settings.kubeconfig, configuration)
    kube.resolve_environment_once(configuration)
    configuration.connection_pool_maxsize = API_CONNECTIONS
    return kube.ApiClient(configuration)


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


async def serve_node(settings: Settings, kubelet: KubeletFront, stop: asyncio.Event, started: float) -> None:
    """Build the daemon behind the open kubelet sockets and serve until ``stop``.

    ``started`` is when the process began (for the log). Whatever fails here propagates; the
    caller (:func:`dra_driver.gpu_plugin.launch.run_plugin`) answers held claim calls and removes the sockets.
    """
    async with contextlib.AsyncExitStack() as held:
        api = await api_client(settings)
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
        await _serve(settings, kubelet, backend, inventory, api, metrics, status, stop, started)


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


async def _serve(
    settings: Settings,
    kubelet: KubeletFront,
    backend: Backend,
    inventory: Inventory,
    api: ApiClient,
    metrics: Metrics | None,
    status: StatusServer | None,
    stop: asyncio.Event,
    started: float,
) -> None:
    state_dir = settings.state_dir
    health = kubelet.health
    policy = taint_policy(settings)
    own_node_uid = await node_uid(api, settings.node_name)
    rules = await server_rules(api)
    check_taint_effects(settings, rules)
    publisher = SlicePublisher(
        api,
        driver=settings.driver_name,
        node_name=settings.node_name,
        node_uid=own_node_uid,
    )

    labeller = NodeLabeller(api, settings.node_name) if settings.node_labels else None
    # Which GPUs can be passed through, and their indexes: fixed until a reboot, so read once.
    passthrough = await asyncio.to_thread(backend.pci().passthrough_gpus) if settings.passthrough else None

    def publish(latest: Inventory) -> None:
        preparer.remember_orphans()  # the read destroyed some, or a failed rollback left one
        if labeller is not None:
            labeller.set_desired(node_labels(settings, latest, gpu_health.faults))
        taints = device_taints(latest, gpu_health.tainted, policy)
        slices = desired_slices(settings, latest, preparer.owned_mig_uuids(), taints, rules, passthrough)
        publisher.set_desired(slices)
        names = [d["name"] for s in slices for d in s.devices]
        health.set_devices(settings.node_name, names)
        unhealthy = device_health(latest, gpu_health.faults)
        for name in names:
            device = unhealthy.get(name, DeviceHealth(HealthState.HEALTHY))
            health.mark(settings.node_name, name, device.state, device.message)

    def health_changed() -> None:
        publish(watch.current)
        claim_status.health_changed()

    watch = InventoryWatch(backend, inventory, publish, settings.inventory_refresh_seconds)
    gpu_health = HealthWatch(
        open_health_source(
            backend,
            ignored_xids=xid_numbers(settings.ignored_xids),
            poll_seconds=settings.health_poll_seconds,
        ),
        policy,
        lambda: watch.current,
        health_changed,
    )
    claim_status = ClaimStatusWriter(
        ApiServerClaimStatus(api),
        driver_name=settings.driver_name,
        inventory=lambda: watch.current,
        faults=lambda: gpu_health.faults,
        busy=lambda: preparer.busy,  # writes wait for a pause in the kubelet's calls
    )
    preparer = NodePreparer(
        driver_name=settings.driver_name,
        node_name=settings.node_name,
        backend=backend,
        inventory=lambda: watch.current,
        claims=ApiServerClaimFetcher(api),
        specs=SpecStore(settings.cdi_dir, settings.driver_name),
        common_edits=edits_for(settings, inventory),
        store_path=state_dir / STORE_FILE,
        boot_id_path=settings.boot_id_file,
        partition=partition_policy(settings.mig_partitions, settings.driver_name),
        consumable=settings.consumable_capacity,
        on_inventory_changed=watch.deliver,  # MIG devices created or destroyed: publish now
        observer=metrics,
        on_prepared=claim_status.prepared,
        on_unprepared=claim_status.unprepared,
        on_idle=lambda: trimmer.idle(),
        mps=mps_daemons(settings, api),
        metadata=MetadataFiles(settings.plugins_dir / settings.driver_name)
        if settings.device_metadata
        else None,
        passthrough=passthrough,
    )
    trimmer = HeapTrimmer(lambda: preparer.busy)  # a burst's freed memory goes back to the kernel
    await preparer.start()  # before publishing: it knows which MIG devices are the driver's own
    await report_conflicts(
        JsonApi(api),
        preparer.recovery_conflicts,
        node_name=settings.node_name,
        node_uid=own_node_uid,
        driver=settings.driver_name,
    )
    await gpu_health.start()  # before publishing too: a faulty GPU is never offered untainted
    publish(watch.current)  # as the preparer's start left it (orphaned GPU instances destroyed)
    for ref, devices in preparer.prepared():  # a restarted plugin refreshes what it holds
        claim_status.prepared(ref, devices)
    if metrics is not None:
        metrics.follow(
            claim_status,
            published=lambda: publisher.published_devices,
            prepared=lambda: preparer.prepared_claims,
        )
    plugin = kubelet.plugin
    kubelet.claims.ready(preparer)  # the claim calls held since the sockets opened go on now

    # The second driver, compute-domain.<domain>, on nodes of a multi-node NVLink clique.
    compute_domains = compute_domain_plugin(settings, api, inventory, own_node_uid, rules)
    binding: BindingWatch | None = None

    def readiness() -> str | None:
        if not plugin.registration.registered.is_set():
            return plugin.registration.error or "not registered with the kubelet yet"
        # Published once, not in sync now: slices change at every MIG prepare (publisher.published).
        if not publisher.published or (compute_domains is not None and not compute_domains.synced):
            return "ResourceSlices not published yet"
        return None

    if status is not None:
        status.readiness = readiness
    tasks: list[asyncio.Task[None]] = []
    try:
        serving_domains = compute_domains is not None and await compute_domains.start()
        binding = binding_watch(settings, rules, api, preparer, compute_domains if serving_domains else None)
        log.info(
            "serving the kubelet",
            dra_socket=str(plugin.dra_socket),
            registration_socket=str(plugin.registration_socket),
            http_port=status.port if status else None,
            startup_seconds=round(time.monotonic() - started, 3),
        )
        # The collector was off while `dra-driver` imported (dra_driver.__main__): on again now. A
        # moment later, off the path of the kubelet's first (held) calls, start-up's objects are
        # frozen (a full collection: docs/performance.md) and what start-up freed goes back to the kernel.
        gc.enable()

        def settle() -> None:
            settle_collector()
            trimmer.idle()

        asyncio.get_running_loop().call_later(GC_SETTLE_DELAY_S, settle)
        tasks = [
            asyncio.create_task(publisher.run()),
            asyncio.create_task(watch.run()),
            asyncio.create_task(gpu_health.run()),
            asyncio.create_task(claim_status.run()),
            *([asyncio.create_task(labeller.run())] if labeller else []),
            *([asyncio.create_task(binding.run())] if binding else []),
        ]
        if compute_domains is not None:
            tasks += [asyncio.create_task(task) for task in compute_domains.tasks()]
        await _until_stopped(stop, tasks)
    finally:
        log.info("shutting down")
        if compute_domains is not None:
            await compute_domains.stop()
        await plugin.stop()
        if binding is not None:
            await binding.stop()
        await preparer.drain(DRAIN_SECONDS)  # before serve_node closes the backend and the API client
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task


GC_SETTLE_DELAY_S = (
    1.0  # after the daemon is ready: start-up's objects are frozen (dra_driver.gpu_plugin.tuning)
)


async def _until_stopped(stop: asyncio.Event, tasks: list[asyncio.Task[None]]) -> None:
    """Wait for the stop signal; a background task that dies is a bug worth exiting for."""
    stopper = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait([stopper, *tasks], return_when=asyncio.FIRST_COMPLETED)
    stopper.cancel()
    for task in done:
        if task is not stopper:
            task.result()  # re-raise what killed it
