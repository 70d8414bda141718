"""The test-only crash points: inert unless armed, and then exactly at the n-th hit of one point."""

from __future__ import annotations

import signal
import subprocess
import sys

from dra_driver import crashpoint

SCRIPT = """
import dra_driver.crashpoint as c
c.reached("cdi.after_write"); print("first", flush=True)
c.reached("mig.before_create"); print("other point", flush=True)
c.reached("cdi.after_write"); print("second", flush=True)
"""


def run(value: str | None) -> subprocess.CompletedProcess[str]:
    env = {} if value is None else {crashpoint.ENV: value}
    return subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True)


def test_unarmed_points_do_nothing() -> None:
    done = run(None)
    assert done.returncode == 0
    assert done.stdout.split("\n")[:3] == ["first", "other point", "second"]


def test_an_armed_point_kills_the_process_at_its_nth_hit() -> None:
    done = run("cdi.after_write@2")
    assert done.returncode == -signal.SIGKILL
    assert done.stdout.split() == ["first", "other", "point"]
    assert "crashing at cdi.after_write (hit 2)" in done.stderr


def test_a_star_kills_at_the_nth_point_of_any_name() -> None:
    done = run("*@2")
    assert done.returncode == -signal.SIGKILL
    assert done.stdout.split() == ["first"]


def test_an_unknown_point_is_refused_in_one_line() -> None:
    done = run("cdi.nowhere")
    assert done.returncode == 1
    assert "unknown crash point 'cdi.nowhere'" in done.stderr
    assert "Traceback" not in done.stderr


def test_every_point_the_driver_reaches_is_known_and_every_known_point_is_reached() -> None:
    """A misspelt name at a call site would never fire, and the fault suite would test nothing there."""
    import re
    from pathlib import Path

    package = Path(crashpoint.__file__).parent
    called = {
        name
        for source in package.rglob("*.py")
        for name in re.findall(r'crashpoint\.reached\("([^"]+)"\)', source.read_text())
    }
    assert called == set(crashpoint.POINTS)
