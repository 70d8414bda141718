"""The scenarios at a given size, their figures in one flat dict, and the goals those figures must meet."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from e2e.reliability import diskfull, fuzz_grpc, fuzz_parsers, kill9, model, outage, rolling
from e2e.reliability.env import Env


@dataclass(frozen=True)
class Size:
    kill9_runs: int
    parser_cases_per_target: int  # four targets at this size, one at a tenth of it
    grpc_calls: int
    huge_call_claims: int
    outage_rounds: int
    diskfull_rounds: int
    rolling_rounds: int
    model_examples: int  # sequences of the model-based test of the node's state
    model_steps: int  # steps per sequence
    model_nvml_examples: int  # sequences of it on the NVML backend over the mock (slower per step)


FULL = Size(200, 25_000, 1_200, 10_000, 3, 5, 30, 400, 40, 30)
CI = Size(14, 1_000, 120, 2_000, 1, 2, 4, 20, 30, 4)

# Figures whose goal is 0: each counts something that went wrong.
ZERO_GOALS = (
    "kill9.leaked_specs", "kill9.leaked_mig", "kill9.leaked_records", "kill9.lost_claims",
    "kill9.double_allocations", "kill9.failed_claims", "kill9.leaked_mps_daemons",
    "kill9.settings_not_restored", "kill9.static_mig_lost", "kill9.wrong_bindings", "kill9.leaked_vfio",
    "kill9.leaked_node_labels", "kill9.vfio_kept_after_store_loss",
    "fuzz.crashes", "fuzz.escapes", "fuzz.internal_errors",
    "outage.gets_failed_unclearly", "outage.failed_without_api", "outage.retried_after_return_failed",
    "outage.daemon_restarts",
    "diskfull.failed_unclearly", "diskfull.damaged_files", "diskfull.temp_files_left",
    "diskfull.not_recovered",
    "rolling.lost_updates", "rolling.double_allocations", "rolling.unexpected_failures",
    "model.failures",
)  # fmt: skip
REPUBLISH_GOAL_S = 5.0
SCENARIOS = ("kill9", "fuzz", "outage", "diskfull", "rolling", "model")


def missed_goals(figures: dict[str, Any]) -> list[str]:
    """What the figures fall short of, in words; empty when every goal is met."""
    missed = [f"{key} = {figures[key]} (goal 0)" for key in ZERO_GOALS if figures.get(key)]
    for key in (
        "outage.republish_after_return_max_s",
        "outage.republish_after_wipe_max_s",
        "outage.republish_after_kubelet_restart_max_s",
    ):
        if key in figures and figures[key] > REPUBLISH_GOAL_S:
            missed.append(f"{key} = {figures[key]} (goal <= {REPUBLISH_GOAL_S})")
    if "kill9.runs" in figures and figures["kill9.kills"] < figures["kill9.runs"] // 2:
        missed.append(f"kill9.kills = {figures['kill9.kills']}: most runs never killed the daemon")
    return missed


def run(
    env: Env, size: Size, seed: int, only: tuple[str, ...] = SCENARIOS, focus: kill9.Focus = kill9.EVERYTHING
) -> dict[str, Any]:
    figures: dict[str, Any] = {"seed": seed}
    seconds: dict[str, float] = {}

    def timed(name: str, scenario: Callable[[], dict[str, Any]]) -> None:
        if name not in only:
            return
        started = time.monotonic()
        figures.update(scenario())
        seconds[name] = round(time.monotonic() - started, 1)

    timed("kill9", lambda: asyncio.run(kill9.run(env, size.kill9_runs, seed, focus)).as_json())
    timed("fuzz", lambda: _fuzz(env, size, seed))
    timed("outage", lambda: asyncio.run(outage.run(env, size.outage_rounds)).as_json())
    timed("diskfull", lambda: asyncio.run(diskfull.run(env, size.diskfull_rounds)).as_json())
    timed("rolling", lambda: asyncio.run(rolling.run(env, size.rolling_rounds, seed)).as_json())
    timed("model", lambda: model.run(size.model_examples, size.model_steps, size.model_nvml_examples))
    figures["seconds"] = seconds
    return figures


def _fuzz(env: Env, size: Size, seed: int) -> dict[str, Any]:
    parsers = fuzz_parsers.run(size.parser_cases_per_target, seed)
    grpc = asyncio.run(fuzz_grpc.run(env, size.grpc_calls, size.huge_call_claims, seed))
    parser_cases = sum(parsers.cases.values())
    return {
        "fuzz.cases": parser_cases + grpc.calls,
        "fuzz.crashes": sum(parsers.crashes.values()) + grpc.crashes,
        "fuzz.escapes": grpc.escapes,
        "fuzz.internal_errors": grpc.internal_errors,
        "fuzz.parser_cases": dict(parsers.cases),
        "fuzz.parser_crashes": dict(parsers.crashes),
        "fuzz.grpc_calls": grpc.calls,
        "fuzz.grpc_claims": grpc.claims_sent,
        "fuzz.huge_call_claims": size.huge_call_claims,
        "fuzz.huge_call_seconds": round(grpc.huge_call_seconds, 2),
        "fuzz.problems": (parsers.examples + grpc.problems)[:20],
    }
