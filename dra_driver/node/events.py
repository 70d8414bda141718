"""What an operator must act on, as a Warning Event on the node's Node object.

Two claims whose CDI specs name one device (found when the store was lost and the claims
were rebuilt from their specs, :mod:`dra_driver.node.recovery`) are one such thing: the
younger is not recorded, and an operator decides which pod goes. The Event is on the
Node, not on a claim: a claim rebuilt from its spec is known by its uid alone. Posting is
best effort: the log line names both claims whether or not the API server takes it.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, datetime

import aiohttp
import structlog

from dra_driver.apiserver.rest import ApiError, JsonApi
from dra_driver.node.recovery import CONFLICT_ADVICE, Conflict

log = structlog.get_logger(__name__)

CONFLICT_REASON = "PreparedClaimsConflict"


async def report_conflicts(
    api: JsonApi, conflicts: Iterable[Conflict], *, node_name: str, node_uid: str | None, driver: str
) -> None:
    """One Warning Event on the Node per conflict; a refusal is logged, never raised.

    In the namespace default: the API server keeps an Event about a cluster-scoped object there
    (or in kube-system) and nowhere else, which is where the kubelet's own Node Events are too.
    """
    for conflict in conflicts:
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{node_name}.", "namespace": "default"},
            "involvedObject": {"apiVersion": "v1", "kind": "Node", "name": node_name, "uid": node_uid or ""},
            "reason": CONFLICT_REASON,
            "message": (
                f"claims {conflict.holder} and {conflict.uid} hold one device; {conflict.uid} is not "
                f"recorded: {conflict.reason}. What to do: {CONFLICT_ADVICE}"
            ),
            "type": "Warning",
            "source": {"component": driver, "host": node_name},
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        try:
            await api.create("/api/v1/namespaces/default/events", body)
        except (ApiError, aiohttp.ClientError, TimeoutError) as error:
            log.warning("could not post the conflict as an Event", claim_uid=conflict.uid, error=str(error))
