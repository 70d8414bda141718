"""The one executor every NVML call runs on: bounded in time, in threads, and in what a hung driver costs.

Plain Python callables stand for NVML calls here (an event keeps one "hung" until the test lets it
go); the NVML backend's and the health watch's own hang tests run against the mock library
(tests/devices/test_nvml.py, test_nvml_health.py).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import pytest
from structlog.testing import capture_logs

from dra_driver.devices import nvml_calls
from dra_driver.devices.backend import DeviceError
from dra_driver.devices.nvml_calls import NvmlCalls, NvmlHungError

GUARD_S = 10.0


@pytest.fixture
def release() -> Iterator[threading.Event]:
    """Set at the end of each test, so that no "hung" call outlives it."""
    event = threading.Event()
    yield event
    event.set()


@pytest.fixture
def two_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pool of two, so that filling it is cheap and no other test's calls share it."""
    monkeypatch.setattr(nvml_calls, "_WORKERS", nvml_calls._Workers(2))


def hang(release: threading.Event, started: threading.Event | None = None, value: int = 0) -> int:
    if started is not None:
        started.set()
    release.wait(GUARD_S)
    return value


def test_a_call_that_answers_gives_its_result_or_its_error() -> None:
    calls = NvmlCalls(1.0)
    assert calls.run("adding", lambda: 1 + 1) == 2

    def failing() -> int:
        raise DeviceError("GPU 0: Unknown Error")

    with pytest.raises(DeviceError, match="GPU 0: Unknown Error"):
        calls.run("reading", failing)


def test_a_hung_call_fails_after_the_timeout_with_what_to_do(release: threading.Event) -> None:
    calls = NvmlCalls(0.2)
    started = time.monotonic()
    with capture_logs() as logs, pytest.raises(NvmlHungError) as error:
        calls.run("reading the GPU inventory", lambda: hang(release))
    assert 0.2 <= time.monotonic() - started < 2
    assert str(error.value) == (
        "reading the GPU inventory: NVML did not answer within 0.2s; the GPU or its driver is hung "
        "(check dmesg for Xid errors; a GPU reset or a node reboot clears it)"
    )
    assert isinstance(error.value, DeviceError)  # what the backend's callers already handle
    assert [e["action"] for e in logs if e["event"] == "nvml_call_timed_out"] == ["reading the GPU inventory"]


def test_a_result_that_comes_after_its_caller_gave_up_goes_to_abandoned(release: threading.Event) -> None:
    abandoned: list[int] = []
    done = threading.Event()

    def late(value: int) -> None:
        abandoned.append(value)
        done.set()

    with pytest.raises(NvmlHungError):
        NvmlCalls(0.1).run("creating a MIG device", lambda: hang(release, value=7), abandoned=late)
    release.set()
    assert done.wait(GUARD_S)
    assert abandoned == [7]


@pytest.mark.usefixtures("two_workers")
def test_a_hung_driver_costs_at_most_the_pool_and_a_call_given_up_in_the_queue_never_runs(
    release: threading.Event,
) -> None:
    before = set(threading.enumerate())
    hung = [threading.Event() for _ in range(2)]
    calls = [NvmlCalls(0.1) for _ in hung]
    for call, started in zip(calls, hung, strict=True):
        with pytest.raises(NvmlHungError):
            call.run("reading", lambda started=started: hang(release, started))  # type: ignore[misc]
        assert started.wait(GUARD_S)
    ran = threading.Event()
    with pytest.raises(NvmlHungError):  # both workers are hung: it waits its turn, in vain
        NvmlCalls(0.1).run("destroying a MIG device", ran.set)
    workers = set(threading.enumerate()) - before
    assert len(workers) == 2
    assert all(t.name.startswith("nvml-") and t.daemon for t in workers)  # exit does not wait for them
    release.set()  # the driver answers again: the workers are free, the given-up call is dropped
    assert NvmlCalls(1.0).run("reading", lambda: 5) == 5
    assert not ran.is_set()


def test_one_at_a_time_refuses_the_next_call_while_one_hangs(release: threading.Event) -> None:
    calls = NvmlCalls(0.1, one_at_a_time=True)
    with pytest.raises(NvmlHungError):
        calls.run("checking which GPUs NVML reaches", lambda: hang(release))
    started = time.monotonic()
    with pytest.raises(NvmlHungError) as error:
        calls.run("waiting for NVML events", lambda: 1)
    assert time.monotonic() - started < 0.1  # at once, not after another timeout
    assert str(error.value) == (
        "waiting for NVML events: NVML has not answered checking which GPUs NVML reaches for over 0.1s; "
        "the GPU or its driver is hung (check dmesg for Xid errors)"
    )
    release.set()
    assert asyncio.run(calls.settled(GUARD_S))
    assert calls.run("waiting for NVML events", lambda: 1) == 1


async def test_an_awaited_call_lets_the_event_loop_run_and_is_bounded(release: threading.Event) -> None:
    calls = NvmlCalls(0.2, one_at_a_time=True)
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.01)

    ticker = asyncio.create_task(tick())
    try:
        assert await calls.run_async("reading", lambda: 3) == 3
        with pytest.raises(
            NvmlHungError, match=r"^waiting for NVML events: NVML did not answer within 0\.2s"
        ):
            await calls.run_async("waiting for NVML events", lambda: hang(release), extra_seconds=0.1)
        assert ticks >= 10  # the loop ran on through the 0.3 s the call hung
        assert not await calls.settled(0.05)
        release.set()
        assert await calls.settled(GUARD_S)
    finally:
        ticker.cancel()
