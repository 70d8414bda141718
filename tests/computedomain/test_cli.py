"""The ComputeDomain commands refuse bad input with one line that says what to fix."""

from __future__ import annotations

import pytest

from dra_driver.cli import main

_DAEMON_ENV = ("NODE_NAME", "POD_IP", "CLIQUE_ID", "COMPUTE_DOMAIN_UUID", "COMPUTE_DOMAIN_NAME")


def test_the_controller_needs_its_namespace(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compute-domain-controller", "--daemon-image=x"]) == 2
    assert (
        capsys.readouterr().err
        == "error: --namespace / DRA_NAMESPACE is required (the controller pod's namespace)\n"
    )


def test_a_bad_variable_fails_like_a_bad_flag(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DRA_DAEMON_READY_TIMEOUT_SECONDS", "soon")
    with pytest.raises(SystemExit):
        main(["compute-domain-controller"])
    assert "argument --daemon-ready-timeout-seconds: invalid float value: 'soon'" in capsys.readouterr().err


def test_the_daemon_outside_its_pod_names_what_is_missing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in _DAEMON_ENV:
        monkeypatch.delenv(name, raising=False)
    assert main(["compute-domain-daemon"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: missing environment NODE_NAME, POD_IP, CLIQUE_ID")
    assert err.count("\n") == 1


def test_the_daemon_with_an_unreadable_kubeconfig_says_so(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path
) -> None:  # type: ignore[no-untyped-def]
    for name in _DAEMON_ENV:
        monkeypatch.setenv(name, "x")
    (tmp_path / "imexd.cfg").write_text("SERVER_PORT=50000\n")
    assert (
        main(
            ["compute-domain-daemon", f"--kubeconfig={tmp_path / 'missing'}", f"--imex-config-dir={tmp_path}"]
        )
        == 1
    )
    last = capsys.readouterr().err.splitlines()[-1]  # after the kubernetes client's own warning
    assert last.startswith(f"error: cannot load kubeconfig {tmp_path / 'missing'}")
