"""The health settings: Xid lists and taint effects from flags and the environment, and the policy
the daemon builds from them."""

from __future__ import annotations

import argparse

import pytest

from dra_driver import cli
from dra_driver.cli import add_settings_flags, env_name, settings_from
from dra_driver.gpu_plugin.policies import taint_policy
from dra_driver.resources.taints import TaintEffect, TaintPolicy
from dra_driver.settings import Settings


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_settings_flags(parser)
    return parser.parse_args(argv)


def test_the_defaults_ignore_nvidias_application_xids_and_evict_only_lost_gpus() -> None:
    settings = Settings()
    assert settings.ignored_xids == "13,31,43,45,68,109"
    assert taint_policy(settings) == TaintPolicy(
        driver_name="gpu.dra-driver.dev",
        xid_effect=TaintEffect.NO_SCHEDULE,
        gpu_lost_effect=TaintEffect.NO_EXECUTE,
        gpu_lost_xids=frozenset({79}),
        remove_on_recovery=True,
    )


def test_xid_lists_and_effects_come_from_flags_and_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(env_name("ignored_xids"), " 13, 43 ,13")
    monkeypatch.setenv(env_name("taints_on_recovery"), "keep")
    settings = settings_from(
        parse(
            ["--gpu-lost-xids", "79,48", "--xid-taint-effect", "NoExecute", "--driver-name", "gpu.nvidia.com"]
        )
    )
    assert settings.ignored_xids == "13,43"
    assert taint_policy(settings) == TaintPolicy(
        driver_name="gpu.nvidia.com",
        xid_effect=TaintEffect.NO_EXECUTE,
        gpu_lost_effect=TaintEffect.NO_EXECUTE,
        gpu_lost_xids=frozenset({48, 79}),
        remove_on_recovery=False,
    )


def test_an_empty_list_ignores_no_xid() -> None:
    assert Settings(ignored_xids="").ignored_xids == ""


@pytest.mark.parametrize(
    ("flag", "value", "complaint"),
    [
        ("--ignored-xids", "13,abc", "'abc' is not an Xid number"),
        ("--gpu-lost-xids", "-79", "-79 is not an Xid number"),
        ("--xid-taint-effect", "PreferNoSchedule", "invalid choice"),
        ("--health-poll-seconds", "0", "greater than 0"),
        ("--taints-on-recovery", "forget", "invalid choice"),
    ],
)
def test_a_bad_value_names_the_setting(
    flag: str, value: str, complaint: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DRA_LOG_FORMAT", "console")
    assert cli.main(["kubelet-plugin", flag, value]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ")
    assert err.count("\n") == 1
    assert flag in err
    assert complaint in err
