"""Starting the kubelet-plugin daemon: the kubelet's sockets first, everything else behind them.

The kubelet registers a plugin the moment its registration socket answers, and it waits for
nothing else of it. So the daemon checks its settings (a bad one still ends the start with
its one line before anything opens), imports only what the sockets need (grpc, the
generated protos, :mod:`dra_driver.kubelet`), serves the DRA socket and then the
registration socket, and only then imports and builds the rest: the API client, the GPUs,
the node's store, the slices, the status server (:func:`dra_driver.gpu_plugin.app.serve_node`). Claim
calls that arrive meanwhile wait for the preparer (:mod:`dra_driver.kubelet.deferred`
says what the kubelet makes of that); ``/readyz`` says not-ready until the plugin is
registered and its slices are published, as before.

A start that fails after the sockets opened answers the held calls with its error,
removes the sockets, and ends with the same one-line error as a failure before them.
"""

from __future__ import annotations

import asyncio
import signal
import time

import structlog

from dra_driver.gpu_plugin.startup import check_before_starting
from dra_driver.gpu_plugin.tuning import import_off_the_loop
from dra_driver.kubelet.deferred import DeferredPreparer
from dra_driver.kubelet.front import KubeletFront
from dra_driver.kubelet.health import HealthBoard
from dra_driver.kubelet.server import KubeletPlugin
from dra_driver.settings import Settings

log = structlog.get_logger("dra_driver.gpu_plugin.launch")


async def run_plugin(settings: Settings, stop: asyncio.Event | None = None) -> None:
    """Run the daemon until SIGTERM/SIGINT (or ``stop``); leaves no socket of its own behind."""
    started = time.monotonic()
    stop = stop or _stop_on_signals()
    check_before_starting(settings)  # what the user can get wrong, before anything is logged or opened
    claims = DeferredPreparer()
    health = HealthBoard()
    plugin = KubeletPlugin(
        settings.driver_name,
        claims,
        health_feed=health,
        plugins_dir=settings.plugins_dir,
        registry_dir=settings.registry_dir,
        pod_uid=settings.pod_uid or None,
    )
    await plugin.start()
    try:
        # The kube client, aiohttp, the GPU backends: 0.3 s and more of imports, while the kubelet
        # registers us. In a thread: the event loop must answer GetInfo meanwhile (the kubelet
        # gives it 1 s), and an import holds the loop for as long as it runs.
        await import_off_the_loop("dra_driver.gpu_plugin.app")
        from dra_driver.gpu_plugin.app import serve_node

        await serve_node(settings, KubeletFront(plugin, claims, health), stop, started)
    except BaseException as err:
        claims.failed(str(err) or type(err).__name__)
        raise
    finally:
        await plugin.stop()


def _stop_on_signals() -> asyncio.Event:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop
