"""The /healthz, /readyz and /metrics endpoint for probes and Prometheus."""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from dra_driver.metrics import Metrics
from dra_driver.settings import http_host_port

ReadinessCheck = Callable[[], str | None]
"""Returns ``None`` when ready, otherwise why not (shown to whoever probes)."""


class StatusServer:
    """Liveness answers while the event loop runs; readiness asks the daemon's checks.

    ``readiness`` may be replaced while serving: the server starts before the daemon's parts exist.
    """

    def __init__(self, address: str, metrics: Metrics, readiness: ReadinessCheck) -> None:
        """ValueError unless ``address`` is host:port (see :func:`~dra_driver.settings.http_host_port`)."""
        self._host, self._port = http_host_port(address)
        self._metrics = metrics
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

    async def _metrics_page(self, _: web.Request) -> web.Response:
        body = generate_latest(self._metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
