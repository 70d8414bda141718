"""The validating admission webhook: claims the driver could never serve, refused when written.

It serves ``POST /validate`` (AdmissionReview v1) over TLS, and ``GET /healthz``. The API server
calls it for ResourceClaims, ResourceClaimTemplates and DeviceClasses (the chart's
ValidatingWebhookConfiguration). It refuses (:mod:`dra_driver.node.admission`)

* opaque configs for the driver that prepare would refuse; this needs nothing from the cluster;
* capacity requests that no device of the driver could ever take. For these it lists and watches
  the driver's ResourceSlices and the DeviceClasses (read only: the chart's webhook role), and
  keeps what each of the driver's classes offers (:class:`OfferIndex`). Until it has listed them,
  and where it has no API access at all, it allows every capacity request: it never refuses what
  it cannot judge.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from pathlib import Path

import structlog
from aiohttp import web

from dra_driver.apiserver import bounded_json
from dra_driver.apiserver.informer import list_and_watch
from dra_driver.apiserver.rest import Json, JsonApi
from dra_driver.node.admission import refusal, review
from dra_driver.resources.capacity_fit import OfferIndex

log = structlog.get_logger(__name__)

SLICES = "/apis/resource.k8s.io/v1/resourceslices"
CLASSES = "/apis/resource.k8s.io/v1/deviceclasses"
_RESYNC_S = 600.0  # a missed event is repaired by the next listing
_RETRY_S = 5.0  # after a failed list or watch (an outage, a missing permission)


def webhook_app(driver_name: str, offers: OfferIndex | None = None) -> web.Application:
    async def validate(request: web.Request) -> web.Response:
        try:
            body, pruned = bounded_json.loads_pruned(await request.read())
        except ValueError:
            return web.json_response({"error": "the body is not JSON"}, status=400)
        if pruned:  # answered, refusing: the request's uid is near the top, the deep part is not read
            answer = refusal(body, bounded_json.too_deep_message("the object"))
        else:
            answer = review(body, driver_name, offers)
        if not answer["response"]["allowed"]:
            asked = body.get("request") or {} if isinstance(body, dict) else {}
            log.info(
                "refused",
                kind=(asked.get("kind") or {}).get("kind"),
                namespace=asked.get("namespace"),
                name=asked.get("name"),
                message=answer["response"]["status"]["message"],
            )
        return web.json_response(answer)

    async def healthz(_request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/validate", validate)
    app.router.add_get("/healthz", healthz)
    return app


async def watch_offers(api: JsonApi, offers: OfferIndex) -> None:
    """Keep ``offers`` up to date with the driver's ResourceSlices and the DeviceClasses, for ever."""

    def slices_listed(items: list[Json]) -> None:
        offers.replace_slices(items)
        log.info("listed the driver's ResourceSlices", slices=len(items), devices=offers.device_count)

    def on_slice(kind: str, obj: Json) -> None:
        if kind in ("ADDED", "MODIFIED"):
            offers.put_slice(obj)
        elif kind == "DELETED":
            offers.drop_slice(obj)

    def on_class(kind: str, obj: Json) -> None:
        if kind in ("ADDED", "MODIFIED"):
            offers.put_class(obj)
        elif kind == "DELETED":
            offers.drop_class(obj)

    async with asyncio.TaskGroup() as tasks:
        tasks.create_task(
            list_and_watch(
                api,
                CLASSES,
                on_class,
                resync_seconds=_RESYNC_S,
                retry_seconds=_RETRY_S,
                on_listed=offers.replace_classes,
            )
        )
        tasks.create_task(
            list_and_watch(
                api,
                SLICES,
                on_slice,
                resync_seconds=_RESYNC_S,
                field_selector=f"spec.driver={offers.driver}",
                retry_seconds=_RETRY_S,
                on_listed=slices_listed,
            )
        )


async def serve_webhook(
    driver_name: str,
    address: str,
    cert_file: Path,
    key_file: Path,
    stop: asyncio.Event,
    api: JsonApi | None = None,
) -> None:
    """Serve until ``stop`` is set; with ``api``, capacity requests are judged too."""
    host, _, port = address.rpartition(":")
    if not port.isdigit():
        raise ValueError(f"webhook address {address!r} must be host:port, e.g. 0.0.0.0:8443")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert_file, key_file)
    offers = OfferIndex(driver_name) if api is not None else None
    runner = web.AppRunner(webhook_app(driver_name, offers), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host or "0.0.0.0", int(port), ssl_context=context)
    await site.start()
    watching = asyncio.create_task(watch_offers(api, offers)) if api and offers else None
    log.info(
        "serving the validating webhook",
        address=address,
        driver=driver_name,
        capacity_requests="checked" if watching else "not checked (no API access)",
    )
    try:
        await stop.wait()
    finally:
        if watching is not None:
            watching.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watching
        await runner.cleanup()
