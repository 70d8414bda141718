"""Two plugin instances on one node, as during a rolling update of the DaemonSet: both serve the
kubelet at once (sockets of their own, ``--pod-uid``) and share the store, CDI directory and GPUs.

Each round prepares a pod's worth of claims, each through a randomly chosen instance, all at
once, then unprepares each through a randomly chosen instance (not necessarily the one that
prepared it: the kubelet moves to the new plugin as soon as it registers). Two claims of each
round are allocated the *same* device and sent to different instances -- something the scheduler
never does, and exactly what the store's unique index must refuse -- and two
get MIG devices at different placements of one GPU, which both instances must create side by side.

Then the surge itself, a few times: a third instance starts (and repairs the shared store)
while the old one prepares and unprepares claim after claim, as the kubelet keeps calling it until
the new plugin registers. None of those calls may fail: a prepare half-way (its spec written,
its record not yet) is the old instance's, not a crash's for the new one to recover.

Figures: lost updates (a claim answered prepared without its record or spec, or answered
unprepared with either left), devices held twice (both claims of a conflicting pair prepared, or
one device in two records), and claims that failed although nothing conflicted.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field
from typing import Any

from dra_driver.node.types import ClaimRef
from e2e.reliability.env import Env, SimNode
from e2e.reliability.plugin import CallResult, NodeState, Plugin


@dataclass
class RollingFigures:
    rounds: int = 0
    claims: int = 0
    lost_updates: int = 0
    double_allocations: int = 0
    unexpected_failures: int = 0
    starts_during_prepares: int = 0
    calls_during_starts: int = 0
    problems: list[str] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return {
            "rolling.rounds": self.rounds,
            "rolling.claims": self.claims,
            "rolling.lost_updates": self.lost_updates,
            "rolling.double_allocations": self.double_allocations,
            "rolling.unexpected_failures": self.unexpected_failures,
            "rolling.starts_during_prepares": self.starts_during_prepares,
            "rolling.calls_during_starts": self.calls_during_starts,
            "rolling.problems": self.problems[:20],
        }


def _claims(node: SimNode, devices: list[str]) -> list[ClaimRef]:
    return [node.claim(device) for device in devices]


async def run(env: Env, rounds: int, seed: int) -> RollingFigures:
    rng = random.Random(seed)
    figures = RollingFigures()
    node = env.node("rel-rolling")
    old, new = node.plugin(pod_uid="old-pod"), node.plugin(pod_uid="new-pod")
    await old.start()
    await new.start()
    instances = (old, new)
    try:
        for number in range(rounds):
            label = f"round {number}"
            gpus = rng.sample(range(7), 5)
            shared = f"gpu-{gpus[0]}"
            devices = [shared, shared, *(f"gpu-{g}" for g in gpus[1:])]
            a, b = rng.sample(range(7), 2)
            devices += [f"gpu-7-mig-1g10gb-19-{a}", f"gpu-7-mig-1g10gb-19-{b}"]
            claims = await asyncio.to_thread(_claims, node, devices)
            figures.claims += len(claims)
            via = [rng.choice(instances) for _ in claims]
            via[1] = new if via[0] is old else old  # the conflicting pair: one per instance

            prepared = await asyncio.gather(*(p.prepare([c]) for p, c in zip(via, claims, strict=True)))
            ok = [r.ok(c.uid) for r, c in zip(prepared, claims, strict=True)]
            if ok[0] and ok[1]:
                figures.double_allocations += 1
                figures.problems.append(f"{label}: {shared} prepared for two claims by two instances")
            if not (ok[0] or ok[1]):
                figures.unexpected_failures += 1
                figures.problems.append(f"{label}: neither claim of {shared} prepared: {prepared[:2]}")
            for claim, result, success in list(zip(claims, prepared, ok, strict=True))[2:]:
                if not success:
                    figures.unexpected_failures += 1
                    figures.problems.append(f"{label}: {claim.name} failed: {result}")
            state = NodeState.read(old.paths, node.name)
            for claim, success in zip(claims, ok, strict=True):
                if success and (claim.uid not in state.specs or claim.uid not in state.records):
                    figures.lost_updates += 1
                    figures.problems.append(f"{label}: prepared {claim.name} has no record or spec")
            doubles = state.double_allocations()
            figures.double_allocations += len(doubles)
            figures.problems.extend(f"{label}: {d}" for d in doubles)

            undo: list[tuple[Plugin, ClaimRef]] = [(rng.choice(instances), c) for c in claims]
            results: list[CallResult] = await asyncio.gather(*(p.unprepare([c]) for p, c in undo))
            for (_, claim), result in zip(undo, results, strict=True):
                if not result.ok(claim.uid):
                    figures.unexpected_failures += 1
                    figures.problems.append(f"{label}: unprepare of {claim.name} failed: {result}")
            state = NodeState.read(old.paths, node.name)
            left = state.specs | set(state.records)
            if left or state.mig_devices:
                figures.lost_updates += len(left) + len(state.mig_devices)
                figures.problems.append(f"{label}: after unprepare, left {sorted(left)} {state.mig_devices}")
            figures.rounds += 1
        for number in range(min(rounds, SURGE_STARTS)):
            await _start_during_prepares(node, old, f"surge {number}", figures)
    finally:
        await old.stop()
        await new.stop()
    return figures


SURGE_STARTS = 3


async def _start_during_prepares(node: SimNode, old: Plugin, label: str, figures: RollingFigures) -> None:
    """Start another instance while ``old`` prepares and unprepares claims one after another."""
    claims = await asyncio.to_thread(_claims, node, [f"gpu-{g}" for g in range(7)])
    newer = node.plugin(pod_uid=f"newer-pod-{figures.starts_during_prepares}")
    starting = asyncio.create_task(newer.start())
    try:
        turn = 0
        while not starting.done() or turn < len(claims):  # and at least one pass over the claims
            claim = claims[turn % len(claims)]
            turn += 1
            for call in (old.prepare, old.unprepare):
                result = await call([claim])
                figures.calls_during_starts += 1
                if not result.ok(claim.uid):
                    figures.unexpected_failures += 1
                    figures.problems.append(f"{label}: {call.__name__} of {claim.name} failed: {result}")
                    break
        await starting
        figures.starts_during_prepares += 1
    finally:
        if not starting.done():
            starting.cancel()
        await newer.stop()
    state = NodeState.read(old.paths, node.name)
    if left := state.specs | set(state.records):
        figures.lost_updates += len(left)
        figures.problems.append(f"{label}: after every unprepare, left {sorted(left)}")
