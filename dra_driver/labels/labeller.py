"""Keeps the GFD-format labels of :mod:`dra_driver.labels.gfd` on the plugin's own Node.

The daemon hands it the labels the current inventory calls for (after every inventory or health
change); it writes only the difference, with a JSON merge patch of ``metadata.labels``, and
retries the latest desired labels until the API server has them. It touches only the keys GFD's
format defines (:func:`is_managed`): other ``nvidia.com/`` labels (the GPU operator's
``nvidia.com/gpu.deploy.*``, say) and everything else on the Node stay as they are. The chart's
admission policy enforces the same from the other side: the plugin's account may change only
``nvidia.com/`` labels, and only of its own node.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING

import structlog

from dra_driver.apiserver.rest import JsonApi
from dra_driver.labels.gfd import PREFIX

if TYPE_CHECKING:
    from kubernetes.aio.client import ApiClient

log = structlog.get_logger(__name__)

_FIXED = {
    "gpu.present", "gpu.machine", "gpu.count", "gpu.product", "gpu.memory", "gpu.replicas",
    "gpu.sharing-strategy", "gpu.family", "gpu.compute.major", "gpu.compute.minor",
    "mig.capable", "mig.strategy", "mps.capable",
    "cuda.driver.major", "cuda.driver.minor", "cuda.driver.rev", "cuda.runtime.major",
    "cuda.runtime.minor", "cuda.driver-version.major", "cuda.driver-version.minor",
    "cuda.driver-version.revision", "cuda.driver-version.full", "cuda.runtime-version.major",
    "cuda.runtime-version.minor", "cuda.runtime-version.full",
}  # fmt: skip
_MIG = re.compile(
    re.escape(PREFIX) + r"mig-[0-9]+g\.[0-9]+gb[a-z0-9.]*\.(count|product|memory|replicas|sharing-strategy|"
    r"multiprocessors|slices\.gi|slices\.ci|engines\.(copy|decoder|encoder|jpeg|ofa))"
)
MERGE_PATCH = "application/merge-patch+json"


def is_managed(key: str) -> bool:
    """Whether ``key`` is one of the labels this labeller sets (and so may remove)."""
    return (key.removeprefix(PREFIX) in _FIXED and key.startswith(PREFIX)) or _MIG.fullmatch(key) is not None


def label_patch(current: Mapping[str, str], desired: Mapping[str, str]) -> dict[str, str | None]:
    """The merge patch of ``metadata.labels`` from ``current`` to ``desired`` (None deletes)."""
    patch: dict[str, str | None] = {k: v for k, v in desired.items() if current.get(k) != v}
    patch |= {k: None for k in current if is_managed(k) and k not in desired}
    return patch


class NodeLabeller:
    def __init__(self, api: ApiClient, node_name: str, retry_seconds: float = 5.0) -> None:
        self._api = JsonApi(api)
        self._node = node_name
        self._retry = retry_seconds
        self._desired: Mapping[str, str] | None = None
        self._wake = asyncio.Event()
        self.synced = False

    def set_desired(self, labels: Mapping[str, str]) -> None:
        if labels != self._desired:
            self._desired = dict(labels)
            self.synced = False
            self._wake.set()

    async def run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            desired = self._desired
            if desired is None:
                continue
            try:
                await self._apply(desired)
            except Exception as err:  # an API outage must not stop the daemon; the labels wait
                log.warning("node labels not written; retrying", node=self._node, error=str(err))
                await asyncio.sleep(self._retry)
                self._wake.set()
                continue
            self.synced = desired == self._desired

    async def _apply(self, desired: Mapping[str, str]) -> None:
        path = f"/api/v1/nodes/{self._node}"
        node = await self._api.call("GET", path, request_timeout_s=10)
        current = (node.get("metadata") or {}).get("labels") or {}
        patch = label_patch(current, desired)
        if patch:
            await self._api.call(
                "PATCH",
                path,
                body={"metadata": {"labels": patch}},
                content_type=MERGE_PATCH,
                request_timeout_s=10,
            )
            log.info("node labels written", node=self._node, changed=len(patch))
