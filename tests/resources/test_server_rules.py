"""The API rules of each supported Kubernetes release, read from the API server's /version."""

from __future__ import annotations

import pytest

from dra_driver.errors import StartupError
from dra_driver.gpu_plugin.policies import binding_conditions_on, check_taint_effects
from dra_driver.resources.server_rules import NEWEST, ServerRules, rules_for
from dra_driver.resources.taints import TaintEffect
from dra_driver.settings import Settings

ON_1_34 = ServerRules(counters_beside_devices=True, taint_effect_none=False, binding_conditions=False)
ON_1_35 = ServerRules(binding_conditions=False)  # the gate DRADeviceBindingConditions is alpha, off


@pytest.mark.parametrize(
    ("git_version", "rules"),
    [
        ("v1.34.4", ON_1_34),
        ("v1.34.0-rc.1", ON_1_34),
        ("v1.35.4", ON_1_35),
        ("v1.36.3", NEWEST),
        ("v1.37.2", NEWEST),
        ("v1.40.0", NEWEST),
        ("", NEWEST),  # /version unreadable: the newest rules
        ("v2.0.0", NEWEST),
        ("devel", NEWEST),
    ],
)
def test_rules_follow_the_release(git_version: str, rules: ServerRules) -> None:
    assert rules_for(git_version) == rules


@pytest.mark.parametrize(
    ("setting", "flag"),
    [("xid_taint_effect", "--xid-taint-effect"), ("gpu_lost_taint_effect", "--gpu-lost-taint-effect")],
)
def test_taint_effect_none_is_refused_on_1_34_naming_the_setting(setting: str, flag: str) -> None:
    settings = Settings(**{setting: TaintEffect.NONE})  # type: ignore[arg-type]

    with pytest.raises(StartupError, match=f"^{flag} / DRA_.*needs Kubernetes 1.35 or newer"):
        check_taint_effects(settings, ON_1_34)
    check_taint_effects(settings, NEWEST)  # fine from 1.35


def test_the_default_taint_effects_work_on_1_34() -> None:
    check_taint_effects(Settings(), ON_1_34)


@pytest.mark.parametrize(
    ("setting", "rules", "published"),
    [
        ("auto", NEWEST, True),
        ("auto", ON_1_35, False),  # today's behaviour where the gate is off by default
        ("auto", ON_1_34, False),
        ("on", ON_1_35, True),  # an administrator who turned the alpha gate on
        ("off", NEWEST, False),
    ],
)
def test_binding_conditions_follow_the_setting_and_the_release(
    setting: str, rules: ServerRules, published: bool
) -> None:
    assert binding_conditions_on(Settings(binding_conditions=setting), rules) is published
