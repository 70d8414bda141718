"""Dynamic MIG through the NVML backend on the mock libnvidia-ml.so.1, where NVML misbehaves.

The node layer's other tests drive the simulator; here the preparer drives NvmlBackend, loaded
from a driver root as on a host, and the mock makes one NVML call hang as a GPU that stops
answering makes it hang in the kernel driver. The claim must fail with an error that says so --
the message the kubelet shows as FailedPrepareDynamicResources -- and the plugin must go on
serving the next claim.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from dra_driver.devices.nvml import NvmlBackend
from dra_driver.node.store import open_read_only
from dra_driver.node.types import ClaimError
from tests.mock_nvml import MockNvml, install_driver_root, install_procfs

from .builders import InMemoryClaims, Node, RecordingObserver, new_ref

GUARD_S = 30  # against a hang only
THREE_G = 2  # the 3g.40gb profile id of NVIDIA's H100 mock
HANG_MS = 6000
CALL_TIMEOUT_S = 2.0  # far above a real answer on a loaded machine, far below the hang


@pytest.fixture
def mock() -> MockNvml:
    return MockNvml()


def orphans_on_disk(node: Node) -> list[tuple[str, int, int, int]]:
    store = open_read_only(node.store_path)
    try:
        return store.orphans()
    finally:
        store.close()


def nvml_backend(tmp_path: Path) -> NvmlBackend:
    root = tmp_path / "driver-root"
    return NvmlBackend(
        procfs_root=tmp_path / "proc",
        dev_root=root,
        driver_root=root,
        state_dir=tmp_path / "state",
        call_timeout=CALL_TIMEOUT_S,
    )


@pytest.fixture
def nvml_node(tmp_path: Path, mock: MockNvml) -> Iterator[Node]:
    install_driver_root(tmp_path / "driver-root")
    procfs = install_procfs(tmp_path / "proc")
    mock.configure("dgxh100:2", proc_root=procfs)
    (tmp_path / "boot_id").write_text("boot-1\n")
    node = Node(tmp_path, nvml_backend(tmp_path), InMemoryClaims(), RecordingObserver())  # type: ignore[arg-type]
    yield node
    mock.control("clear-faults")
    node.backend.close()


async def test_a_gpu_instance_a_failed_rollback_left_is_in_the_store_and_destroyed_at_the_next_start(
    nvml_node: Node, mock: MockNvml, tmp_path: Path
) -> None:
    preparer = await nvml_node.started()
    ref = new_ref("leaky")
    nvml_node.allocate(ref, f"gpu-0-mig-3g40gb-{THREE_G}-4")
    devices = tmp_path / "proc" / "devices"
    devices.write_text("Character devices:\n195 nvidia\n\nBlock devices:\n")  # no nvidia-caps: creation fails
    mock.control("fail nvmlGpuInstanceDestroy 999 count=50")  # beyond every attempt of the rollback

    assert isinstance((await preparer.prepare([ref]))[ref.uid], ClaimError)

    gpu_uuid = nvml_node.backend.inventory().gpus[0].uuid
    assert [(gpu, start) for gpu, _, start, _ in orphans_on_disk(nvml_node)] == [(gpu_uuid, 4)]
    preparer.close()
    nvml_node.backend.close()
    mock.control("clear-faults")
    install_procfs(tmp_path / "proc")
    nvml_node.backend = nvml_backend(tmp_path)  # the plugin starts again: a backend that knows no orphan

    restarted = await nvml_node.started()

    assert mock.state()["gpus"][0]["gpuInstances"] == []
    assert orphans_on_disk(nvml_node) == []
    restarted.close()


async def test_a_hung_nvml_call_fails_its_claim_naming_the_hang_and_the_next_claim_is_served(
    nvml_node: Node, mock: MockNvml
) -> None:
    preparer = await nvml_node.started()
    hung, after = new_ref("hung"), new_ref("after")
    nvml_node.allocate(hung, f"gpu-0-mig-3g40gb-{THREE_G}-4")
    nvml_node.allocate(after, f"gpu-1-mig-3g40gb-{THREE_G}-0")
    mock.control(f"hang nvmlDeviceCreateGpuInstanceWithPlacement {HANG_MS} count=1")

    with capture_logs() as logs:
        outcome = await asyncio.wait_for(preparer.prepare([hung]), GUARD_S)

        error = outcome[hung.uid]
        assert isinstance(error, ClaimError), error
        assert f"NVML did not answer within {CALL_TIMEOUT_S:g}s" in error.message
        assert "creating a MIG device on GPU" in error.message
        # The plugin goes on: the next claim is prepared while the hung call is still blocked.
        served = await asyncio.wait_for(preparer.prepare([after]), GUARD_S)
        assert not isinstance(served[after.uid], ClaimError), served[after.uid]
        # Once NVML answers, the MIG device the failed claim no longer wants is destroyed again.
        for _ in range(int(GUARD_S / 0.1)):
            if any(e["event"] == "abandoned_mig_device_destroyed" for e in logs):
                break
            await asyncio.sleep(0.1)
        else:
            pytest.fail("the MIG device made after its claim gave up was never destroyed")
    assert mock.state()["gpus"][0]["gpuInstances"] == []
    assert len(mock.state()["gpus"][1]["gpuInstances"]) == 1  # the served claim's
