"""The kubelet plugin: both unix sockets and the gRPC servers behind them.

Start-up order matters: right after GetInfo the kubelet dials the endpoint it was
given, so the DRA socket serves before the registration socket appears. Shutdown goes
the other way round: the registration socket goes first, which makes the kubelet
unregister the plugin, then in-flight calls on the DRA socket get a grace period.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import grpc
import structlog
from google.protobuf.descriptor import ServiceDescriptor

from dra_driver.kubelet.dra_plugin import DraV1Beta1Servicer, DraV1Servicer
from dra_driver.kubelet.health import (
    DEFAULT_RESEND_INTERVAL_S,
    DeviceHealthFeed,
    HealthStreams,
    HealthV1Alpha1Servicer,
    HealthV1Servicer,
)
from dra_driver.kubelet.pb.dra.v1 import dra_pb2 as dra_v1
from dra_driver.kubelet.pb.dra.v1 import dra_pb2_grpc as dra_v1_grpc
from dra_driver.kubelet.pb.dra.v1beta1 import dra_pb2 as dra_v1beta1
from dra_driver.kubelet.pb.dra.v1beta1 import dra_pb2_grpc as dra_v1beta1_grpc
from dra_driver.kubelet.pb.health.v1 import health_pb2 as health_v1
from dra_driver.kubelet.pb.health.v1 import health_pb2_grpc as health_v1_grpc
from dra_driver.kubelet.pb.health.v1alpha1 import health_pb2 as health_v1alpha1
from dra_driver.kubelet.pb.health.v1alpha1 import health_pb2_grpc as health_v1alpha1_grpc
from dra_driver.kubelet.pb.pluginregistration import registration_pb2_grpc
from dra_driver.kubelet.registration import RegistrationServicer, advertised_name
from dra_driver.kubelet.sockets import KubeletSocketError, PublishedSocket, socket_paths
from dra_driver.node.types import ClaimPreparer

log = structlog.get_logger(__name__)

DEFAULT_PLUGINS_DIR = Path("/var/lib/kubelet/plugins")
DEFAULT_REGISTRY_DIR = Path("/var/lib/kubelet/plugins_registry")
DEFAULT_MAX_MESSAGE_BYTES = 4 * 2**20  # gRPC's own default; kubelet messages take a few KiB


@dataclass(frozen=True)
class _Service:
    descriptor: ServiceDescriptor
    add_to_server: Callable[[grpc.aio.Server], None]


class KubeletPlugin:
    """Serves the kubelet: registration, DRA v1 + v1beta1 and, given a feed, device health.

    Construction only computes and checks the socket paths; :meth:`start` creates the
    sockets and :meth:`stop` removes them (never another instance's). An instance serves
    once: start, then stop.
    """

    def __init__(
        self,
        driver_name: str,
        preparer: ClaimPreparer,
        *,
        health_feed: DeviceHealthFeed | None = None,
        plugins_dir: Path = DEFAULT_PLUGINS_DIR,
        registry_dir: Path = DEFAULT_REGISTRY_DIR,
        pod_uid: str | None = None,
        health_resend_interval: float = DEFAULT_RESEND_INTERVAL_S,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        """
        ``plugins_dir`` and ``registry_dir`` must be the kubelet's own paths, mounted at the
        same place in the container: the DRA socket path is passed to the kubelet verbatim.
        ``pod_uid`` gives this instance socket names of its own (rolling updates).
        Raises :class:`~dra_driver.kubelet.sockets.KubeletSocketError` when a path is too long.
        """
        paths = socket_paths(driver_name, plugins_dir, registry_dir, pod_uid)
        self._dra_socket = PublishedSocket(paths.dra)
        self._registration_socket = PublishedSocket(paths.registration)
        self._options = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
        ]

        # Most preferred first: the kubelet uses the first DRAPlugin version it knows.
        self._dra_services = [
            _Service(
                dra_v1.DESCRIPTOR.services_by_name["DRAPlugin"],
                partial(dra_v1_grpc.add_DRAPluginServicer_to_server, DraV1Servicer(preparer)),
            ),
            _Service(
                dra_v1beta1.DESCRIPTOR.services_by_name["DRAPlugin"],
                partial(dra_v1beta1_grpc.add_DRAPluginServicer_to_server, DraV1Beta1Servicer(preparer)),
            ),
        ]
        self._health_streams: HealthStreams | None = None
        if health_feed is not None:
            streams = self._health_streams = HealthStreams(health_feed, health_resend_interval)
            self._dra_services += [
                _Service(
                    health_v1alpha1.DESCRIPTOR.services_by_name["DRAResourceHealth"],
                    partial(
                        health_v1alpha1_grpc.add_DRAResourceHealthServicer_to_server,
                        HealthV1Alpha1Servicer(streams),
                    ),
                ),
                _Service(
                    health_v1.DESCRIPTOR.services_by_name["DRAResourceHealth"],
                    partial(
                        health_v1_grpc.add_DRAResourceHealthServicer_to_server, HealthV1Servicer(streams)
                    ),
                ),
            ]

        self._supported_versions = [advertised_name(s.descriptor) for s in self._dra_services]
        self.registration = RegistrationServicer(
            driver_name, endpoint=str(paths.dra), supported_versions=self._supported_versions
        )
        self._dra_server: grpc.aio.Server | None = None
        self._registration_server: grpc.aio.Server | None = None

    @property
    def dra_socket(self) -> Path:
        return self._dra_socket.path

    @property
    def registration_socket(self) -> Path:
        return self._registration_socket.path

    async def start(self) -> None:
        """Serve the DRA socket, then publish the registration socket so the kubelet finds us.

        Raises :class:`~dra_driver.kubelet.sockets.KubeletSocketError` when a socket
        cannot be created; nothing is left behind then.
        """
        try:
            self._dra_server = await self._serve(
                self._dra_socket, [s.add_to_server for s in self._dra_services]
            )
            self._registration_server = await self._serve(
                self._registration_socket,
                [partial(registration_pb2_grpc.add_RegistrationServicer_to_server, self.registration)],
            )
        except BaseException:
            await self.stop(grace=None)
            raise
        log.debug(  # the daemon says it serves once it is ready; a failed start says only why
            "kubelet sockets open",
            dra_socket=str(self.dra_socket),
            registration_socket=str(self.registration_socket),
            services=self._supported_versions,
        )

    async def stop(self, grace: float | None = 5.0) -> None:
        """Unregister from the kubelet, end health streams, and give in-flight calls ``grace`` seconds.

        Safe to call more than once, and after a failed :meth:`start`.
        """
        # Removing a socket's name before stopping its server keeps the inode alive while we
        # compare it, so a file another instance put at that path is never mistaken for ours.
        self._registration_socket.remove()
        if self._registration_server is not None:
            await self._registration_server.stop(grace=None)
            self._registration_server = None
        if self._health_streams is not None:
            self._health_streams.close()
        self._dra_socket.remove()
        if self._dra_server is not None:
            await self._dra_server.stop(grace)
            self._dra_server = None

    async def _serve(
        self, socket: PublishedSocket, add_services: list[Callable[[grpc.aio.Server], None]]
    ) -> grpc.aio.Server:
        socket.prepare()
        server = grpc.aio.server(options=self._options)
        for add in add_services:
            add(server)
        try:
            server.add_insecure_port(socket.bind_address)
        except RuntimeError as exc:
            await server.stop(None)
            raise KubeletSocketError(
                f"cannot listen on {socket.path}: {exc}; check that its directory is writable"
            ) from exc
        await server.start()
        try:
            socket.publish()
        except BaseException:
            await server.stop(None)
            socket.remove()
            raise
        return server
