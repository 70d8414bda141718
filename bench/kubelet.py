"""The kubelet's side of the two sockets: the plugin watcher's registration and the DRA calls.

Every answer is checked: a benchmark that timed errors would report nonsense, so any claim the
daemon fails to prepare stops the run with the daemon's own message.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import grpc

from dra_driver.kubelet.pb.dra.v1 import dra_pb2, dra_pb2_grpc
from dra_driver.kubelet.pb.pluginregistration import registration_pb2, registration_pb2_grpc
from dra_driver.node.types import ClaimRef

# The kubelet's own deadlines (plugin watcher: GetInfo 1 s, NotifyRegistrationStatus 5 s; prepare 45 s).
GET_INFO_TIMEOUT_S = 1.0
NOTIFY_TIMEOUT_S = 5.0
PREPARE_TIMEOUT_S = 45.0


class BenchFailure(RuntimeError):
    """The daemon answered something other than success; the message says what."""


async def register(registration_socket: Path, driver: str) -> Path:
    """GetInfo + NotifyRegistrationStatus(registered) as the plugin watcher does; returns the endpoint."""
    async with grpc.aio.insecure_channel(f"unix:{registration_socket}") as channel:
        stub = registration_pb2_grpc.RegistrationStub(channel)
        info = await stub.GetInfo(registration_pb2.InfoRequest(), timeout=GET_INFO_TIMEOUT_S)
        if info.type != "DRAPlugin" or info.name != driver or "v1.DRAPlugin" not in info.supported_versions:
            raise BenchFailure(f"unexpected plugin info from {registration_socket}: {info}")
        await stub.NotifyRegistrationStatus(
            registration_pb2.RegistrationStatus(plugin_registered=True), timeout=NOTIFY_TIMEOUT_S
        )
        return Path(info.endpoint)


class DraClient:
    """NodePrepareResources / NodeUnprepareResources (v1) over one connection, as one kubelet holds."""

    def __init__(self, dra_socket: Path) -> None:
        self._channel = grpc.aio.insecure_channel(f"unix:{dra_socket}")
        self._stub = dra_pb2_grpc.DRAPluginStub(self._channel)

    async def close(self) -> None:
        await self._channel.close(grace=None)

    async def prepare(self, claims: Sequence[ClaimRef]) -> float:
        """One pod's prepare call; returns its latency in seconds."""
        request = dra_pb2.NodePrepareResourcesRequest(claims=[_claim(ref) for ref in claims])
        started = time.perf_counter()
        response = await self._stub.NodePrepareResources(request, timeout=PREPARE_TIMEOUT_S)
        elapsed = time.perf_counter() - started
        for ref in claims:
            answer = response.claims.get(ref.uid)
            if answer is None or answer.error or not all(d.cdi_device_ids for d in answer.devices):
                raise BenchFailure(f"prepare of {ref} failed: {answer}")
            if not answer.devices:
                raise BenchFailure(f"prepare of {ref} returned no device")
        return elapsed

    async def unprepare(self, claims: Sequence[ClaimRef]) -> float:
        """One pod's unprepare call; returns its latency in seconds."""
        request = dra_pb2.NodeUnprepareResourcesRequest(claims=[_claim(ref) for ref in claims])
        started = time.perf_counter()
        response = await self._stub.NodeUnprepareResources(request, timeout=PREPARE_TIMEOUT_S)
        elapsed = time.perf_counter() - started
        for ref in claims:
            answer = response.claims.get(ref.uid)
            if answer is None or answer.error:
                raise BenchFailure(f"unprepare of {ref} failed: {answer}")
        return elapsed

    async def empty_prepare(self) -> float:
        """A prepare call with no claim: the gRPC round trip through the daemon, and nothing else."""
        started = time.perf_counter()
        await self._stub.NodePrepareResources(
            dra_pb2.NodePrepareResourcesRequest(), timeout=PREPARE_TIMEOUT_S
        )
        return time.perf_counter() - started


def _claim(ref: ClaimRef) -> dra_pb2.Claim:
    return dra_pb2.Claim(namespace=ref.namespace, name=ref.name, uid=ref.uid)
