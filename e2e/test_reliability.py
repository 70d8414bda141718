"""The fault suite's CI-sized subset (``make reliability`` runs the full size): the same scenarios, on
the session's control plane, each asserting that nothing went wrong. See e2e/reliability/."""

from __future__ import annotations

from typing import Any

import pytest

from e2e.cluster import ClusterInfo
from e2e.reliability import diskfull, kill9, rolling, suite
from e2e.reliability.env import Env

pytestmark = [pytest.mark.e2e, pytest.mark.reliability]
SEED = 20261201  # fixed: a CI failure can be replayed with `python -m e2e.reliability --ci --seed ...`


@pytest.fixture
def env(cluster: ClusterInfo, tmp_path_factory: pytest.TempPathFactory) -> Env:
    # Not tmp_path: long test names would push the plugin's socket paths past the kernel's 107 bytes.
    return Env(cluster=cluster, base=tmp_path_factory.mktemp("rel"))


def check(figures: dict[str, Any], prefix: str) -> None:
    missed = suite.missed_goals(figures)
    problems = figures.get(f"{prefix}.problems") or []
    assert not missed, "\n".join([*missed, "first problems:", *map(str, problems)])


def test_kill9_of_every_claim_kind_two_instances_and_a_lost_store_loses_nothing(env: Env) -> None:
    figures = suite.run(env, suite.CI, SEED, only=("kill9",))
    assert figures["kill9.runs"] == suite.CI.kill9_runs + kill9.domain_runs(suite.CI.kill9_runs)
    assert figures["kill9.kills"] > 0
    assert figures["kill9.kinds"] == sorted(kill9.ALL_KINDS)
    assert figures["kill9.two_instance_runs"] > 0
    assert set(figures["kill9.store_losses"]) == {"deleted", "corrupted"}
    assert figures["kill9.kills_during_recovery_after_store_loss"] > 0
    check(figures, "kill9")


def test_fuzzed_parsers_and_hostile_grpc_calls_crash_nothing_and_write_nowhere_else(env: Env) -> None:
    figures = suite.run(env, suite.CI, SEED, only=("fuzz",))
    assert figures["fuzz.grpc_calls"] >= suite.CI.grpc_calls
    check(figures, "fuzz")


def test_an_api_server_outage_fails_gets_clearly_and_heals_without_a_restart(env: Env) -> None:
    figures = suite.run(env, suite.CI, SEED, only=("outage",))
    assert figures["outage.rounds"] == suite.CI.outage_rounds
    assert figures["outage.gets_failed_clearly"] == suite.CI.outage_rounds
    check(figures, "outage")


@pytest.mark.skipif(bool(diskfull.can_mount()), reason=diskfull.can_mount() or "can mount")
def test_a_full_disk_fails_claims_clearly_damages_nothing_and_recovers(env: Env) -> None:
    figures = suite.run(env, suite.CI, SEED, only=("diskfull",))
    assert figures["diskfull.rounds"] == suite.CI.diskfull_rounds
    assert figures["diskfull.failed_clearly"] > 0
    check(figures, "diskfull")


def test_two_plugin_instances_lose_no_update_and_never_share_a_device(env: Env) -> None:
    figures = suite.run(env, suite.CI, SEED, only=("rolling",))
    assert figures["rolling.rounds"] == suite.CI.rolling_rounds
    assert figures["rolling.starts_during_prepares"] == rolling.SURGE_STARTS
    assert figures["rolling.calls_during_starts"] >= 2 * 7 * rolling.SURGE_STARTS  # a pass per start
    check(figures, "rolling")
