"""Every setting is a flag and an env var; flags win, and a bad value names the setting."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from dra_driver.cli_settings import add_settings_flags, env_name, flag_name, settings_from
from dra_driver.settings import Settings


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_settings_flags(parser)
    return parser.parse_args(argv)


def test_every_setting_has_a_flag_and_an_env_var_with_help() -> None:
    parser = argparse.ArgumentParser()
    add_settings_flags(parser)
    flags = {option for action in parser._actions for option in action.option_strings}
    for name, info in Settings.model_fields.items():
        assert flag_name(name) in flags
        assert info.description, f"{name} needs a description: it is the flag's help and the docs' text"
    help_text = parser.format_help()
    assert "DRA_DRIVER_NAME" in help_text
    assert "DRA_MIG_PARTITIONS" in help_text


def test_flag_beats_env_beats_default(monkeypatch: pytest.MonkeyPatch) -> None:
    assert settings_from(parse([])).driver_name == "gpu.dra-driver.dev"
    monkeypatch.setenv(env_name("driver_name"), "gpu.from-env.example")
    assert settings_from(parse([])).driver_name == "gpu.from-env.example"
    assert (
        settings_from(parse(["--driver-name", "gpu.from-flag.example"])).driver_name
        == "gpu.from-flag.example"
    )


def test_values_are_parsed_into_their_types(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DRA_INVENTORY_REFRESH_SECONDS", "2.5")
    settings = settings_from(parse(["--cdi-dir", "/tmp/cdi", "--log-format", "json"]))
    assert settings.inventory_refresh_seconds == 2.5
    assert settings.cdi_dir == Path("/tmp/cdi")
    assert settings.log_format.value == "json"


def test_state_dir_defaults_under_the_plugin_dir() -> None:
    settings = settings_from(parse(["--plugins-dir", "/p", "--driver-name", "gpu.example.com"]))
    assert settings.state_dir == Path("/p/gpu.example.com")
    assert settings_from(parse(["--data-dir", "/d"])).state_dir == Path("/d")


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--driver-name", "Not_A_DNS_Name"], "--driver-name / DRA_DRIVER_NAME"),
        (
            ["--inventory-refresh-seconds", "-1"],
            "--inventory-refresh-seconds / DRA_INVENTORY_REFRESH_SECONDS",
        ),
        (["--log-level", "loud"], "--log-level / DRA_LOG_LEVEL"),
    ],
)
def test_a_bad_value_exits_2_naming_the_flag_and_the_env_var(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        settings_from(parse(argv))
    assert exit_info.value.code == 2
    assert named in capsys.readouterr().err


def test_a_bad_env_value_is_reported_too(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DRA_LOG_FORMAT", "xml")
    with pytest.raises(SystemExit):
        settings_from(parse([]))
    assert "DRA_LOG_FORMAT" in capsys.readouterr().err
