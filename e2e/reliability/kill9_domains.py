"""kill -9 of the daemon in the compute-domain driver's prepare and unprepare (IMEX channel and daemon
claims), the runs of :mod:`e2e.reliability.kill9` for the kinds that driver prepares.

The node is a simulated GB200 NVL72 tray (``--simulate=gb200-tray``, one NVLink clique), so the daemon
serves the second driver, ``compute-domain.<domain>``, beside the GPU one; the kubelet's side
registers with both and sends these claims to the compute-domain socket. The API server has the
chart's ComputeDomain CRD and one ComputeDomain whose IMEX daemon is Ready on this node (the status
the controller would write), so a channel is prepared at once.

One run is one pod's life: a channel claim (allocationMode Single or All), often with the domain's
daemon claim beside it (the IMEX daemon pod's), prepared until each is, then unprepared until each is,
the daemon SIGKILLed once in between: at a random moment of a call, or at a crash point in the
compute-domain driver's path (before or after a transaction of the node's store: its start, a claim's
record, its completion, its release; before or after a CDI spec's write or removal). Some runs lose
the store before the start after the kill (deleted or overwritten), so that the claims are rebuilt
from their specs. In some runs a stale allocation of the same channel to a second claim is sent
while the first holds it: it must be refused.

Checked after the prepare: each claim the kubelet was told is prepared has its spec and its record
in the store; no device is in two claims' specs. After the unprepare: no spec, no record, no daemon
configuration directory and no node label left (``kill9.leaked_node_labels``).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from pathlib import Path
from typing import Any

import grpc

from bench.claims import AllocatedClaims
from bench.kubelet import register
from dra_driver.cdi.store import SpecStore
from dra_driver.computedomain.api import ChannelAllocationMode, Names, channel_config, daemon_config
from dra_driver.kubelet.pb.dra.v1 import dra_pb2_grpc
from dra_driver.node.store import STORE_FILE, DomainClaim, open_read_only
from dra_driver.node.types import ClaimRef
from e2e import manifests
from e2e.cluster import RestClient
from e2e.reliability.env import Env, SimNode
from e2e.reliability.plugin import DRIVER, CallResult, Plugin, PluginDied

NAMES = Names(DRIVER)
PROFILE = "gb200-tray"
CLUSTER_UUID = "4d3c2b1a-0f9e-4d8c-b7a6-5f4e3d2c1b0a"
CLIQUE = f"{CLUSTER_UUID}.1"
RETRIES = 8
KINDS = ("compute-domain-channel", "compute-domain-channel-all", "compute-domain-daemon")
# Where the compute-domain driver's prepare and unprepare pass (the GPU driver's own, MIG and vfio, not).
_POINTS = ("store.before_commit", "store.after_commit", "cdi.before_rename", "cdi.after_write",
           "cdi.before_remove", "cdi.after_remove")  # fmt: skip


class DomainPlugin(Plugin):
    """The daemon, with the kubelet's side registered on the compute-domain driver's socket."""

    @property
    def domain_registration_socket(self) -> Path:
        return self.paths.registry / f"{NAMES.driver}-reg.sock"

    async def start(self, crash_point: str | None = None) -> None:
        self.domain_registration_socket.unlink(missing_ok=True)
        await super().start(crash_point)
        # The compute-domain driver opens its socket once its start (the store's repair) is done.
        await self._until(self.domain_registration_socket.exists, time.monotonic() + 60.0)
        try:
            endpoint = await register(self.domain_registration_socket, NAMES.driver)
        except Exception:
            self._check_alive(time.monotonic() + 60.0)
            raise
        await self.close_channel()
        self._channel = grpc.aio.insecure_channel(f"unix:{endpoint}")
        self._stub = dra_pb2_grpc.DRAPluginStub(self._channel)


async def run(env: Env, runs: int, seed: int, figures: Any) -> None:
    """``runs`` runs, counted into ``figures`` (:class:`e2e.reliability.kill9.Kill9Figures`)."""
    rng = random.Random(seed ^ 0xCD)
    node = env.node("rel-cd")
    rest = env.cluster.rest()
    domain_uid = await asyncio.to_thread(_create_domain, rest, node)
    claims = AllocatedClaims(rest, NAMES.driver, node.name)
    plugin = DomainPlugin(
        kubeconfig=env.cluster.kubeconfig,
        node=node.name,
        paths=node.paths(),
        log=env.base / node.name / "daemon.log",
        extra_args=(f"--simulate-fabric={CLUSTER_UUID}/1",),
        profile=PROFILE,
    )
    (env.base / node.name).mkdir(parents=True, exist_ok=True)
    try:
        for number in range(runs):
            await _one_run(node, rest, plugin, claims, domain_uid, figures, number, rng)
            figures.runs += 1
    finally:
        await plugin.stop()


def install_crds(rest: RestClient) -> None:
    """The chart's ComputeDomain CRDs (under the driver's own name), as ``helm install`` creates them."""
    for obj in manifests.rendered_chart("rel", "dra-driver-gpu", f"driverName={DRIVER}"):
        if obj["kind"] == "CustomResourceDefinition":
            rest.create(manifests.CRDS, obj)
            manifests.wait_established(rest, obj["metadata"]["name"])


def _create_domain(rest: RestClient, node: SimNode) -> str:
    """A ComputeDomain in the node's namespace whose IMEX daemon is Ready on the node; its uid."""
    install_crds(rest)
    collection = f"/apis/{NAMES.api_version}/namespaces/{node.name}/computedomains"
    created = rest.create(
        collection,
        {
            "apiVersion": NAMES.api_version,
            "kind": "ComputeDomain",
            "metadata": {"name": "domain"},
            "spec": {"numNodes": 1, "channel": {"resourceClaimTemplate": {"name": "domain-channel"}}},
        },
    )
    ready = {"name": node.name, "ipAddress": "10.0.0.1", "cliqueID": CLIQUE, "index": 0, "status": "Ready"}
    rest.request(
        "PATCH",
        f"{collection}/domain/status",
        {"status": {"status": "Ready", "nodes": [ready]}},
        content_type="application/merge-patch+json",
    )
    return str(created["metadata"]["uid"])


async def _one_run(
    node: SimNode,
    rest: RestClient,
    plugin: DomainPlugin,
    allocated: AllocatedClaims,
    domain_uid: str,
    figures: Any,
    number: int,
    rng: random.Random,
) -> None:
    mode = ChannelAllocationMode.ALL if number % 3 == 1 else ChannelAllocationMode.SINGLE
    kinds = [KINDS[1] if mode is ChannelAllocationMode.ALL else KINDS[0]]
    if number % 3 == 2 or rng.random() < 0.5:
        kinds.append(KINDS[2])

    def create(kind: str, name: str) -> ClaimRef:
        if kind == KINDS[2]:
            config = daemon_config(NAMES, domain_uid)
            return allocated.create(node.name, name, "daemon-0", admin_access=False, config=config)
        config = channel_config(NAMES, domain_uid, mode)
        return allocated.create(node.name, name, "channel-0", admin_access=False, config=config)

    claims = await asyncio.to_thread(lambda: [create(k, f"cd{number}-{i}") for i, k in enumerate(kinds)])
    stale = await asyncio.to_thread(create, KINDS[0], f"cd{number}-stale") if rng.random() < 0.3 else None
    figures.claims_by_kind.update(kinds)
    label = f"compute-domain run {number} ({', '.join(kinds)})"

    crash_point, external = None, None
    if rng.random() < 0.7:
        point = rng.choice(_POINTS)
        # The store: the two starts' transactions, then per claim its record, its completion, its
        # release; a spec: one write per claim, one removal per claim.
        hits = 3 + 3 * len(claims) if point.startswith("store.") else len(claims)
        crash_point = f"{point}@{rng.randint(1, hits)}"
    else:
        external = (rng.choice(("prepare", "unprepare")), rng.uniform(0.0, 0.05))
    store_loss = rng.choice(("deleted", "corrupted")) if rng.random() < 0.2 else None
    killed = store_lost = False

    async def start(point: str | None) -> None:
        nonlocal killed
        try:
            await plugin.start(point)
            return
        except PluginDied:
            killed = True
        await restart()

    async def restart() -> None:
        nonlocal killed, store_lost
        killed = True
        plugin.reap()
        if store_loss and not store_lost:
            _lose_store(plugin, store_loss)
            figures.store_losses[store_loss] += 1
            store_lost = True
        await plugin.start(None)

    async def call(operation: str, refs: list[ClaimRef], first: bool) -> CallResult:
        send = plugin.prepare if operation == "prepare" else plugin.unprepare
        if not plugin.running:
            await restart()
        if first and external is not None and external[0] == operation:
            task = asyncio.create_task(send(refs))
            await asyncio.sleep(external[1])
            plugin.kill()
            result = await task
        else:
            result = await send(refs)
        if not plugin.running:
            await restart()
        return result

    await start(crash_point)
    told_prepared: set[str] = set()
    pending = list(claims)
    for attempt in range(RETRIES):
        result = await call("prepare", pending, attempt == 0)
        told_prepared |= {c.uid for c in pending if result.ok(c.uid)}
        pending = [c for c in claims if c.uid not in told_prepared]
        if not pending:
            break
        await asyncio.sleep(0.1)
    if pending:
        figures.failed_claims += len(pending)
        figures.problems.append(f"{label}: prepare never succeeded: {result}")
    if stale is not None:
        refused = await call("prepare", [stale], False)
        if refused.ok(stale.uid) and claims[0].uid in told_prepared:
            figures.double_allocations += 1
            figures.problems.append(f"{label}: a second claim of channel-0 was prepared")
    _check_prepared(plugin, claims, told_prepared, store_lost, figures, label)

    everything = [*claims, *([stale] if stale else [])]
    pending = list(everything)
    for attempt in range(RETRIES):
        result = await call("unprepare", pending, attempt == 0)
        pending = [c for c in pending if not result.ok(c.uid)]
        if not pending:
            break
        await asyncio.sleep(0.1)
    if pending:
        figures.failed_claims += len(pending)
        figures.problems.append(f"{label}: unprepare never succeeded: {result}")
    await plugin.stop()
    _check_released(rest, node, plugin, figures, label)
    if killed:
        figures.kills += 1
        operation = external[0] if external else ""
        figures.killed_at[
            crash_point.partition("@")[0] if crash_point else f"random moment of {operation}"
        ] += 1


def _records(plugin: Plugin) -> dict[str, DomainClaim]:
    path = plugin.paths.data / STORE_FILE
    if not path.exists():
        return {}
    store = open_read_only(path)
    try:
        return {c.uid: c for c in store.domain_claims()}
    finally:
        store.close()


def _spec_devices(plugin: Plugin) -> dict[str, list[str]]:
    """Per claim uid with a spec of the compute-domain driver: the devices it names."""
    specs = SpecStore(plugin.paths.cdi, NAMES.driver)
    found = {}
    for uid in specs.claim_uids():
        spec = specs.read(uid) or {}
        found[uid] = [str(d["name"]).removeprefix(f"{uid}-") for d in spec.get("devices", [])]
    return found


def _check_prepared(
    plugin: Plugin, claims: list[ClaimRef], told: set[str], store_lost: bool, figures: Any, label: str
) -> None:
    records, specs = _records(plugin), _spec_devices(plugin)
    phases = ("PrepareCompleted", "Recovered") if store_lost else ("PrepareCompleted",)
    for claim in claims:
        if claim.uid not in told:
            continue
        record = records.get(claim.uid)
        problem = "no CDI spec" if claim.uid not in specs else None
        if problem is None and (record is None or record.phase not in phases):
            problem = f"record {record.phase if record else 'missing'}"
        if problem:
            figures.lost_claims += 1
            figures.problems.append(f"{label}: prepared claim {claim.uid}: {problem}")
    holders = Counter(device for devices in specs.values() for device in devices)
    for device, count in holders.items():
        if count > 1:
            figures.double_allocations += 1
            figures.problems.append(f"{label}: {device} is in {count} claims' specs")


def _check_released(rest: RestClient, node: SimNode, plugin: Plugin, figures: Any, label: str) -> None:
    records, specs = _records(plugin), _spec_devices(plugin)
    configs = plugin.paths.data / "compute-domains" / "domains"
    directories = sorted(p.name for p in configs.glob("*")) if configs.is_dir() else []
    labels = rest.get(f"/api/v1/nodes/{node.name}")["metadata"].get("labels") or {}
    left_label = labels.get(NAMES.label)
    figures.leaked_specs += len(specs)
    figures.leaked_records += len(records) + len(directories)
    figures.leaked_node_labels += bool(left_label)
    if specs or records or directories or left_label:
        figures.problems.append(
            f"{label}: left behind specs {sorted(specs)}, records {sorted(records)}, daemon directories "
            f"{directories}, node label {left_label}"
        )
        _reset(rest, node, plugin)


def _lose_store(plugin: Plugin, how: str) -> None:
    store = plugin.paths.data / STORE_FILE
    for companion in plugin.paths.data.glob(f"{STORE_FILE}-*"):
        companion.unlink()
    if how == "deleted":
        store.unlink(missing_ok=True)
    else:
        store.write_bytes(b"not a database, after a disk fault " * 200)


def _reset(rest: RestClient, node: SimNode, plugin: Plugin) -> None:
    """Wipe what a run left, so that one leak is counted once."""
    specs = SpecStore(plugin.paths.cdi, NAMES.driver)
    for uid in specs.claim_uids():
        specs.remove(uid)
    for store_file in plugin.paths.data.glob(f"{STORE_FILE}*"):
        store_file.unlink()
    rest.request(
        "PATCH",
        f"/api/v1/nodes/{node.name}",
        {"metadata": {"labels": {NAMES.label: None}}},
        content_type="application/merge-patch+json",
    )
