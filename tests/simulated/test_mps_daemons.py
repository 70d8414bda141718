"""The simulated node's MPS control daemons: real processes with the real daemon's lifecycle."""

from __future__ import annotations

import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from dra_driver.devices.types import ComputeMode, ComputePolicy
from dra_driver.node.sharing.mps import (
    MpsDaemonError,
    MpsDaemonSpec,
    MpsDevice,
    container_env,
    container_mounts,
    daemon_id,
)
from dra_driver.simulated.gpus import STATE_FILE_NAME, SimulatedBackend
from dra_driver.simulated.mps_daemons import LocalMpsDaemons


@pytest.fixture
def backend(tmp_path: Path) -> SimulatedBackend:
    (tmp_path / "boot_id").write_text("boot-1\n")
    return SimulatedBackend("mixed", "node-a", tmp_path / "sim", boot_id_path=tmp_path / "boot_id")


@pytest.fixture
def daemons(tmp_path: Path) -> Iterator[LocalMpsDaemons]:
    runner = LocalMpsDaemons(tmp_path / "mps", tmp_path / "sim" / STATE_FILE_NAME)
    yield runner
    runner.stop_all()  # no process outlives a test, even a failed one


def process_exists(pid: int) -> bool:
    return Path(f"/proc/{pid}/cmdline").exists()


def spec_for(backend: SimulatedBackend, *, percentage: int | None = 40) -> MpsDaemonSpec:
    gpu = backend.inventory().gpus[0]
    return MpsDaemonSpec(
        id=daemon_id("claim-uid", [gpu.uuid]),
        claim_uid="claim-uid",
        claim="default/claim",
        devices=(MpsDevice(gpu.uuid, 10 * 2**30),),
        active_thread_percentage=percentage,
    )


async def test_a_daemon_starts_becomes_ready_and_stops_without_a_trace(
    backend: SimulatedBackend, daemons: LocalMpsDaemons
) -> None:
    spec = spec_for(backend)
    backend.set_compute_policy(spec.devices[0].uuid, ComputePolicy(ComputeMode.EXCLUSIVE_PROCESS))

    paths = await daemons.start(spec)
    await daemons.wait_ready(spec, timeout_s=30)

    pid = daemons.pid(spec.id)
    assert pid is not None
    assert process_exists(pid)
    assert stat.S_ISFIFO((paths.pipe / "control").stat().st_mode)
    log = (paths.log / "control.log").read_text()
    assert "control: set_default_active_thread_percentage 40" in log
    assert f"control: set_default_device_pinned_mem_limit {spec.devices[0].uuid} 10240M" in log
    assert await daemons.running() == {spec.id}
    assert await daemons.start(spec) == paths  # idempotent
    assert daemons.pid(spec.id) == pid

    await daemons.stop(spec.id)
    assert not paths.root.exists()
    assert daemons.pid(spec.id) is None
    assert not process_exists(pid)
    assert await daemons.running() == set()
    await daemons.stop(spec.id)  # idempotent


async def test_a_restarted_plugin_finds_and_stops_the_daemon_it_started_before(
    tmp_path: Path, backend: SimulatedBackend, daemons: LocalMpsDaemons
) -> None:
    spec = spec_for(backend)
    backend.set_compute_policy(spec.devices[0].uuid, ComputePolicy(ComputeMode.EXCLUSIVE_PROCESS))
    await daemons.start(spec)
    await daemons.wait_ready(spec, timeout_s=30)

    restarted = LocalMpsDaemons(tmp_path / "mps", tmp_path / "sim" / STATE_FILE_NAME)
    pid = restarted.pid(spec.id)
    assert pid == daemons.pid(spec.id)
    await restarted.stop(spec.id)
    assert daemons.pid(spec.id) is None


async def test_a_daemon_whose_pid_was_never_written_is_adopted_and_stopped_not_started_twice(
    tmp_path: Path, backend: SimulatedBackend, daemons: LocalMpsDaemons
) -> None:
    """A plugin SIGKILLed between starting the daemon's process and writing its pid file: the restarted
    plugin's repeated start must use that process, and its stop end it (the fault suite found one
    such process running on with nothing left to name it)."""
    spec = spec_for(backend)
    backend.set_compute_policy(spec.devices[0].uuid, ComputePolicy(ComputeMode.EXCLUSIVE_PROCESS))
    paths = await daemons.start(spec)
    await daemons.wait_ready(spec, timeout_s=30)
    pid = daemons.pid(spec.id)
    assert pid is not None
    (paths.root / "pid").unlink()

    restarted = LocalMpsDaemons(tmp_path / "mps", tmp_path / "sim" / STATE_FILE_NAME)
    assert restarted.pid(spec.id) == pid
    assert await restarted.start(spec) == paths
    await restarted.wait_ready(spec, timeout_s=30)
    assert restarted.pid(spec.id) == pid
    assert (paths.root / "pid").read_text() == f"{pid}\n"
    await restarted.stop(spec.id)
    daemons.pid(spec.id)  # reaps the process this plugin started, once it ended
    assert not process_exists(pid)
    assert not paths.root.exists()


async def test_a_daemon_that_fails_to_start_says_why(
    backend: SimulatedBackend, daemons: LocalMpsDaemons
) -> None:
    spec = spec_for(backend)  # the GPU is still in compute mode Default
    await daemons.start(spec)
    with pytest.raises(MpsDaemonError, match=r"exited before it was ready: .*compute mode Default"):
        await daemons.wait_ready(spec, timeout_s=30)

    backend.set_compute_policy(spec.devices[0].uuid, ComputePolicy(ComputeMode.EXCLUSIVE_PROCESS))
    backend.set_mps_broken(0, True)
    await daemons.stop(spec.id)
    await daemons.start(spec)
    with pytest.raises(MpsDaemonError, match="could not create its context"):
        await daemons.wait_ready(spec, timeout_s=30)


def test_containers_get_the_pipe_shm_and_client_limits_not_the_log(backend: SimulatedBackend) -> None:
    spec = spec_for(backend)
    env = dict(container_env(spec))
    assert env == {
        "CUDA_MPS_PIPE_DIRECTORY": "/tmp/nvidia-mps",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "40",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"{spec.devices[0].uuid}=10240M",
    }
    mounts = {m.container_path: m for m in container_mounts(LocalMpsDaemons(Path("/r")).paths(spec.id))}
    # Not the daemon's log directory, where the privileged daemon writes: a client would plant links.
    assert sorted(mounts) == ["/dev/shm", "/tmp/nvidia-mps"]
    assert mounts["/tmp/nvidia-mps"].host_path == f"/r/{spec.id}/pipe"
    assert "rw" in mounts["/dev/shm"].options


@pytest.mark.parametrize("percentage", [0, 101])
def test_a_thread_percentage_outside_1_to_100_is_refused(backend: SimulatedBackend, percentage: int) -> None:
    with pytest.raises(ValueError, match="not within 1-100"):
        spec_for(backend, percentage=percentage)
