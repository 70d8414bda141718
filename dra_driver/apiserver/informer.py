"""A list-then-watch loop on :class:`JsonApi`, like an informer (ComputeDomain controller, webhook)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import structlog

from dra_driver.apiserver.rest import ApiError, Json, JsonApi

log = structlog.get_logger(__name__)

_GONE = 410


async def list_and_watch(
    kube: JsonApi,
    path: str,
    on_event: Callable[[str, Json], Awaitable[None] | None],
    *,
    resync_seconds: float,
    label_selector: str = "",
    field_selector: str = "",
    retry_seconds: float = 1.0,
    on_listed: Callable[[list[Json]], None] | None = None,
) -> None:
    """Call ``on_event(type, object)`` for every object of ``path``, for ever: like an informer.

    Every ``resync_seconds`` (and after any watch failure) the collection is listed again and each
    object delivered as ``"SYNC"``, so a missed event is repaired within one resync period.
    ``on_listed`` gets each listing whole first, for a cache to drop what is no longer there.
    """
    while True:
        try:
            selectors = {"labelSelector": label_selector, "fieldSelector": field_selector}
            listed = await kube.list(path, **{key: value for key, value in selectors.items() if value})
            if on_listed is not None:
                on_listed(list(listed.get("items") or []))
            for item in listed.get("items") or []:
                await _deliver(on_event, "SYNC", item)
            version = str(listed["metadata"]["resourceVersion"])
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(resync_seconds):
                    while True:
                        events = kube.watch(
                            path, version, label_selector=label_selector, field_selector=field_selector
                        )
                        async with contextlib.aclosing(events):
                            async for event in events:
                                obj = event.get("object") or {}
                                version = obj.get("metadata", {}).get("resourceVersion", version)
                                if event.get("type") != "BOOKMARK":
                                    await _deliver(on_event, str(event.get("type")), obj)
        except asyncio.CancelledError:
            raise
        except Exception as error:  # an outage or an expired version: list afresh after a pause
            if not (isinstance(error, ApiError) and error.status == _GONE):
                log.warning(
                    "watch failed; listing again", path=path, error=str(error) or type(error).__name__
                )
                await asyncio.sleep(retry_seconds)


async def _deliver(on_event: Callable[[str, Json], Awaitable[None] | None], kind: str, obj: Json) -> None:
    result = on_event(kind, obj)
    if result is not None:
        await result
