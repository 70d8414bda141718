"""kill -9 of the daemon at random points of prepare and unprepare, and at each of its own steps.

One run is one pod's life on the node, as the kubelet drives it: NodePrepareResources for the
pod's claims until every claim is prepared, then NodeUnprepareResources until every claim is
unprepared, the daemon SIGKILLed once somewhere in between. The kill comes either from outside,
at a random moment of the prepare or the unprepare call, or from inside, at a test crash point
(:mod:`dra_driver.crashpoint`): before or after a transaction of the node's store (a claim's
record, the table of MIG devices, the recovery's at start-up), a CDI spec write or removal,
a MIG device's creation or destruction, at a random one of its hits. The daemon is then started
again on the same directories and the run goes on as the kubelet would: it retries the call that
failed (or, as when the pod was deleted meanwhile, goes straight to unprepare). A run whose kill
comes from a crash point starts the daemon with it armed; any other run is served by the daemon
started after the last run's kill (a restart per run cost the CI subset half its time).

The pod's claims are of every kind the node prepares (:data:`KINDS`), drawn as the scheduler
would place them (no two exclusive claims of one memory slice): a full GPU, a 1g.10gb MIG device
that prepare creates (dynamic MIG), the administrator's 3g.40gb MIG device on gpu-0 (static MIG),
a share of a GPU (consumable capacity: a ``shareID`` and 10Gi of its memory), a full GPU with a
TimeSlicing or an MPS config, admin access (a monitoring container's) to a GPU or to the static
MIG device, most often beside the claim that holds it, and a GPU passed through to a virtual
machine (``gpu-vfio-<index>``: prepare binds it to vfio-pci in the simulated node's sysfs tree,
unprepare back to nvidia) on a GPU no other claim of the pod holds, as the scheduler places it
(its counters are the whole GPU's). Run ``n`` always has a claim of kind ``KINDS[n % len(KINDS)]``,
so a short run covers every kind. The daemon runs with ``--consumable-capacity`` and
``--passthrough``, as it must to prepare shares and passthrough devices.

Some runs add what a node goes through less often:

* **two instances** (a rolling update): a second daemon (``--pod-uid``) serves beside the first on
  the same directories, each call's claims are split between them at random, and the first is the
  one killed; the other keeps serving while it is down and while it recovers;
* **the store lost**: after the kill, the node's store is deleted or overwritten with garbage
  before the daemon starts again, so that it rebuilds every claim from its CDI spec; and in most
  of those runs that rebuild is itself killed (a crash point armed at its first hit), so the
  next start repairs a half-done repair.

After the prepare has succeeded everything the kubelet was told is checked (each claim has its
CDI spec and a record, each dynamic MIG device it names exists, no memory slice of a GPU is held by
two exclusive claims, no GPU both shared and held, or passed through and held by another claim),
and that a GPU is on vfio-pci exactly while a passthrough claim's record holds it, and the
GPU of every passthrough claim prepared is there (its ``driver`` link in the sysfs tree); after the
unprepare has succeeded, that nothing is left: no spec, no record, no MIG device but the
administrator's, no MPS daemon, every GPU's compute mode and time slice back (unless the store that
said what to put back was lost), every GPU back on nvidia. A MIG device that the driver had
created but no CDI spec named yet when the store was lost cannot be told from an administrator's:
it stays, and is counted apart (``kill9.mig_kept_after_store_loss``). A GPU on vfio-pci that no
spec names when the store is lost would be the same (``kill9.vfio_kept_after_store_loss``: the
driver would leave it to an administrator, and the claim's retried prepare be refused, not counted
as failed); but prepare writes the spec before the GPU leaves nvidia, so its goal is 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import uuid
from collections import Counter
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dra_driver.cdi.store import SpecStore
from dra_driver.crashpoint import POINTS
from dra_driver.devices.pci import NVIDIA, VFIO_PCI, PciBus
from dra_driver.devices.types import ComputePolicy
from dra_driver.node.config import API_VERSION
from dra_driver.node.types import ClaimRef
from dra_driver.simulated.gpus import SimulatedBackend
from dra_driver.simulated.mps_daemons import LocalMpsDaemons
from dra_driver.simulated.sysfs import SimulatedKernel
from e2e.driver import DriverPaths
from e2e.reliability import kill9_domains
from e2e.reliability.env import Env, SimNode
from e2e.reliability.plugin import (
    DRIVER,
    MPS_DIR,
    PROFILE,
    STORE_FILE_NAME,
    CallResult,
    NodeState,
    Plugin,
    PluginDied,
    sysfs_root,
)

MIG_PROFILE = "1g10gb-19"  # H100 1g.10gb: profile id 19, placements 0..6
STATIC_MIG = "gpu-0-mig-3g40gb-9-0"  # the administrator's 3g.40gb on gpu-0 (profile id 9), slices 0..3
SHARE_MEMORY = "10Gi"
RETRIES = 8  # the kubelet retries forever; a claim that needs more than this is counted as failed
SECOND_POD_UID = "second-pod"  # the other instance of a two-instance run
# Shares and passthrough devices are prepared only on a node that publishes them.
DAEMON_ARGS = ("--consumable-capacity", "--passthrough")

KINDS = (
    "gpu", "mig-dynamic", "mig-static", "share", "time-slicing", "mps", "admin-gpu", "admin-mig",
    "passthrough",
)  # fmt: skip
# How often each kind is drawn for a pod's further claims (the first is KINDS[run % len(KINDS)]).
_WEIGHTS = {
    "gpu": 3, "mig-dynamic": 3, "mig-static": 1, "share": 2, "time-slicing": 1, "mps": 1, "passthrough": 1,
}  # fmt: skip
_WHOLE_GPUS = range(1, 8)  # gpu-0 is in MIG mode (the static MIG device): never given whole
_TIME_SLICES = ("Short", "Medium", "Long")

_MIG_POINTS = {p for p in POINTS if p.startswith("mig.")}
_VFIO_POINTS = {p for p in POINTS if p.startswith("vfio.")}
# What a start-up that repairs the state writes through (the store's or the checkpoint's points); a
# start with nothing to repair passes none of them, and the daemon dies there later in the run.
_RECOVERY_POINTS = [p for p in POINTS if p.startswith(("store.", "datafile.", "journal."))] or list(POINTS)
_STORE_LOSSES = ("deleted", "corrupted")


@dataclass
class Kill9Figures:
    runs: int = 0
    kills: int = 0  # runs in which the daemon really died (a crash point may not be reached)
    kills_during_recovery: int = 0  # the daemon started after a kill died again while it recovered
    kills_during_recovery_after_store_loss: int = 0  # ... while it rebuilt a lost store from the specs
    two_instance_runs: int = 0
    leaked_specs: int = 0
    leaked_mig: int = 0
    leaked_records: int = 0
    leaked_mps_daemons: int = 0
    settings_not_restored: int = 0  # GPUs left at a claim's compute mode or time slice
    lost_claims: int = 0
    double_allocations: int = 0
    failed_claims: int = 0  # claims not prepared or unprepared within RETRIES retries
    leftover_temp_files: int = 0  # half-written specs still there after the restart
    static_mig_lost: int = 0  # runs after which the administrator's MIG device was gone
    mig_kept_after_store_loss: int = 0  # the driver's, made before the loss but named by no spec yet
    # GPUs found where no claim says: on vfio-pci with no passthrough claim holding them, or a prepared
    # passthrough claim's GPU not there
    wrong_bindings: int = 0
    leaked_vfio: int = 0  # GPUs still off nvidia after the unprepare
    vfio_kept_after_store_loss: int = 0  # bound before the loss, named by no spec: never (goal 0)
    leaked_node_labels: int = 0  # a ComputeDomain's label left on the node after its channel's unprepare
    killed_at: Counter[str] = field(default_factory=Counter)
    claims_by_kind: Counter[str] = field(default_factory=Counter)
    store_losses: Counter[str] = field(default_factory=Counter)  # "deleted" / "corrupted": applied
    problems: list[str] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return {
            "kill9.runs": self.runs,
            "kill9.kills": self.kills,
            "kill9.kills_during_recovery": self.kills_during_recovery,
            "kill9.kills_during_recovery_after_store_loss": self.kills_during_recovery_after_store_loss,
            "kill9.two_instance_runs": self.two_instance_runs,
            "kill9.leaked_specs": self.leaked_specs,
            "kill9.leaked_mig": self.leaked_mig,
            "kill9.leaked_records": self.leaked_records,
            "kill9.leaked_mps_daemons": self.leaked_mps_daemons,
            "kill9.settings_not_restored": self.settings_not_restored,
            "kill9.lost_claims": self.lost_claims,
            "kill9.double_allocations": self.double_allocations,
            "kill9.failed_claims": self.failed_claims,
            "kill9.leftover_temp_files": self.leftover_temp_files,
            "kill9.static_mig_lost": self.static_mig_lost,
            "kill9.mig_kept_after_store_loss": self.mig_kept_after_store_loss,
            "kill9.wrong_bindings": self.wrong_bindings,
            "kill9.leaked_vfio": self.leaked_vfio,
            "kill9.vfio_kept_after_store_loss": self.vfio_kept_after_store_loss,
            "kill9.leaked_node_labels": self.leaked_node_labels,
            "kill9.killed_at": dict(sorted(self.killed_at.items())),
            "kill9.kinds": sorted(self.claims_by_kind),
            "kill9.claims_by_kind": dict(sorted(self.claims_by_kind.items())),
            "kill9.store_losses": dict(sorted(self.store_losses.items())),
            "kill9.problems": self.problems[:20],
        }


@dataclass(frozen=True)
class ClaimPlan:
    kind: str  # one of KINDS
    device: str  # what the scheduler allocated: "gpu-3", "gpu-3-mig-1g10gb-19-4", "gpu-vfio-3", ...


@dataclass(frozen=True)
class Plan:
    claims: tuple[ClaimPlan, ...]
    crash_point: str | None  # armed in the daemon, "<point>@<n>"
    external_kill: tuple[str, float] | None  # ("prepare" | "unprepare", seconds after the call)
    pod_deleted_after_kill: bool  # skip the retried prepare, as when the pod was deleted meanwhile
    # armed in the daemon started after the kill ("<point>@1"): it may die again while it recovers
    recovery_crash_point: str | None = None
    second_instance: bool = False  # another instance serves beside the one killed
    store_loss: str | None = None  # "deleted" | "corrupted": the store, before the start after the kill


class _Placement:
    """What a pod's claims hold so far, so that the next one is drawn where the scheduler could put it."""

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng
        self.whole: set[int] = set()  # GPUs held whole (full GPU, time-slicing, MPS)
        self.shares: Counter[int] = Counter()  # shares per GPU
        self.slices: dict[int, set[int]] = {}  # dynamic MIG placements per GPU
        self.static = False  # the static MIG device is taken
        self.passed_through: set[int] = set()  # GPUs given whole to a virtual machine

    def _free(self, gpu: int) -> bool:
        return (
            gpu not in self.whole
            and gpu not in self.passed_through
            and not self.shares[gpu]
            and not self.slices.get(gpu)
        )

    def place(self, kind: str) -> ClaimPlan:
        """A device for ``kind``; a full GPU when nothing of that kind is left in this pod."""
        device = self._device(kind)
        return ClaimPlan(kind, device) if device else ClaimPlan("gpu", self._device("gpu") or "gpu-1")

    def _device(self, kind: str) -> str | None:
        rng = self._rng
        if kind in ("gpu", "time-slicing", "mps"):
            free = [g for g in _WHOLE_GPUS if self._free(g)]
            if not free:
                return None
            gpu = rng.choice(free)
            self.whole.add(gpu)
            return f"gpu-{gpu}"
        if kind == "passthrough":  # the GPU's whole counter set: nothing else of the GPU beside it
            free = [g for g in _WHOLE_GPUS if self._free(g)]
            if not free:
                return None
            gpu = rng.choice(free)
            self.passed_through.add(gpu)
            return f"gpu-vfio-{gpu}"  # the simulated DGX H100's GPUs are numbered in PCI order
        if kind == "share":  # up to two shares of one GPU in a pod; often a second on the same GPU
            open_ = [g for g in _WHOLE_GPUS if self.shares[g] == 1] if rng.random() < 0.5 else []
            free = open_ or [g for g in _WHOLE_GPUS if self._free(g)]
            if not free:
                return None
            gpu = rng.choice(free)
            self.shares[gpu] += 1
            return f"gpu-{gpu}"
        if kind == "mig-dynamic":
            places = [
                (g, start)
                for g in range(8)
                if g not in self.whole and g not in self.passed_through and not self.shares[g]
                for start in (range(4, 7) if g == 0 else range(7))  # gpu-0: beside the static device
                if start not in self.slices.get(g, set())
            ]
            gpu, start = rng.choice(places)
            self.slices.setdefault(gpu, set()).add(start)
            return f"gpu-{gpu}-mig-{MIG_PROFILE}-{start}"
        if kind == "mig-static":
            if self.static:
                return None
            self.static = True
            return STATIC_MIG
        if kind == "admin-gpu":  # most often a GPU another claim of the pod holds
            if self.whole and rng.random() < 0.8:
                return f"gpu-{rng.choice(sorted(self.whole))}"
            # Not a GPU on vfio-pci: NVML, and so the slice, no longer has it.
            return f"gpu-{rng.choice([g for g in _WHOLE_GPUS if self._free(g) or g in self.whole])}"
        assert kind == "admin-mig", kind
        return STATIC_MIG


@dataclass(frozen=True)
class Focus:
    """What every run is drawn from: by default every kind and crash point (``make reliability``);
    narrower to hammer one (``python -m e2e.reliability --only kill9 --kinds passthrough``)."""

    kinds: tuple[str, ...] = KINDS  # run ``n``'s first claim is of kind ``kinds[n % len(kinds)]``
    points: tuple[str, ...] = POINTS  # the crash points a run may arm (those its claims reach)

    def __post_init__(self) -> None:
        if unknown := sorted(set(self.kinds) - set(KINDS)):
            raise ValueError(f"unknown claim kinds {unknown}; known: {', '.join(KINDS)}")
        if unknown := sorted(set(self.points) - set(POINTS)):
            raise ValueError(f"unknown crash points {unknown}; known: {', '.join(POINTS)}")
        if not (self.kinds and self.points):
            raise ValueError("a run needs a claim kind and a crash point to draw from")


EVERYTHING = Focus()


def plan_run(rng: random.Random, number: int, focus: Focus = EVERYTHING) -> Plan:
    placement = _Placement(rng)
    kinds = [focus.kinds[number % len(focus.kinds)]]
    kinds += rng.choices(list(_WEIGHTS), weights=list(_WEIGHTS.values()), k=rng.choice((0, 2)))
    if rng.random() < 0.4:  # a monitoring container beside the workload
        static_held = "mig-static" in kinds
        kinds.append("admin-mig" if rng.random() < (0.5 if static_held else 0.2) else "admin-gpu")
    # Workloads first, so that admin access most often goes to what one of them holds.
    ordered = sorted(kinds, key=lambda kind: kind.startswith("admin-"))
    claims = tuple(placement.place(kind) for kind in ordered)
    migs = sum(c.kind == "mig-dynamic" for c in claims)
    vfios = sum(c.kind == "passthrough" for c in claims)
    crash_point: str | None = None
    external: tuple[str, float] | None = None
    # Every seventh run (and a few more) with two instances; every seventh other run loses the store.
    second = number % 7 == 3 or (number % 7 != 5 and rng.random() < 0.15)
    store_loss = None
    if not second and (number % 7 == 5 or rng.random() < 0.15):
        store_loss = _STORE_LOSSES[number // 7 % 2] if number % 7 == 5 else rng.choice(_STORE_LOSSES)
    if rng.random() < 0.7 and not (store_loss and number % 7 == 5):
        points = [
            p for p in focus.points if (migs or p not in _MIG_POINTS) and (vfios or p not in _VFIO_POINTS)
        ]
        # A focus on points this pod's claims never reach (MIG or vfio) arms one they do.
        point = rng.choice(points or [p for p in POINTS if p not in _MIG_POINTS | _VFIO_POINTS])
        if point.startswith("store."):
            # Per claim its record (one step, or Reserve + Progress per MIG device, MPS daemon or GPU
            # setting + Complete) and its Release; per MIG device its entry and its removal; the
            # store's creation at start-up.
            hits = 1 + 3 * len(claims) + 3 * migs
        elif point.startswith("mig."):
            hits = migs
        elif point.startswith("vfio."):
            hits = vfios
        else:
            hits = len(claims)
        crash_point = f"{point}@{rng.randint(1, hits)}"
    else:
        external = (rng.choice(("prepare", "unprepare")), rng.uniform(0.0, 0.06))
    deleted = rng.random() < 0.25
    recovery_crash = f"{rng.choice(_RECOVERY_POINTS)}@1" if rng.random() < 0.3 else None
    if store_loss and (number % 7 == 5 or rng.random() < 0.7):
        # The store's creation is its first transaction; each claim rebuilt from its spec is one more.
        recovery_crash = f"{rng.choice(_RECOVERY_POINTS)}@{rng.choice((1, 2))}"
    return Plan(claims, crash_point, external, deleted, recovery_crash, second, store_loss)


async def run(env: Env, runs: int, seed: int, focus: Focus = EVERYTHING) -> Kill9Figures:
    rng = random.Random(seed)
    figures = Kill9Figures()
    node = env.node("rel-kill9")
    plugin = node.plugin(extra_args=DAEMON_ARGS)
    second = node.plugin(pod_uid=SECOND_POD_UID, extra_args=DAEMON_ARGS)
    static = await asyncio.to_thread(_create_static_mig, node, plugin.paths)
    try:
        for number in range(runs):
            plan = plan_run(rng, number, focus)
            await _one_run(
                node, plugin, second if plan.second_instance else None, plan, figures, number, rng, static
            )
            figures.runs += 1
    finally:
        await plugin.stop()
        await second.stop()
    if focus == EVERYTHING:
        await kill9_domains.run(env, domain_runs(runs), seed, figures)
    return figures


def domain_runs(runs: int) -> int:
    """The runs of the compute-domain driver's kinds, on a node of an NVLink clique, after ``runs``
    of the GPU driver's: one in five, three at least."""
    return max(3, runs // 5)


ALL_KINDS = (*KINDS, *kill9_domains.KINDS)  # what a run of everything prepares


def _create_static_mig(node: SimNode, paths: DriverPaths) -> str:
    """The administrator's MIG device on gpu-0, made before the driver first starts; its uuid."""
    paths.create()
    backend = SimulatedBackend(PROFILE, node.name, paths.data)
    try:
        backend.admin_set_mig_mode(0, True)
        return backend.admin_create_mig(0, "3g.40gb", 0).uuid
    finally:
        backend.close()


async def _create_claims(node: SimNode, plan: Plan) -> list[ClaimRef]:
    def create(claim: ClaimPlan) -> ClaimRef:
        if claim.kind.startswith("admin-"):
            return node.admin_claim(claim.device)
        if claim.kind == "share":
            return node.claim(claim.device, share_id=str(uuid.uuid4()), consumed={"memory": SHARE_MEMORY})
        if claim.kind == "time-slicing":
            interval = _TIME_SLICES[len(claim.device) % len(_TIME_SLICES)]
            return node.claim(
                claim.device,
                config=_gpu_config({"strategy": "TimeSlicing", "timeSlicing": {"interval": interval}}),
            )
        if claim.kind == "mps":
            return node.claim(claim.device, config=_gpu_config({"strategy": "MPS"}))
        return node.claim(claim.device)

    return await asyncio.to_thread(lambda: [create(claim) for claim in plan.claims])


def _gpu_config(sharing: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": "GpuConfig", "sharing": sharing}


async def _one_run(
    node: SimNode,
    plugin: Plugin,
    second: Plugin | None,
    plan: Plan,
    figures: Kill9Figures,
    number: int,
    rng: random.Random,
    static: str,
) -> None:
    claims = await _create_claims(node, plan)
    figures.claims_by_kind.update(c.kind for c in plan.claims)
    label = f"run {number} {plan}"
    killed = False
    store_lost = False
    kept = _Kept()  # what the driver had made or bound but no spec named when the store was lost

    def instances() -> list[Plugin]:
        return [p for p in (plugin, second) if p is not None and p.running]

    async def ensure_running() -> None:
        if not plugin.running:
            plugin.reap()
            await restart()
        if second is not None and not second.running:  # never killed: a death here is a failure
            figures.problems.append(f"{label}: the second instance died:\n{second.tail(5)}")
            second.reap()
            await _start(second, None)

    async def restart() -> None:
        """The daemon after a kill; the first one armed to die again (while it recovers, or later)."""
        nonlocal killed, store_lost
        first, killed = not killed, True
        if first and plan.store_loss is not None:
            lost = await asyncio.to_thread(_lose_store, node, plugin.paths, plan.store_loss, static)
            kept.mig |= lost.mig
            kept.vfio |= lost.vfio
            figures.store_losses[plan.store_loss] += 1
            store_lost = True
        if first and plan.recovery_crash_point is not None:
            try:
                await _start(plugin, plan.recovery_crash_point)
                return
            except PluginDied:
                figures.kills_during_recovery += 1
                figures.kills_during_recovery_after_store_loss += store_lost
        await _start(plugin, None)

    if second is not None:
        figures.two_instance_runs += 1
        await _start(second, None)
    # A daemon started unarmed (after the last run's kill) serves on; one armed is started afresh.
    if not (plugin.running and plugin.crash_point is None and plan.crash_point is None):
        await plugin.stop()
        try:
            await _start(plugin, plan.crash_point)
        except PluginDied:
            await restart()

    async def send(operation: str, sent: list[ClaimRef]) -> CallResult:
        return await _send(instances(), operation, sent, rng)

    told_prepared: set[str] = set()
    result = await _call(plugin, send("prepare", claims), plan, "prepare")
    told_prepared |= {c.uid for c in claims if result.ok(c.uid)}
    await ensure_running()
    skip_prepare = killed and plan.pod_deleted_after_kill
    if not skip_prepare:
        pending = [c for c in claims if c.uid not in told_prepared]
        for _ in range(RETRIES):
            if not pending:
                break
            result = await send("prepare", pending)
            await ensure_running()
            told_prepared |= {c.uid for c in pending if result.ok(c.uid)}
            pending = [c for c in claims if c.uid not in told_prepared]
            if pending:
                await asyncio.sleep(0.1)
        # A passthrough claim whose GPU the lost store forgot on vfio-pci is refused: documented.
        refused = _on_kept_gpus(plugin.paths, plan, claims, kept) if pending else set()
        pending = [c for c in pending if c.uid not in refused]
        if pending:
            figures.failed_claims += len(pending)
            figures.problems.append(f"{label}: prepare never succeeded: {result}")
        _check_prepared(node, plugin, plan, claims, told_prepared, figures, label, store_lost, kept)

    result = await _call(plugin, send("unprepare", claims), plan, "unprepare")
    await ensure_running()
    pending = [c for c in claims if not result.ok(c.uid)]
    for _ in range(RETRIES):
        if not pending:
            break
        result = await send("unprepare", pending)
        await ensure_running()
        pending = [c for c in pending if not result.ok(c.uid)]
        if pending:
            await asyncio.sleep(0.1)
    if pending:
        figures.failed_claims += len(pending)
        figures.problems.append(f"{label}: unprepare never succeeded: {result}")
    if second is not None:
        await second.stop()
    if _check_released(node, plugin, figures, label, static, store_lost, kept):
        await _reset(node, plugin, static)
    if killed:
        figures.kills += 1
        figures.killed_at[_where(plugin, plan)] += 1


async def _start(plugin: Plugin, crash_point: str | None) -> None:
    await plugin.start(crash_point)


async def _send(
    instances: list[Plugin], operation: str, claims: list[ClaimRef], rng: random.Random
) -> CallResult:
    """One call of the kubelet's, its claims split at random between the instances that run."""
    if len(instances) < 2:
        target = instances[0] if instances else None
        if target is None:
            return CallResult(transport_error="no instance of the plugin runs")
        return await (target.prepare(claims) if operation == "prepare" else target.unprepare(claims))
    groups: dict[int, list[ClaimRef]] = {}
    for claim in claims:
        groups.setdefault(rng.randrange(len(instances)), []).append(claim)
    calls = [
        instances[i].prepare(group) if operation == "prepare" else instances[i].unprepare(group)
        for i, group in groups.items()
    ]
    merged = CallResult()
    for group, result in zip(groups.values(), await asyncio.gather(*calls), strict=True):
        for claim in group:
            merged.errors[claim.uid] = (
                None
                if result.ok(claim.uid)
                else (result.transport_error or result.errors.get(claim.uid) or "no answer for the claim")
            )
    return merged


async def _call(
    plugin: Plugin, call: Coroutine[Any, Any, CallResult], plan: Plan, operation: str
) -> CallResult:
    """The run's first prepare or unprepare call, with the external kill when it is planned here."""
    if plan.external_kill is None or plan.external_kill[0] != operation or not plugin.running:
        return await call
    task = asyncio.create_task(call)
    await asyncio.sleep(plan.external_kill[1])
    plugin.kill()
    return await task


def _where(plugin: Plugin, plan: Plan) -> str:
    if plan.crash_point is not None:
        return plan.crash_point.partition("@")[0]
    assert plan.external_kill is not None
    return f"random moment of {plan.external_kill[0]}"


@dataclass
class _Kept:
    """What the driver had made, or bound, but no CDI spec named when the store was lost: it cannot be
    told from an administrator's any more, so it stays."""

    mig: set[str] = field(default_factory=set)  # MIG devices' uuids
    vfio: set[str] = field(default_factory=set)  # PCI addresses of GPUs on vfio-pci


def _lose_store(node: SimNode, paths: DriverPaths, how: str, static: str) -> _Kept:
    """Delete the node's store, or overwrite it with garbage, while no daemon runs; what no CDI spec
    names yet of the driver's MIG devices and GPUs on vfio-pci."""
    state = NodeState.read(paths, node.name)
    spec_text = "".join(path.read_text(errors="replace") for path in paths.cdi.glob("*.json"))
    unnamed = _Kept(
        mig={m.uuid for m in state.mig_devices if m.uuid != static and m.uuid not in spec_text},
        vfio={address for address in state.off_nvidia if address not in spec_text},
    )
    store = paths.data / STORE_FILE_NAME
    for companion in paths.data.glob(f"{STORE_FILE_NAME}-*"):  # its write-ahead log and shared memory
        companion.unlink()
    if how == "deleted":
        store.unlink(missing_ok=True)
    else:
        store.write_bytes(b"not a database, after a disk fault " * 200)
    return unnamed


def _on_kept_gpus(paths: DriverPaths, plan: Plan, claims: list[ClaimRef], kept: _Kept) -> set[str]:
    """The passthrough claims (uids) whose GPU a lost store left on vfio-pci, named by nothing."""
    places = PciBus(sysfs_root(paths)).passthrough_gpus()
    names = {f"gpu-vfio-{place.index}": address for address, place in places.items()}
    return {
        claim.uid
        for planned, claim in zip(plan.claims, claims, strict=True)
        if planned.kind == "passthrough" and names.get(planned.device) in kept.vfio
    }


def _check_prepared(
    node: SimNode,
    plugin: Plugin,
    plan: Plan,
    claims: list[ClaimRef],
    told_prepared: set[str],
    figures: Kill9Figures,
    label: str,
    store_lost: bool,
    kept: _Kept,
) -> None:
    state = NodeState.read(plugin.paths, node.name)
    live = {m.uuid for m in state.mig_devices}
    # After a lost store a claim the kubelet does not prepare again keeps the record rebuilt from its spec.
    phases = ("PrepareCompleted", "Recovered") if store_lost else ("PrepareCompleted",)
    for claim in claims:
        if claim.uid not in told_prepared:
            continue
        record = state.records.get(claim.uid)
        problem = None
        if claim.uid not in state.specs:
            problem = "no CDI spec"
        elif record is None or record.phase not in phases:
            problem = f"record {record.phase if record else 'missing'}"
        elif any(d.mig is not None and d.mig.uuid not in live for d in record.devices):
            problem = "its MIG device does not exist"
        if problem:
            figures.lost_claims += 1
            figures.problems.append(f"{label}: prepared claim {claim.uid}: {problem}")
    doubles = state.double_allocations()
    figures.double_allocations += len(doubles)
    figures.problems.extend(f"{label}: held twice: {d}" for d in doubles)
    wrong = _wrong_bindings(state, plan, claims, told_prepared, kept)
    figures.wrong_bindings += len(wrong)
    figures.problems.extend(f"{label}: {problem}" for problem in wrong)


def _wrong_bindings(
    state: NodeState, plan: Plan, claims: list[ClaimRef], told_prepared: set[str], kept: _Kept
) -> list[str]:
    """A GPU is on vfio-pci exactly while a passthrough claim's record holds it (or a lost store
    forgot it there), and each passthrough claim the kubelet was told is prepared holds the GPU its
    device names, on vfio-pci."""
    holders = state.passthrough_holders()
    wrong = [
        f"GPU {address} is bound to {driver} but no passthrough claim holds it"
        for address, driver in state.off_nvidia.items()
        if address not in holders and address not in kept.vfio
    ]
    wrong += [
        f"GPU {address} is held by passthrough claims {sorted(uids)} but bound to "
        f"{state.off_nvidia.get(address, NVIDIA)}"
        for address, uids in holders.items()
        if uids & told_prepared and state.off_nvidia.get(address, NVIDIA) != VFIO_PCI
    ]
    for planned, claim in zip(plan.claims, claims, strict=True):
        record = state.records.get(claim.uid)
        if planned.kind != "passthrough" or claim.uid not in told_prepared or record is None:
            continue
        gpus = [d.passthrough.parent_device for d in record.devices if d.passthrough is not None]
        if gpus != [planned.device.replace("-vfio-", "-")]:
            wrong.append(f"claim {claim.uid} of {planned.device} passed through {gpus}")
    return wrong


def _check_released(
    node: SimNode,
    plugin: Plugin,
    figures: Kill9Figures,
    label: str,
    static: str,
    store_lost: bool,
    kept: _Kept,
) -> bool:
    """Counts what the run left behind; whether anything must be cleaned up before the next run."""
    state = NodeState.read(plugin.paths, node.name)
    migs = {m.uuid for m in state.mig_devices} - {static}
    kept_mig = migs & kept.mig
    leaked_mig = migs - kept_mig
    kept_vfio = set(state.off_nvidia) & kept.vfio
    leaked_vfio = {a: driver for a, driver in state.off_nvidia.items() if a not in kept_vfio}
    # The compute mode and time slice to put back are part of the claim's record: lost with the store.
    changed = () if store_lost else state.changed_gpus
    figures.leaked_specs += len(state.specs)
    figures.leaked_mig += len(leaked_mig)
    figures.mig_kept_after_store_loss += len(kept_mig)
    figures.leaked_vfio += len(leaked_vfio)
    figures.vfio_kept_after_store_loss += len(kept_vfio)
    figures.leaked_records += len(state.records)
    figures.leaked_mps_daemons += len(state.mps_daemons)
    figures.settings_not_restored += len(changed)
    figures.leftover_temp_files += len(state.temp_files)
    if static not in {m.uuid for m in state.mig_devices}:
        figures.static_mig_lost += 1
        figures.problems.append(f"{label}: the administrator's MIG device {STATIC_MIG} is gone")
    if state.temp_files:
        figures.problems.append(f"{label}: temporary files left: {list(state.temp_files)}")
        for temp in state.temp_files:  # counted once, not again in every later run
            Path(temp).unlink()
    if state.specs or leaked_mig or state.records or state.mps_daemons or changed or leaked_vfio:
        figures.problems.append(
            f"{label}: left behind specs {sorted(state.specs)}, records {sorted(state.records)}, "
            f"MIG devices {sorted(leaked_mig)}, MPS daemons {sorted(state.mps_daemons)}, "
            f"GPU settings not restored on {list(changed)}, GPUs off nvidia {leaked_vfio}"
        )
    for address in leaked_vfio:  # what the daemon did with it: a leak seen once must be explainable
        lines = _lines_on(plugin, address)
        figures.problems.append(f"{label}: the daemon's last lines on {address}:\n{lines}")
    return bool(
        state.specs or migs or state.records or state.mps_daemons or state.changed_gpus or state.off_nvidia
    )


def _lines_on(plugin: Plugin, text: str, most: int = 12) -> str:
    """The last lines of the daemon's log (both instances') that mention ``text``."""
    found = [
        line
        for log in sorted(plugin.log.parent.glob("daemon*.log"))
        for line in log.read_text(errors="replace").splitlines()
        if text in line
    ]
    return "\n".join(found[-most:])


async def _reset(node: SimNode, plugin: Plugin, static: str) -> None:
    """Wipe the node after a leak (or what a lost store left: an operator's work), so that one leak is
    counted once, not again in every later run: GPUs back on nvidia too. The administrator's MIG device
    stays."""
    await plugin.stop()
    state = NodeState.read(plugin.paths, node.name)
    specs = SpecStore(plugin.paths.cdi, DRIVER)
    for uid in state.specs:
        specs.remove(uid)
    for store_file in plugin.paths.data.glob(f"{STORE_FILE_NAME}*"):
        store_file.unlink()
    daemons = LocalMpsDaemons(plugin.paths.data / MPS_DIR)
    for daemon in state.mps_daemons:
        await daemons.stop(daemon)
    for pid in state.mps_pids:  # also those no pid file names (``stop`` finds only those)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    root = sysfs_root(plugin.paths)
    bus = PciBus(root, SimulatedKernel(root).write)  # as an administrator's echo into bind would
    for address in state.off_nvidia:
        bus.bind_nvidia(address)
    backend = SimulatedBackend(PROFILE, node.name, plugin.paths.data)
    try:
        for mig in state.mig_devices:
            if mig.uuid != static:
                backend.destroy_mig_device(mig.parent_uuid, mig.uuid)
        for gpu in backend.inventory().gpus:
            backend.set_compute_policy(gpu.uuid, ComputePolicy())
    finally:
        backend.close()
