"""The /healthz, /readyz and /metrics endpoint for probes and Prometheus.

The probes must answer the kubelet, which reaches the pod from outside, so the server listens on
http_address, all addresses by default. /metrics has no authentication and names every prepared
claim (namespace, name, UID) and its GPU: it is answered only to connections from localhost (kubectl
port-forward, a sidecar) unless metrics_public asks for every client; the chart then ships a
NetworkPolicy naming who may scrape. A connection's source address is the kernel's: a packet from
outside claiming a loopback source is dropped before it reaches a socket.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from dra_driver.gpu_plugin.metrics import Metrics
from dra_driver.settings import http_host_port

ReadinessCheck = Callable[[], str | None]
"""Returns ``None`` when ready, otherwise why not (shown to whoever probes)."""


class StatusServer:
    """Liveness answers while the event loop runs; readiness asks the daemon's checks.

    ``readiness`` may be replaced while serving: the server starts before the daemon's parts exist.
    """

    def __init__(
        self, address: str, metrics: Metrics, readiness: ReadinessCheck, *, metrics_public: bool = False
    ) -> None:
        """ValueError unless ``address`` is host:port (see :func:`~dra_driver.settings.http_host_port`)."""
        self._host, self._port = http_host_port(address)
        self._metrics = metrics
        self._metrics_public = metrics_public
        self.readiness = readiness
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

    async def start(self) -> None:
        """Listen; OSError when the host refuses the address (not its own, port taken, unknown name)."""
        app = web.Application()
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/metrics", self._metrics_page)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self._host, self._port)
        await site.start()
        server = site._server  # the bound port matters when 0 was asked for
        sockets = getattr(server, "sockets", None) or []
        self.port = sockets[0].getsockname()[1] if sockets else self._port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _healthz(self, _: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def _readyz(self, _: web.Request) -> web.Response:
        reason = self.readiness()
        if reason is None:
            return web.Response(text="ok\n")
        return web.Response(status=503, text=f"not ready: {reason}\n")

    async def _metrics_page(self, request: web.Request) -> web.Response:
        if not self._metrics_public and not _from_localhost(request):
            return web.Response(
                status=403,
                text="/metrics is served to localhost only; set metrics_public (--metrics-public, "
                "DRA_METRICS_PUBLIC, the chart's metricsPublic) to serve it to every client\n",
            )
        body = generate_latest(self._metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def _from_localhost(request: web.Request) -> bool:
    try:
        return ipaddress.ip_address((request.remote or "").split("%", 1)[0]).is_loopback
    except ValueError:
        return False
