"""Concurrent writers of the simulated state never corrupt it nor lose an update.

The daemon (one event loop, blocking calls in worker threads) and the `simulate`
CLI (other processes) change the same file; every create is a check-and-write
that must be atomic across both.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

from dra_driver.devices.backend import PlacementUnavailableError
from dra_driver.devices.types import Placement
from dra_driver.simulated.gpus import SimulatedBackend

H100_1G = 19


def test_threads_racing_for_the_same_slices_get_each_slice_once(tmp_path):
    backend = SimulatedBackend("dgx-h100", "node-a", tmp_path)
    gpu = backend.inventory().gpus[0].uuid
    starts = [start for start in range(7) for _ in range(3)]  # three contenders per slice
    barrier = threading.Barrier(len(starts))

    def contend(start: int) -> str | None:
        barrier.wait()
        try:
            return backend.create_mig_device(gpu, H100_1G, Placement(start, 1)).uuid
        except PlacementUnavailableError:
            return None

    with ThreadPoolExecutor(max_workers=len(starts)) as pool:
        results = list(pool.map(contend, starts))

    winners = [r for r in results if r is not None]
    assert len(winners) == 7
    shown = backend.inventory().gpus[0].mig_devices
    assert sorted(d.uuid for d in shown) == sorted(winners)
    assert sorted(d.placement.start for d in shown) == list(range(7))


WORKER = """
import sys
from pathlib import Path
from dra_driver.devices.backend import PlacementUnavailableError
from dra_driver.simulated.gpus import SimulatedBackend
from dra_driver.devices.types import Placement

backend = SimulatedBackend("dgx-h100", "node-a", Path(sys.argv[1]))
gpus = backend.inventory().gpus
won = 0
for start in range(7):
    for gpu in gpus[:2]:
        try:
            backend.create_mig_device(gpu.uuid, 19, Placement(start, 1))
            won += 1
        except PlacementUnavailableError:
            pass
    backend.inject_xid(int(sys.argv[2]), 100 + start)
print(won)
"""


def test_processes_writing_at_once_lose_nothing(tmp_path):
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, str(tmp_path), str(n)], stdout=subprocess.PIPE, text=True
        )
        for n in range(4)
    ]
    won = []
    for worker in workers:
        out, _ = worker.communicate(timeout=120)
        assert worker.returncode == 0
        won.append(int(out))

    backend = SimulatedBackend("dgx-h100", "node-a", tmp_path)
    gpus = backend.inventory().gpus
    assert sum(won) == 14  # every slice 0..6 of GPUs 0 and 1 was won exactly once
    for gpu in gpus[:2]:
        assert sorted(d.placement.start for d in gpu.mig_devices) == list(range(7))
    # every worker's seven Xid events arrived, in each worker's order
    assert backend.faults() == {gpus[n].uuid: tuple(range(100, 107)) for n in range(4)}
