"""The validating admission webhook: opaque configs refused when written (:mod:`dra_driver.node.admission`).

It serves ``POST /validate`` (AdmissionReview v1) over TLS, and ``GET /healthz``. The API server
calls it for ResourceClaims, ResourceClaimTemplates and DeviceClasses (the chart's
ValidatingWebhookConfiguration); it reads nothing from the cluster and needs no permissions.
"""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path

import structlog
from aiohttp import web

from dra_driver.node.admission import review

log = structlog.get_logger(__name__)


def webhook_app(driver_name: str) -> web.Application:
    async def validate(request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except ValueError:
            return web.json_response({"error": "the body is not JSON"}, status=400)
        answer = review(body, driver_name)
        if not answer["response"]["allowed"]:
            log.info("refused an opaque config", message=answer["response"]["status"]["message"])
        return web.json_response(answer)

    async def healthz(_request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/validate", validate)
    app.router.add_get("/healthz", healthz)
    return app


async def serve_webhook(
    driver_name: str, address: str, cert_file: Path, key_file: Path, stop: asyncio.Event
) -> None:
    host, _, port = address.rpartition(":")
    if not port.isdigit():
        raise ValueError(f"webhook address {address!r} must be host:port, e.g. 0.0.0.0:8443")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert_file, key_file)
    runner = web.AppRunner(webhook_app(driver_name), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host or "0.0.0.0", int(port), ssl_context=context)
    await site.start()
    log.info("serving the validating webhook", address=address, driver=driver_name)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
