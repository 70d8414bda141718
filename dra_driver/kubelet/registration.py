"""The plugin watcher's Registration service: how the kubelet learns about the driver.

The kubelet finds our registration socket, asks :meth:`GetInfo` (with a 1 s timeout,
so it must answer from memory), dials the endpoint it returns, and tells us the outcome
with :meth:`NotifyRegistrationStatus`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import grpc
import structlog
from google.protobuf.descriptor import ServiceDescriptor

from dra_driver.kubelet.pb.pluginregistration import registration_pb2 as pb
from dra_driver.kubelet.pb.pluginregistration import registration_pb2_grpc as pb_grpc

log = structlog.get_logger(__name__)

DRA_PLUGIN_TYPE = "DRAPlugin"


def advertised_name(service: ServiceDescriptor) -> str:
    """How ``supported_versions`` names a gRPC service: ``<last package element>.<Service>``.

    Derived from the generated descriptor, so the advertised name cannot drift from the
    service actually served (``k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin`` -> ``v1.DRAPlugin``).
    """
    return f"{service.file.package.rsplit('.', 1)[-1]}.{service.name}"


class RegistrationServicer(pb_grpc.RegistrationServicer):
    """Answers the kubelet's plugin watcher and records whether the kubelet accepted us.

    ``registered`` is set while the kubelet's last word was an acceptance; ``error`` holds
    the kubelet's reason when it rejected the plugin.
    """

    def __init__(self, driver_name: str, endpoint: str, supported_versions: Sequence[str]) -> None:
        """``endpoint``: absolute path of the DRA socket; ``supported_versions``: most preferred first,
        because the kubelet takes the first entry it knows."""
        self._info = pb.PluginInfo(
            type=DRA_PLUGIN_TYPE,
            name=driver_name,
            endpoint=endpoint,
            supported_versions=supported_versions,
        )
        self.registered = asyncio.Event()
        self.error: str | None = None

    async def GetInfo(
        self, request: pb.InfoRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.PluginInfo:
        log.debug("kubelet asked for plugin info", endpoint=self._info.endpoint)
        return self._info

    async def NotifyRegistrationStatus(
        self, request: pb.RegistrationStatus, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.RegistrationStatusResponse:
        if request.plugin_registered:
            self.error = None
            self.registered.set()
            log.info("registered with the kubelet", driver=self._info.name, endpoint=self._info.endpoint)
        else:
            self.error = request.error or "the kubelet gave no reason"
            self.registered.clear()
            log.error(
                "the kubelet rejected the plugin registration; check the kubelet's log and version",
                driver=self._info.name,
                error=self.error,
                supported_versions=list(self._info.supported_versions),
            )
        return pb.RegistrationStatusResponse()
