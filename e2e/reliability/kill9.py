"""kill -9 of the daemon at random points of prepare and unprepare, and at each of its own steps.

One run is one pod's life on the node, as the kubelet drives it: NodePrepareResources for the
pod's claims until every claim is prepared, then NodeUnprepareResources until every claim is
unprepared, the daemon SIGKILLed once somewhere in between. The kill comes either from outside,
at a random moment of the prepare or the unprepare call, or from inside, at a test crash point
(:mod:`dra_driver.crashpoint`): before or after a transaction of the node's store (a claim's
record, the table of MIG devices, the recovery's at start-up), a CDI spec write or removal,
a MIG device's creation or destruction, at a random one of its hits. The daemon is then started
again on the same directories and the run goes on as the kubelet would: it retries the call that
failed (or, as when the pod was deleted meanwhile, goes straight to unprepare).

After the prepare has succeeded everything the kubelet was told is checked (each claim has its
CDI spec and a completed record, each dynamic MIG device it names exists, no device is held by
two claims); after the unprepare has succeeded, that nothing is left (no spec, no record, no MIG
device: this node has no static MIG devices).

Pods are one claim or three; each claim gets a full GPU or a 1g.10gb MIG device created for it
(dynamic MIG), on GPUs picked at random. In four runs of ten the pod also has a claim with admin
access (a monitoring container) to one of the GPUs, most often one another claim of the pod holds:
it must be prepared beside that claim, and never count as a second holder. In three runs of ten the
daemon started after the kill is armed at a crash point too (its first hit): it dies again while it
recovers (counted in ``kill9.kills_during_recovery``) or later in the run, and is started once more.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dra_driver.cdi.store import SpecStore
from dra_driver.crashpoint import POINTS
from dra_driver.devices.simulated import SimulatedBackend
from dra_driver.node.types import ClaimRef
from e2e.reliability.env import Env, SimNode
from e2e.reliability.plugin import (
    DRIVER,
    PROFILE,
    STORE_FILE_NAME,
    CallResult,
    NodeState,
    Plugin,
    PluginDied,
)

MIG_PROFILE = "1g10gb-19"  # H100 1g.10gb: profile id 19, placements 0..6
RETRIES = 8  # the kubelet retries forever; a claim that needs more than this is counted as failed
_MIG_POINTS = {p for p in POINTS if p.startswith("mig.")}
# What a start-up that repairs the state writes through (the store's or the checkpoint's points); a
# start with nothing to repair passes none of them, and the daemon dies there later in the run.
_RECOVERY_POINTS = [p for p in POINTS if p.startswith(("store.", "datafile.", "journal."))] or list(POINTS)


@dataclass
class Kill9Figures:
    runs: int = 0
    kills: int = 0  # runs in which the daemon really died (a crash point may not be reached)
    kills_during_recovery: int = 0  # the daemon started after a kill died again while it recovered
    leaked_specs: int = 0
    leaked_mig: int = 0
    leaked_records: int = 0
    lost_claims: int = 0
    double_allocations: int = 0
    failed_claims: int = 0  # claims not prepared or unprepared within RETRIES retries
    leftover_temp_files: int = 0  # half-written specs still there after the restart
    killed_at: Counter[str] = field(default_factory=Counter)
    claims_by_kind: Counter[str] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return {
            "kill9.runs": self.runs,
            "kill9.kills": self.kills,
            "kill9.kills_during_recovery": self.kills_during_recovery,
            "kill9.leaked_specs": self.leaked_specs,
            "kill9.leaked_mig": self.leaked_mig,
            "kill9.leaked_records": self.leaked_records,
            "kill9.lost_claims": self.lost_claims,
            "kill9.double_allocations": self.double_allocations,
            "kill9.failed_claims": self.failed_claims,
            "kill9.leftover_temp_files": self.leftover_temp_files,
            "kill9.killed_at": dict(sorted(self.killed_at.items())),
            "kill9.claims_by_kind": dict(sorted(self.claims_by_kind.items())),
            "kill9.problems": self.problems[:20],
        }


@dataclass(frozen=True)
class Plan:
    devices: tuple[str, ...]  # one per claim
    admin_devices: tuple[str, ...]  # one per claim with admin access
    crash_point: str | None  # armed in the daemon, "<point>@<n>"
    external_kill: tuple[str, float] | None  # ("prepare" | "unprepare", seconds after the call)
    pod_deleted_after_kill: bool  # skip the retried prepare, as when the pod was deleted meanwhile
    # armed in the daemon started after the kill ("<point>@1"): it may die again while it recovers
    recovery_crash_point: str | None = None


def plan_run(rng: random.Random) -> Plan:
    claims = rng.choice((1, 3))
    mig = rng.random() < 0.5
    gpus = rng.sample(range(8), claims)
    devices: list[str] = []
    for index, gpu in enumerate(gpus):
        if mig and (index == 0 or rng.random() < 0.5):
            devices.append(f"gpu-{gpu}-mig-{MIG_PROFILE}-{rng.randrange(7)}")
        else:
            devices.append(f"gpu-{gpu}")
    admin: tuple[str, ...] = ()
    if rng.random() < 0.4:
        whole = [d for d in devices if "-mig-" not in d]
        admin = (rng.choice(whole) if whole and rng.random() < 0.8 else f"gpu-{rng.randrange(8)}",)
    claims += len(admin)
    migs = sum("-mig-" in d for d in devices)
    crash_point: str | None = None
    external: tuple[str, float] | None = None
    if rng.random() < 0.7:
        points = [p for p in POINTS if migs or p not in _MIG_POINTS]
        point = rng.choice(points)
        if point.startswith("store."):
            # Per claim its record (one step, or Reserve + Progress per MIG device + Complete) and its
            # Release; per MIG device its entry and its removal; the store's creation at start-up.
            hits = 1 + 2 * claims + 3 * migs
        elif point.startswith("mig."):
            hits = migs
        else:
            hits = claims
        crash_point = f"{point}@{rng.randint(1, hits)}"
    else:
        external = (rng.choice(("prepare", "unprepare")), rng.uniform(0.0, 0.06))
    deleted = rng.random() < 0.25
    recovery_crash = f"{rng.choice(_RECOVERY_POINTS)}@1" if rng.random() < 0.3 else None
    return Plan(tuple(devices), admin, crash_point, external, deleted, recovery_crash)


async def run(env: Env, runs: int, seed: int) -> Kill9Figures:
    rng = random.Random(seed)
    figures = Kill9Figures()
    node = env.node("rel-kill9")
    plugin = node.plugin()
    try:
        for number in range(runs):
            plan = plan_run(rng)
            await _one_run(node, plugin, plan, figures, number)
            figures.runs += 1
    finally:
        await plugin.stop()
    return figures


async def _one_run(node: SimNode, plugin: Plugin, plan: Plan, figures: Kill9Figures, number: int) -> None:
    claims = await asyncio.to_thread(
        lambda: [node.claim(d) for d in plan.devices] + [node.admin_claim(d) for d in plan.admin_devices]
    )
    figures.claims_by_kind.update("mig-dynamic" if "-mig-" in d else "gpu" for d in plan.devices)
    figures.claims_by_kind.update("admin-gpu" for _ in plan.admin_devices)
    label = f"run {number} {plan}"
    killed = False

    async def ensure_running() -> None:
        nonlocal killed
        if not plugin.running:
            plugin.reap()
            await restart()

    async def restart() -> None:
        """The daemon after a kill; the first one armed to die again (while it recovers, or later)."""
        nonlocal killed
        first, killed = not killed, True
        if first and plan.recovery_crash_point is not None:
            try:
                await _start(plugin, plan.recovery_crash_point)
                return
            except PluginDied:
                figures.kills_during_recovery += 1
        await _start(plugin, None)

    await plugin.stop()
    try:
        await _start(plugin, plan.crash_point)
    except PluginDied:
        await restart()

    told_prepared: set[str] = set()
    result = await _call(plugin, "prepare", claims, plan)
    told_prepared |= {c.uid for c in claims if result.ok(c.uid)}
    if not plugin.running:
        await ensure_running()
    skip_prepare = killed and plan.pod_deleted_after_kill
    if not skip_prepare:
        pending = [c for c in claims if c.uid not in told_prepared]
        for _ in range(RETRIES):
            if not pending:
                break
            result = await plugin.prepare(pending)
            await ensure_running()
            told_prepared |= {c.uid for c in pending if result.ok(c.uid)}
            pending = [c for c in claims if c.uid not in told_prepared]
            if pending:
                await asyncio.sleep(0.1)
        if pending:
            figures.failed_claims += len(pending)
            figures.problems.append(f"{label}: prepare never succeeded: {result}")
        _check_prepared(node, plugin, claims, told_prepared, figures, label)

    result = await _call(plugin, "unprepare", claims, plan)
    await ensure_running()
    pending = [c for c in claims if not result.ok(c.uid)]
    for _ in range(RETRIES):
        if not pending:
            break
        result = await plugin.unprepare(pending)
        await ensure_running()
        pending = [c for c in pending if not result.ok(c.uid)]
        if pending:
            await asyncio.sleep(0.1)
    if pending:
        figures.failed_claims += len(pending)
        figures.problems.append(f"{label}: unprepare never succeeded: {result}")
    if _check_released(node, plugin, figures, label):
        await _reset(node, plugin)
    if killed:
        figures.kills += 1
        figures.killed_at[_where(plugin, plan)] += 1


async def _start(plugin: Plugin, crash_point: str | None) -> None:
    await plugin.start(crash_point)


async def _call(plugin: Plugin, operation: str, claims: list[ClaimRef], plan: Plan) -> CallResult:
    """The run's first prepare or unprepare call, with the external kill when it is planned here."""
    call = plugin.prepare(claims) if operation == "prepare" else plugin.unprepare(claims)
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


def _check_prepared(
    node: SimNode,
    plugin: Plugin,
    claims: list[ClaimRef],
    told_prepared: set[str],
    figures: Kill9Figures,
    label: str,
) -> None:
    state = NodeState.read(plugin.paths, node.name)
    live = {m.uuid for m in state.mig_devices}
    for claim in claims:
        if claim.uid not in told_prepared:
            continue
        record = state.records.get(claim.uid)
        problem = None
        if claim.uid not in state.specs:
            problem = "no CDI spec"
        elif record is None or record.phase != "PrepareCompleted":
            problem = f"record {record.phase if record else 'missing'}"
        elif any(d.mig is not None and d.mig.uuid not in live for d in record.devices):
            problem = "its MIG device does not exist"
        if problem:
            figures.lost_claims += 1
            figures.problems.append(f"{label}: prepared claim {claim.uid}: {problem}")
    doubles = state.double_allocations()
    figures.double_allocations += len(doubles)
    figures.problems.extend(f"{label}: held twice: {d}" for d in doubles)


def _check_released(node: SimNode, plugin: Plugin, figures: Kill9Figures, label: str) -> bool:
    """Counts what the run left behind; whether it left anything."""
    state = NodeState.read(plugin.paths, node.name)
    figures.leaked_specs += len(state.specs)
    figures.leaked_mig += len(state.mig_devices)
    figures.leaked_records += len(state.records)
    figures.leftover_temp_files += len(state.temp_files)
    if state.temp_files:
        figures.problems.append(f"{label}: temporary files left: {list(state.temp_files)}")
        for temp in state.temp_files:  # counted once, not again in every later run
            Path(temp).unlink()
    if state.specs or state.mig_devices or state.records:
        figures.problems.append(
            f"{label}: left behind specs {sorted(state.specs)}, records {sorted(state.records)}, "
            f"MIG devices {[m.uuid for m in state.mig_devices]}"
        )
    return bool(state.specs or state.mig_devices or state.records)


async def _reset(node: SimNode, plugin: Plugin) -> None:
    """Wipe the node after a leak, so that one leak is counted once, not again in every later run."""
    await plugin.stop()
    state = NodeState.read(plugin.paths, node.name)
    specs = SpecStore(plugin.paths.cdi, DRIVER)
    for uid in state.specs:
        specs.remove(uid)
    for store_file in plugin.paths.data.glob(f"{STORE_FILE_NAME}*"):
        store_file.unlink()
    backend = SimulatedBackend(PROFILE, node.name, plugin.paths.data)
    try:
        for mig in state.mig_devices:
            backend.destroy_mig_device(mig.parent_uuid, mig.uuid)
    finally:
        backend.close()
