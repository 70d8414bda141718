"""The DRA plugin services, v1 and v1beta1: kubelet messages in, domain objects out.

Translation only. Which claims are ours, what to prepare and what every error says is
decided by the :class:`ClaimPreparer`. This module guarantees one thing on top: the
kubelet gets an entry for every claim it asked about, whatever happens below, because a
missing entry fails the pod with a message nobody can act on.

Requests are passed on as they are; empty names or UIDs are the preparer's to reject,
like every other problem with a claim.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

import grpc
import structlog

from dra_driver.kubelet.pb.dra.v1 import dra_pb2 as v1
from dra_driver.kubelet.pb.dra.v1 import dra_pb2_grpc as v1_grpc
from dra_driver.kubelet.pb.dra.v1beta1 import dra_pb2 as v1beta1
from dra_driver.kubelet.pb.dra.v1beta1 import dra_pb2_grpc as v1beta1_grpc
from dra_driver.node.types import ClaimError, ClaimPreparer, ClaimRef, PreparedDevice, PrepareOutcome

log = structlog.get_logger(__name__)

_Outcome = TypeVar("_Outcome")


class _ClaimMessage(Protocol):
    """A ``Claim`` of either protocol version."""

    @property
    def namespace(self) -> str: ...
    @property
    def name(self) -> str: ...
    @property
    def uid(self) -> str: ...


def _claim_refs(claims: Iterable[_ClaimMessage]) -> list[ClaimRef]:
    return [ClaimRef(namespace=c.namespace, name=c.name, uid=c.uid) for c in claims]


async def _prepare_claims(preparer: ClaimPreparer, claims: Sequence[ClaimRef]) -> dict[str, PrepareOutcome]:
    """Prepare ``claims``; return an outcome for exactly these claims, keyed by UID."""
    try:
        outcomes = await preparer.prepare(claims)
    except Exception as exc:
        log.exception("preparer raised", operation="prepare", claims=[str(c) for c in claims])
        return dict.fromkeys((c.uid for c in claims), _internal_error("preparing", exc))
    return _one_per_claim("prepare", claims, outcomes)


async def _unprepare_claims(
    preparer: ClaimPreparer, claims: Sequence[ClaimRef]
) -> dict[str, ClaimError | None]:
    """Unprepare ``claims``; return ``None`` or an error for exactly these claims, keyed by UID."""
    try:
        outcomes = await preparer.unprepare(claims)
    except Exception as exc:
        log.exception("preparer raised", operation="unprepare", claims=[str(c) for c in claims])
        return dict.fromkeys((c.uid for c in claims), _internal_error("unpreparing", exc))
    return _one_per_claim("unprepare", claims, outcomes)


def _internal_error(doing: str, exc: Exception) -> ClaimError:
    return ClaimError(
        f"internal error in the DRA driver while {doing} the claim ({type(exc).__name__}: {exc}); "
        "the driver's log has the details"
    )


def _one_per_claim(
    operation: str, claims: Sequence[ClaimRef], outcomes: Mapping[str, _Outcome | ClaimError]
) -> dict[str, _Outcome | ClaimError]:
    """Keep the outcomes of the requested claims; stand in an error for any the preparer skipped."""
    result: dict[str, _Outcome | ClaimError] = {}
    for claim in claims:
        if claim.uid in outcomes:
            result[claim.uid] = outcomes[claim.uid]
        else:
            log.error("preparer returned no outcome for a claim", operation=operation, claim=str(claim))
            result[claim.uid] = ClaimError(
                f"internal error in the DRA driver: {operation} returned no result for this claim"
            )
    if unrequested := outcomes.keys() - result.keys():
        log.error(
            "preparer returned outcomes for claims not in the request",
            operation=operation,
            uids=sorted(unrequested),
        )
    return result


def _error_text(error: ClaimError) -> str:
    # An empty error string means success on the wire; never let a failure read as one.
    return error.message or "the DRA driver failed this claim without giving a reason"


def _v1_device(device: PreparedDevice) -> v1.Device:
    message = v1.Device(
        request_names=device.requests,
        pool_name=device.pool,
        device_name=device.device,
        cdi_device_ids=device.cdi_device_ids,
    )
    if device.share_id is not None:
        message.share_id = device.share_id
    return message


def _v1beta1_device(device: PreparedDevice) -> v1beta1.Device:
    # v1beta1 has no share id: kubelets that speak only v1beta1 predate consumable capacity.
    return v1beta1.Device(
        request_names=device.requests,
        pool_name=device.pool,
        device_name=device.device,
        cdi_device_ids=device.cdi_device_ids,
    )


class _DraServicer:
    """The DRAPlugin service of either API version. Their messages differ only in their module and
    in v1's share id, so one implementation serves both; ``messages`` is the version's module and
    ``device`` builds its Device message."""

    def __init__(
        self, preparer: ClaimPreparer, messages: Any, device: Callable[[PreparedDevice], Any]
    ) -> None:
        self._preparer = preparer
        self._messages = messages
        self._device = device

    async def NodePrepareResources(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        outcomes = await _prepare_claims(self._preparer, _claim_refs(request.claims))
        response = self._messages.NodePrepareResourcesResponse()
        for uid, outcome in outcomes.items():
            entry = response.claims[uid]  # creates the entry, also for a claim without devices
            if isinstance(outcome, ClaimError):
                entry.error = _error_text(outcome)
            else:
                entry.devices.extend(self._device(d) for d in outcome)
        return response

    async def NodeUnprepareResources(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        outcomes = await _unprepare_claims(self._preparer, _claim_refs(request.claims))
        response = self._messages.NodeUnprepareResourcesResponse()
        for uid, error in outcomes.items():
            response.claims[uid].error = "" if error is None else _error_text(error)
        return response


class DraV1Servicer(_DraServicer, v1_grpc.DRAPluginServicer):
    """``k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin``, called by kubelets 1.34 and newer."""

    def __init__(self, preparer: ClaimPreparer) -> None:
        super().__init__(preparer, v1, _v1_device)


class DraV1Beta1Servicer(_DraServicer, v1beta1_grpc.DRAPluginServicer):
    """``k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin``, for kubelets that do not speak v1."""

    def __init__(self, preparer: ClaimPreparer) -> None:
        super().__init__(preparer, v1beta1, _v1beta1_device)
