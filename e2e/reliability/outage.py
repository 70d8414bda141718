"""The API server frozen (SIGSTOP: connections hang, nothing is refused) during prepares and during
slice publishing, and the node's slices wiped as a restarting kubelet wipes them.

Figures: claims that needed a GET during the outage and failed with a clear error (and how many
failed otherwise or succeeded by accident); claims already prepared, prepared again and unprepared
during the outage without the API server; whether every claim succeeded on retry once it was back;
seconds from its return until the slices carried a taint set during the outage; seconds from a wipe
of the node's slices until they were back; and daemon restarts (the process id must not change).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any

from dra_driver.simulated.gpus import SimulatedBackend
from e2e.gpu_node import SLICES, GpuNode, node_slices_query, published_devices, published_slices
from e2e.harness import ensure_harness_binary
from e2e.reliability.env import Env
from e2e.reliability.plugin import DRIVER, PROFILE

XID_KEY = f"{DRIVER}/xid"
TAINTED_GPU = 5
WAIT_S = 60.0


@dataclass
class OutageFigures:
    rounds: int = 0
    gets_failed_clearly: int = 0
    gets_failed_unclearly: int = 0
    prepared_without_api: int = 0  # already prepared claims answered (and unprepared) during the outage
    failed_without_api: int = 0  # ... that failed although they need no API call
    retried_after_return_ok: int = 0
    retried_after_return_failed: int = 0
    republish_after_return_s: list[float] = field(default_factory=list)
    republish_after_wipe_s: list[float] = field(default_factory=list)
    republish_after_kubelet_restart_s: list[float] = field(default_factory=list)
    daemon_restarts: int = 0
    problems: list[str] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return {
            "outage.rounds": self.rounds,
            "outage.gets_failed_clearly": self.gets_failed_clearly,
            "outage.gets_failed_unclearly": self.gets_failed_unclearly,
            "outage.prepared_without_api": self.prepared_without_api,
            "outage.failed_without_api": self.failed_without_api,
            "outage.retried_after_return_ok": self.retried_after_return_ok,
            "outage.retried_after_return_failed": self.retried_after_return_failed,
            "outage.republish_after_return_max_s": round(max(self.republish_after_return_s, default=0), 2),
            "outage.republish_after_wipe_max_s": round(max(self.republish_after_wipe_s, default=0), 2),
            "outage.republish_after_kubelet_restart_max_s": round(
                max(self.republish_after_kubelet_restart_s, default=0), 2
            ),
            "outage.daemon_restarts": self.daemon_restarts,
            "outage.problems": self.problems[:20],
        }


def apiserver_pid(env: Env) -> int:
    (record,) = [p for p in env.cluster.processes if p.name == "kube-apiserver"]
    return record.pid


async def run(env: Env, rounds: int) -> OutageFigures:
    figures = OutageFigures()
    node = env.node("rel-outage")
    plugin = node.plugin()
    rest = env.cluster.rest()
    apiserver = apiserver_pid(env)
    await plugin.start()
    pid = plugin.pid
    backend = SimulatedBackend(PROFILE, node.name, plugin.paths.data)
    try:
        for number in range(rounds):
            before, needs_get = await asyncio.to_thread(lambda: (node.claim("gpu-0"), node.claim("gpu-1")))
            if not (await plugin.prepare([before])).ok(before.uid):
                figures.problems.append(f"round {number}: the claim before the outage did not prepare")
            xid = 48 if number % 2 == 0 else 94
            os.kill(apiserver, signal.SIGSTOP)
            try:
                # Publishing during the outage: a GPU fault must become a taint in the slices.
                await asyncio.to_thread(backend.inject_xid, TAINTED_GPU, xid)
                again, fresh = await asyncio.gather(plugin.prepare([before]), plugin.prepare([needs_get]))
                if again.ok(before.uid):
                    figures.prepared_without_api += 1
                else:
                    figures.failed_without_api += 1
                    figures.problems.append(f"round {number}: repeated prepare failed: {again}")
                error = fresh.errors.get(needs_get.uid)
                if fresh.transport_error is None and error and "GET" in error and needs_get.name in error:
                    figures.gets_failed_clearly += 1
                else:
                    figures.gets_failed_unclearly += 1
                    figures.problems.append(f"round {number}: prepare needing a GET answered {fresh}")
                if (await plugin.unprepare([before])).ok(before.uid):
                    figures.prepared_without_api += 1
                else:
                    figures.failed_without_api += 1
            finally:
                os.kill(apiserver, signal.SIGCONT)
            returned = time.monotonic()
            seconds = await _until(lambda xid=xid: _tainted(rest, node.name, xid), returned)
            if seconds is None:
                figures.problems.append(f"round {number}: the taint was not published within {WAIT_S} s")
            else:
                figures.republish_after_return_s.append(seconds)
            retried = await plugin.prepare([needs_get])
            if retried.ok(needs_get.uid):
                figures.retried_after_return_ok += 1
            else:
                figures.retried_after_return_failed += 1
                figures.problems.append(f"round {number}: retry after the outage: {retried}")
            await plugin.unprepare([needs_get])
            await asyncio.to_thread(backend.recover, TAINTED_GPU)
            await _until(lambda: not _tainted(rest, node.name, None), time.monotonic())

            # A restarting kubelet deletes every slice of its node; the driver must publish them again.
            devices = set(await asyncio.to_thread(published_devices, rest, node.name))
            await asyncio.to_thread(rest.request, "DELETE", SLICES, query=node_slices_query(node.name))
            wiped = time.monotonic()
            seconds = await _until(
                lambda devices=devices: set(published_devices(rest, node.name)) == devices, wiped
            )
            if seconds is None:
                figures.problems.append(f"round {number}: slices not published again within {WAIT_S} s")
            else:
                figures.republish_after_wipe_s.append(seconds)
            figures.rounds += 1
        if not plugin.running or plugin.pid != pid:
            figures.daemon_restarts += 1
            figures.problems.append(f"the daemon did not survive:\n{plugin.tail()}")
    finally:
        os.kill(apiserver, signal.SIGCONT)
        backend.close()
        await plugin.stop()
    await asyncio.to_thread(_kubelet_restarts, env, rounds, figures)
    return figures


def _kubelet_restarts(env: Env, rounds: int, figures: OutageFigures) -> None:
    """The real kubelet (harness) restarted: it deletes the node's slices as it starts; the driver,
    left running, must publish them again. Timed from the moment the restarted kubelet is up until
    every device is back in slices the restart created (new uids)."""
    rest = env.cluster.rest()
    name = env.node("rel-kubelet").name
    node = GpuNode(env.cluster, ensure_harness_binary(), env.base / name, name)
    try:
        node.start()
        pid = node.driver.daemon.pid
        for number in range(rounds):
            devices = set(published_devices(rest, name))
            before = {item["metadata"]["uid"] for item in published_slices(rest, name)}
            node.harness.restart()
            restarted = time.monotonic()

            def republished(before: set[str] = before, devices: set[str] = devices) -> bool:
                items = published_slices(rest, name)
                fresh = all(item["metadata"]["uid"] not in before for item in items)
                return fresh and {d["name"] for i in items for d in i["spec"].get("devices") or []} == devices

            seconds = asyncio.run(_until(republished, restarted))
            if seconds is None:
                figures.problems.append(f"kubelet restart {number}: slices not back within {WAIT_S} s")
            else:
                figures.republish_after_kubelet_restart_s.append(seconds)
        if not node.driver.running or node.driver.daemon.pid != pid:
            figures.daemon_restarts += 1
            figures.problems.append("the driver did not survive the kubelet's restarts")
    finally:
        node.remove()


def _tainted(rest: Any, node: str, xid: int | None) -> bool:
    """Whether gpu-<TAINTED_GPU> carries the Xid taint (``xid`` None: any taint at all)."""
    device = published_devices(rest, node).get(f"gpu-{TAINTED_GPU}", {})
    taints = device.get("taints") or []
    if xid is None:
        return bool(taints)
    return any(t["key"] == XID_KEY and t.get("value") == str(xid) for t in taints)


async def _until(condition: Any, since: float) -> float | None:
    """Seconds from ``since`` until ``condition()`` held (polled every 50 ms), None after WAIT_S."""
    while time.monotonic() - since < WAIT_S:
        try:
            if await asyncio.to_thread(condition):
                return time.monotonic() - since
        except OSError:
            pass
        await asyncio.sleep(0.05)
    return None
