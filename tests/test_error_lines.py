"""The one place errors become what a user reads: :func:`dra_driver.cli.main` and its lines."""

from __future__ import annotations

import json
import logging
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import structlog

from dra_driver import cli
from dra_driver.errors import StartupError
from dra_driver.log import configure, crash_line, error_line
from dra_driver.resources import pool  # the inventory command imports plan_pool from it when it runs
from dra_driver.settings import LogFormat


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    """``main`` configures logging for the process; give the next test what it had."""
    root = logging.getLogger()
    handlers, level, config = root.handlers[:], root.level, structlog.get_config()
    yield
    logging.captureWarnings(False)
    root.handlers[:] = handlers
    root.setLevel(level)
    structlog.configure(**config)


def test_an_error_line_is_one_line_in_either_format() -> None:
    message = 'while parsing a flow node\nexpected the node content\n  in "kc", line 1'
    text = error_line(message, LogFormat.CONSOLE, exit_code=1)
    assert text == 'error: while parsing a flow node expected the node content in "kc", line 1'
    line = error_line(message, LogFormat.JSON, exit_code=2)
    assert "\n" not in line
    event = json.loads(line)
    assert event["error"] == text.removeprefix("error: ")
    assert (event["event"], event["level"], event["exit_code"]) == ("exiting", "error", 2)
    assert event["timestamp"].endswith("Z")  # as the daemon's own log lines: ISO, UTC


def test_a_crash_is_one_json_event_that_keeps_the_traceback() -> None:
    event = json.loads(crash_line('Traceback (most recent call last):\n  File "x"\nRuntimeError: boom\n'))
    assert event["event"] == "crashed"
    assert event["level"] == "error"
    assert event["exception"].endswith("RuntimeError: boom\n")


def _boom(*_: Any, **__: Any) -> Any:
    raise RuntimeError("boom")


def test_main_reports_a_startup_error_once(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def refuse(*_: Any, **__: Any) -> Any:
        raise StartupError("--thing / DRA_THING is wrong; set it right", exit_code=2)

    monkeypatch.setattr(pool, "plan_pool", refuse)
    monkeypatch.setenv("DRA_LOG_FORMAT", "console")
    assert cli.main(["inventory", "--simulate", "l4x4"]) == 2
    assert capsys.readouterr().err == "error: --thing / DRA_THING is wrong; set it right\n"


def test_in_json_mode_a_bug_still_leaves_one_event_a_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(pool, "plan_pool", _boom)
    monkeypatch.setenv("DRA_LOG_FORMAT", "json")
    assert cli.main(["inventory", "--simulate", "l4x4"]) == 1
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1
    event = json.loads(lines[0])
    assert event["event"] == "crashed"
    assert "RuntimeError: boom" in event["exception"]


def test_on_a_terminal_a_bug_shows_its_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pool, "plan_pool", _boom)
    monkeypatch.setenv("DRA_LOG_FORMAT", "console")
    with pytest.raises(RuntimeError, match="boom"):
        cli.main(["inventory", "--simulate", "l4x4"])


def test_in_json_mode_a_library_warning_is_a_log_event(capsys: pytest.CaptureFixture[str]) -> None:
    configure(LogFormat.JSON, "info")
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn("this API is going away", DeprecationWarning, stacklevel=1)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1
    event = json.loads(lines[0])
    assert event["level"] == "warning"
    assert "this API is going away" in event["event"]
