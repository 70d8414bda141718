"""Every setting is a flag and an env var; flags win, and a bad value names the setting."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from dra_driver.cli import (
    add_settings_flags,
    env_name,
    flag_name,
    requested_log_format,
    settings_from,
    unknown_env_settings,
)
from dra_driver.errors import StartupError
from dra_driver.settings import LogFormat, Settings, http_host_port


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
def test_a_bad_value_exits_2_naming_the_flag_and_the_env_var(argv: list[str], named: str) -> None:
    with pytest.raises(StartupError) as refused:
        settings_from(parse(argv))
    assert refused.value.exit_code == 2
    assert named in str(refused.value)


def test_a_bad_env_value_is_reported_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DRA_LOG_FORMAT", "xml")
    with pytest.raises(StartupError, match="DRA_LOG_FORMAT"):
        settings_from(parse([]))


@pytest.mark.parametrize(
    ("argv", "named", "says"),
    [
        (["--node-name", "N1_bad!"], "DRA_NODE_NAME", "DNS subdomain"),
        (["--node-name", "n" * 254], "DRA_NODE_NAME", "at most 253"),
        (["--node-name", "node-1\n"], "DRA_NODE_NAME", "DNS subdomain"),  # "$" matches before a newline
        (["--pod-uid", "3f2b6c1e\n"], "DRA_POD_UID", "pod UID"),
        (["--pod-uid", "../x"], "DRA_POD_UID", "socket file names"),
        (["--pod-uid", ".hidden"], "DRA_POD_UID", "pod UID"),
        (["--simulate", "dgx-z900"], "DRA_SIMULATE", "dgx-h100"),
        (["--mps-shm-size", "lots"], "DRA_MPS_SHM_SIZE", "not a memory quantity such as 4Gi"),
        (["--mps-shm-size", "512k"], "DRA_MPS_SHM_SIZE", "less than 1Mi"),
        (["--mig-partitions", "bogus"], "DRA_MIG_PARTITIONS", "'bogus'"),
        (["--mig-partitions", "0,MIG-1234"], "DRA_MIG_PARTITIONS", "'MIG-1234'"),
        (["--mig-partitions", " , "], "DRA_MIG_PARTITIONS", "comma-separated"),
        (["--driver-root", "run/nvidia/driver"], "DRA_DRIVER_ROOT", "absolute"),
        (["--driver-root-mount", "driver-root"], "DRA_DRIVER_ROOT_MOUNT", "absolute"),
        (["--plugins-dir", ""], "DRA_PLUGINS_DIR", "not empty"),
        (["--cdi-dir", " "], "DRA_CDI_DIR", "not empty"),
        (["--http-address", "notaport"], "DRA_HTTP_ADDRESS", "host:port"),
        (["--http-address", ":99999"], "DRA_HTTP_ADDRESS", "0-65535"),
        (["--http-address", ":\uff18\uff10"], "DRA_HTTP_ADDRESS", "host:port"),  # full-width digits
        (["--http-address", "fe80::1:8080"], "DRA_HTTP_ADDRESS", "[::]:8080"),
        (["--health-poll-seconds", "nan"], "DRA_HEALTH_POLL_SECONDS", "finite"),
        (["--inventory-refresh-seconds", "inf"], "DRA_INVENTORY_REFRESH_SECONDS", "finite"),
    ],
)
def test_values_that_used_to_pass_are_refused(argv: list[str], named: str, says: str) -> None:
    with pytest.raises(StartupError) as refused:
        settings_from(parse(argv))
    assert refused.value.exit_code == 2
    assert f"{flag_name(argv[0][2:].replace('-', '_'))} / {named}" in str(refused.value)
    assert says in str(refused.value)
    assert "\n" not in str(refused.value)


def test_good_values_stay_accepted_in_their_usual_spellings() -> None:
    uuid = "GPU-5f0e1b2c-3d4e-5f60-7182-93a4b5c6d7e8"
    settings = settings_from(
        parse(
            [
                "--node-name=ip-10-0-1-7.ec2.internal",
                "--pod-uid=3f2b6c1e-8d4a-4e0b-9c1d-2a5e7f8b9c0d",
                f"--mig-partitions= 0, {uuid} ,0",
                "--http-address=[::]:9090",
                "--driver-root=/run/nvidia/driver",
            ]
        )
    )
    assert settings.mig_partitions == f"0,{uuid}"
    assert settings_from(parse(["--mig-partitions", " ALL "])).mig_partitions == "all"
    assert http_host_port(settings.http_address) == ("::", 9090)
    assert http_host_port(":8080") == ("0.0.0.0", 8080)
    assert settings_from(parse(["--http-address", ""])).http_address == ""  # the endpoint is off


def test_an_empty_optional_path_means_its_default(monkeypatch: pytest.MonkeyPatch) -> None:
    # A Helm template or a shell renders an unset value as "": it must not mean the current directory.
    monkeypatch.setenv("DRA_DATA_DIR", "")
    monkeypatch.setenv("DRA_KUBECONFIG", "")
    monkeypatch.setenv("DRA_DRIVER_ROOT_MOUNT", " ")
    settings = settings_from(parse(["--plugins-dir", "/p"]))
    assert settings.state_dir == Path("/p/gpu.dra-driver.dev")
    assert settings.kubeconfig is None
    assert settings.driver_root_mount is None


def test_every_bad_setting_is_named_in_one_message() -> None:
    with pytest.raises(StartupError) as refused:
        settings_from(parse(["--log-level", "loud", "--node-name", "A"]))
    message = str(refused.value)
    assert "--log-level / DRA_LOG_LEVEL" in message
    assert "--node-name / DRA_NODE_NAME" in message
    assert "Value error" not in message  # pydantic's prefix says nothing to a user


@pytest.mark.parametrize(
    ("argv", "env", "expected"),
    [
        ([], {}, LogFormat.AUTO),
        ([], {"DRA_LOG_FORMAT": "json"}, LogFormat.JSON),
        (["--log-format", "console"], {"DRA_LOG_FORMAT": "json"}, LogFormat.CONSOLE),
        (["--log-format=json"], {}, LogFormat.JSON),
        (["--log-format", "xml"], {"DRA_LOG_FORMAT": "json"}, LogFormat.AUTO),
        (["--log-format"], {"DRA_LOG_FORMAT": "console"}, LogFormat.CONSOLE),
    ],
)
def test_the_log_format_of_an_error_is_read_before_settings_are_valid(
    argv: list[str], env: dict[str, str], expected: LogFormat
) -> None:
    assert requested_log_format(argv, env) is expected


def test_dra_variables_that_name_no_setting_are_found() -> None:
    environ = {"DRA_NODE_NAME": "n1", "DRA_NODENAME": "n1", "DRA_MIG_PARTITION": "0", "HOME": "/root"}
    assert unknown_env_settings(environ) == ["DRA_MIG_PARTITION", "DRA_NODENAME"]
