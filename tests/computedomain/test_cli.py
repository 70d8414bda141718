"""The ComputeDomain commands refuse bad input with one line that says what to fix."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from dra_driver.cli import main
from dra_driver.computedomain.cli import boolean

_DAEMON_ENV = (
    "NODE_NAME",
    "POD_IP",
    "POD_NAMESPACE",
    "CLIQUE_ID",
    "COMPUTE_DOMAIN_UUID",
    "COMPUTE_DOMAIN_NAME",
)


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    """``main`` configures logging for the process; give the next test what it had."""
    root = logging.getLogger()
    handlers, level, config = root.handlers[:], root.level, structlog.get_config()
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    structlog.configure(**config)


def _one_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if '"level": "warning"' not in line]  # the client's own
    assert len(lines) == 1, err
    return lines[0]


def test_the_controller_needs_its_namespace(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compute-domain-controller", "--daemon-image=x"]) == 2
    assert "--namespace / DRA_NAMESPACE is required (the controller pod's namespace)" in _one_line(capsys)


def test_a_bad_variable_fails_like_a_bad_flag(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DRA_DAEMON_READY_TIMEOUT_SECONDS", "soon")
    assert main(["compute-domain-controller"]) == 2
    assert "argument --daemon-ready-timeout-seconds: invalid float value: 'soon'" in _one_line(capsys)


def test_a_switch_takes_true_or_false_and_refuses_anything_else(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert [boolean(text) for text in ("true", "True", "1", "false", "FALSE", "0")] == [True] * 3 + [
        False
    ] * 3
    monkeypatch.setenv("DRA_IMEX_DAEMONS_WITH_DNS_NAMES", "maybe")
    assert main(["compute-domain-controller"]) == 2
    assert "argument --imex-daemons-with-dns-names: invalid boolean value: 'maybe'" in _one_line(capsys)


def test_the_daemon_outside_its_pod_names_what_is_missing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in _DAEMON_ENV:
        monkeypatch.delenv(name, raising=False)
    assert main(["compute-domain-daemon"]) == 2
    assert "missing environment NODE_NAME, POD_IP, POD_NAMESPACE, CLIQUE_ID" in _one_line(capsys)


def test_the_daemon_with_an_unreadable_kubeconfig_says_so(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    for name in _DAEMON_ENV:
        monkeypatch.setenv(name, "x")
    (tmp_path / "imexd.cfg").write_text("SERVER_PORT=50000\n")
    assert (
        main(
            ["compute-domain-daemon", f"--kubeconfig={tmp_path / 'missing'}", f"--imex-config-dir={tmp_path}"]
        )
        == 1
    )
    assert f"cannot read kubeconfig {tmp_path / 'missing'} (--kubeconfig / DRA_KUBECONFIG)" in _one_line(
        capsys
    )


def test_a_lease_too_short_to_renew_is_refused_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DRA_LEASE_DURATION_SECONDS", "0")
    assert main(["compute-domain-controller", "--namespace=ns", "--daemon-image=img"]) == 2
    assert (
        "--lease-duration-seconds / DRA_LEASE_DURATION_SECONDS: leader election needs 0 < retry period"
        in _one_line(capsys)
    )
