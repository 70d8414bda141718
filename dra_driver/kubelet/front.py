"""What the kubelet talks to from the daemon's first moments: its sockets, the held claim calls, health.

The launcher (:mod:`dra_driver.gpu_plugin.launch`) opens these before anything else and hands them to the
wiring (:mod:`dra_driver.gpu_plugin.app`), which fills them in once the node is ready. The bundle lives in
this layer, not with either of them, so that neither has to import the other for it.
"""

from __future__ import annotations

from dataclasses import dataclass

from dra_driver.kubelet.deferred import DeferredPreparer
from dra_driver.kubelet.health import HealthBoard
from dra_driver.kubelet.server import KubeletPlugin


@dataclass(frozen=True)
class KubeletFront:
    """What the kubelet already talks to while the rest of the daemon starts."""

    plugin: KubeletPlugin
    claims: DeferredPreparer  # hand it the real preparer once the store is repaired
    health: HealthBoard  # the devices' health, streamed to the kubelet
