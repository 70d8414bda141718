"""Binding conditions for a ComputeDomain's channel: the node labels itself and waits for its IMEX
daemon before the scheduler binds the workload pod, answers Ready or PrepareFailed, hands what it
did to the kubelet's prepare, and undoes it for a pod that never comes.

The node is the compute-domain preparer on a real store and CDI directory, watched by the real
binding watcher; the API server is the in-memory domains of the node tests and a recorder of the
status writes; time is fake, so the waits of 60 s and 300 s take none.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from dra_driver.cdi.store import SpecStore
from dra_driver.computedomain.api import (
    ChannelAllocationMode,
    ComputeDomainNode,
    channel_config,
    daemon_failures_message,
)
from dra_driver.computedomain.node import ComputeDomainPreparer, compute_domain_slices
from dra_driver.computedomain.plugin import ComputeDomainPlugin
from dra_driver.devices.types import Inventory
from dra_driver.gpu_plugin.watches import binding_watch
from dra_driver.node.binding import BindingWatcher
from dra_driver.node.store import STORE_FILE, open_store
from dra_driver.resources.server_rules import NEWEST, rules_for
from dra_driver.settings import BindingConditions, Settings
from tests.computedomain.test_node import BOOT, CLIQUE, NAMES, NODE, FakeDomains, domain
from tests.node.builders import InMemoryClaims, claim_json, new_ref, opaque, result
from tests.node.test_binding import RecordedStatus

WAITING = {"bindingConditions": ["Ready"], "bindingFailureConditions": ["PrepareFailed"]}


class FakeTime:
    """The preparer's clock and sleep: a sleep moves the clock on, then runs what the test scheduled
    for that moment (a daemon turning Ready, failing, the domain going)."""

    def __init__(self) -> None:
        self.now = 0.0
        self._at: list[tuple[float, Callable[[], None]]] = []

    def clock(self) -> float:
        return self.now

    def at(self, when: float, change: Callable[[], None]) -> None:
        self._at.append((when, change))

    async def sleep(self, seconds: float) -> None:
        self.now += seconds
        for when, change in [(w, c) for w, c in self._at if w <= self.now]:
            self._at.remove((when, change))
            change()


class Channel:
    """One node of a domain with a workload's channel claim the scheduler allocated and waits on."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.domain = domain()
        self.domains = FakeDomains(self.domain)
        self.claims = InMemoryClaims()
        self.time = FakeTime()
        self.status = RecordedStatus()
        self.preparer = self.started()
        self.watcher = self.watching(self.preparer)
        self.ref = new_ref("worker-channel")
        self.claim = self.waiting_claim()
        self.claims.put(self.claim)

    def started(self) -> ComputeDomainPreparer:
        node = ComputeDomainPreparer(
            names=NAMES,
            node_name=NODE,
            clique=CLIQUE,
            claims=self.claims,
            domains=self.domains,
            specs=SpecStore(self.tmp_path / "cdi", NAMES.driver),
            store=open_store(self.tmp_path / STORE_FILE, BOOT).store,
            state_dir=self.tmp_path / "compute-domains",
            channel_major=234,
            clock=self.time.clock,
            sleep=self.time.sleep,
        )
        node.start(BOOT)
        return node

    def watching(self, preparer: ComputeDomainPreparer) -> BindingWatcher:
        return BindingWatcher(preparer, self.status, driver_name=NAMES.driver, pool=NODE, retry_initial=0.01)

    def waiting_claim(self) -> dict[str, Any]:
        config = opaque(
            channel_config(NAMES, self.domain.metadata.uid, ChannelAllocationMode.SINGLE), driver=NAMES.driver
        )
        channel = result("channel-0", "channel", driver=NAMES.driver, pool=NODE) | WAITING
        return claim_json(self.ref, [channel], [config])

    def daemon(self, status: str) -> Callable[[], None]:
        def change() -> None:
            self.domain.status.nodes = [ComputeDomainNode.model_validate({"name": NODE, "status": status})]

        return change

    def failing(self, why: str) -> Callable[[], None]:
        """The controller's report of this node's daemon failing (the domain's Ready condition)."""

        def change() -> None:
            message = daemon_failures_message({"tray-2": "another node's trouble", NODE: why})
            self.domain.status.conditions = [
                {"type": "Ready", "status": "False", "reason": "DaemonFailed", "message": message}
            ]

        return change

    def recovered(self) -> None:
        self.domain.status.conditions = []

    async def allocated(self) -> None:
        await self.watcher.on_event("ADDED", self.claim)
        await self.watcher.idle()

    def conditions(self) -> dict[str, dict[str, Any]]:
        return self.status.conditions(self.ref.uid)

    def phase(self) -> str | None:
        record = self.preparer.prepared_ahead(self.ref.uid)
        return record.phase if record else None

    def specs(self) -> set[str]:
        return SpecStore(self.tmp_path / "cdi", NAMES.driver).claim_uids()

    def left_nothing(self) -> bool:
        return self.domains.labels == {} and self.preparer.prepared_claim_uids() == set() and not self.specs()


def test_the_channel_waits_for_its_daemon_only_where_binding_conditions_are_on() -> None:
    (on,) = compute_domain_slices(CLIQUE, binding_conditions=True)
    devices = {d["name"]: d for d in on.devices}
    assert devices["channel-0"]["bindingConditions"] == ["Ready"]
    assert devices["channel-0"]["bindingFailureConditions"] == ["PrepareFailed"]
    assert "bindingConditions" not in devices["daemon-0"]  # its pod is what the channel waits for
    (off,) = compute_domain_slices(CLIQUE)
    assert not any("bindingConditions" in d for d in off.devices)


def plugin(tmp_path: Path, *, binding_conditions: bool, host_managed: bool) -> ComputeDomainPlugin:
    made = ComputeDomainPlugin(
        gpu_driver="gpu.nvidia.com",
        node_name=NODE,
        node_uid=None,
        api=None,  # type: ignore[arg-type]
        inventory=Inventory(gpus=(), driver_version="", cuda_driver_version=""),
        state_dir=tmp_path,
        store_path=tmp_path / STORE_FILE,
        boot_id_path=tmp_path / "boot_id",
        cdi_dir=tmp_path,
        plugins_dir=tmp_path,
        registry_dir=tmp_path,
        pod_uid=None,
        simulated=True,
        host_imex=object() if host_managed else None,  # type: ignore[arg-type]
        binding_conditions=binding_conditions,
    )
    made.preparer = object()  # type: ignore[assignment]  # started
    return made


def test_no_channel_binding_conditions_in_the_host_managed_mode_or_with_the_gate_off(tmp_path: Path) -> None:
    """The host-managed mode checks the host's daemon at the kubelet's prepare; off or an API server
    older than 1.36 under auto is the behaviour of earlier versions: no watcher for the channel."""
    assert plugin(tmp_path, binding_conditions=True, host_managed=False).binding_conditions
    assert not plugin(tmp_path, binding_conditions=True, host_managed=True).binding_conditions
    assert not plugin(tmp_path, binding_conditions=False, host_managed=False).binding_conditions

    def watched(settings: Settings, version: str, host_managed: bool) -> list[str]:
        cds = plugin(tmp_path, binding_conditions=True, host_managed=host_managed)
        watch = binding_watch(settings, rules_for(version), None, None, cds)  # type: ignore[arg-type]
        return [w._driver for w in watch.watchers] if watch else []

    auto = Settings(node_name=NODE, driver_name="gpu.nvidia.com")
    both = ["gpu.nvidia.com", "compute-domain.nvidia.com"]
    assert watched(auto, "v1.36.3", host_managed=False) == both
    assert watched(auto, "v1.36.3", host_managed=True) == ["gpu.nvidia.com"]
    assert watched(auto, "v1.35.4", host_managed=False) == []
    off = auto.model_copy(update={"binding_conditions": BindingConditions.OFF})
    assert watched(off, "v1.36.3", host_managed=False) == []
    assert NEWEST.binding_conditions


async def test_the_pod_is_bound_once_the_nodes_daemon_is_ready(tmp_path: Path) -> None:
    node = Channel(tmp_path)
    node.time.at(2.0, node.daemon("NotReady"))  # the daemon pod started, not connected yet
    node.time.at(7.0, node.daemon("Ready"))

    await node.allocated()

    ready = node.conditions()["Ready"]
    assert (ready["status"], ready["reason"]) == ("True", "Prepared")
    assert node.status.managers == {f"{NAMES.driver}/binding"}
    assert node.time.now == 7.0  # polled every second until then
    assert node.domains.labels == {NODE: node.domain.metadata.uid}  # what brought the daemon here
    assert node.phase() == "PreparedAhead"
    assert node.specs() == {node.ref.uid}


async def test_a_daemon_failing_for_60_seconds_fails_the_binding_and_leaves_nothing(tmp_path: Path) -> None:
    node = Channel(tmp_path)
    node.time.at(1.0, node.failing("peer port 50000 in use"))
    node.time.at(31.0, node.recovered)  # a moment's trouble: the 60 s start again
    node.time.at(41.0, node.failing("peer port 50000 in use"))

    await node.allocated()

    failed = node.conditions()["PrepareFailed"]
    assert failed["status"] == "True"
    assert failed["message"] == (
        "the IMEX daemon of ComputeDomain default/cd on node tray-1 failed for 60s: peer port 50000 in use"
    )
    assert "Ready" not in node.conditions()
    assert node.time.now == 101.0
    assert node.left_nothing()  # the label went: the scheduler may place the pod elsewhere


async def test_a_daemon_not_ready_in_300_seconds_fails_the_binding(tmp_path: Path) -> None:
    node = Channel(tmp_path)
    node.time.at(10.0, node.daemon("NotReady"))

    await node.allocated()

    assert node.conditions()["PrepareFailed"]["message"] == (
        "the IMEX daemon of ComputeDomain default/cd on node tray-1 was not ready within 300s (NotReady)"
    )
    assert node.time.now == 300.0
    assert node.left_nothing()


async def test_a_domain_deleted_meanwhile_fails_the_binding(tmp_path: Path) -> None:
    node = Channel(tmp_path)
    node.time.at(3.0, lambda: node.domains.domains.clear())

    await node.allocated()

    assert node.conditions()["PrepareFailed"]["message"] == (
        f"ComputeDomain default/cd no longer exists; claim {node.ref} cannot get its channel"
    )
    assert node.left_nothing()


async def test_the_kubelets_prepare_takes_over_the_channel_prepared_ahead(tmp_path: Path) -> None:
    node = Channel(tmp_path)
    node.time.at(1.0, node.daemon("Ready"))
    await node.allocated()
    before = node.time.now

    (device,) = (await node.preparer.prepare([node.ref]))[node.ref.uid]  # type: ignore[misc]

    assert device.cdi_device_ids == (f"k8s.{NAMES.driver}/claim={node.ref.uid}-channel-0",)
    assert node.time.now == before  # found done: no wait, no second label
    assert node.preparer.prepared_ahead(node.ref.uid) is None  # the kubelet's now
    assert node.preparer.ahead_of_binding() == {}
    # The pod ended and the claim was deallocated before the kubelet unprepared: its unprepare undoes it.
    await node.watcher.on_event("MODIFIED", claim_json(node.ref))
    await node.watcher.idle()
    assert node.domains.labels == {NODE: node.domain.metadata.uid}
    assert await node.preparer.unprepare([node.ref]) == {node.ref.uid: None}
    assert node.left_nothing()


async def test_a_channel_whose_pod_never_comes_is_undone(tmp_path: Path) -> None:
    """The scheduler's bindingTimeout, or the pod deleted, after the daemon was ready: the allocation
    is taken back or the claim goes, and the node leaves the domain."""
    node = Channel(tmp_path)
    node.time.at(1.0, node.daemon("Ready"))
    await node.allocated()
    assert node.phase() == "PreparedAhead"

    await node.watcher.on_event("MODIFIED", claim_json(node.ref))  # deallocated
    await node.watcher.idle()

    assert node.left_nothing()


async def test_after_a_restart_the_listing_undoes_a_channel_whose_claim_went_meanwhile(
    tmp_path: Path,
) -> None:
    node = Channel(tmp_path)
    node.time.at(1.0, node.daemon("Ready"))
    await node.allocated()

    restarted = node.watching(node.started())  # the plugin restarted; the claim was deleted meanwhile
    restarted.on_listed([])
    await restarted.idle()

    assert node.left_nothing()
