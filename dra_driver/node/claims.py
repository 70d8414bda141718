"""What a ResourceClaim says this node must prepare: pure checks on the claim's JSON.

The kubelet hands us only namespace, name and uid. Everything else comes from the
ResourceClaim object, read from the API server by :mod:`dra_driver.node.claim_fetcher`;
this module validates the identity before any I/O and then reads the allocation, keeping
only the results for our driver in our pool (one pool per node, named after the node).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from dra_driver.cdi.metadata import POD_CLAIM_NAME_ANNOTATION
from dra_driver.names import (
    DNS_LABEL_RULE,
    DNS_SUBDOMAIN_RULE,
    UID_RULE,
    is_dns_label,
    is_dns_subdomain,
    is_uid,
)
from dra_driver.node.types import ClaimRef
from dra_driver.resources.quantity import parse_quantity


class ClaimRejected(Exception):
    """This claim cannot be prepared; the message is for the user and says what to do."""


def check_ref(ref: ClaimRef) -> None:
    """Reject an identity that is not a valid namespace, claim name and uid, before any I/O."""
    if not is_dns_label(ref.namespace):
        raise ClaimRejected(f"invalid claim namespace {ref.namespace!r}: must be {DNS_LABEL_RULE}")
    if not is_dns_subdomain(ref.name):
        raise ClaimRejected(f"invalid claim name {ref.name!r}: must be {DNS_SUBDOMAIN_RULE}")
    if not is_uid(ref.uid):
        raise ClaimRejected(f"invalid claim uid {ref.uid!r}: must be {UID_RULE}")


class ConfigSource(Enum):
    FROM_CLASS = "FromClass"
    FROM_CLAIM = "FromClaim"


@dataclass(frozen=True)
class AllocationResult:
    """One device the scheduler allocated to the claim (``status.allocation.devices.results[]``)."""

    request: str  # "req", or "req/sub" for a firstAvailable subrequest
    pool: str
    device: str
    admin_access: bool = False
    share_id: str | None = None  # set for a share of a device with allowMultipleAllocations
    # What the share consumed (``consumedCapacity``), as whole numbers, by capacity name.
    consumed: tuple[tuple[str, int], ...] = ()

    @property
    def consumed_capacity(self) -> dict[str, int]:
        return dict(self.consumed)

    @property
    def parent_request(self) -> str:
        """The claim's request this result serves: what the kubelet matches containers against."""
        return self.request.partition("/")[0]


@dataclass(frozen=True)
class OpaqueConfig:
    """One opaque config entry for our driver (``status.allocation.devices.config[]``)."""

    index: int  # position in the allocation's config list, for error messages
    source: ConfigSource
    requests: tuple[str, ...]  # empty: all requests
    parameters: Any  # the raw JSON; decoded by dra_driver.node.config

    def describe(self) -> str:
        requests = f"requests [{', '.join(self.requests)}]" if self.requests else "all requests"
        return f"config[{self.index}] ({self.source.value}, {requests})"


@dataclass(frozen=True)
class AllocatedClaim:
    """The part of a claim's allocation this node prepares."""

    ref: ClaimRef
    results: tuple[AllocationResult, ...]  # only ours (our driver, our pool); never empty
    configs: tuple[OpaqueConfig, ...]  # only opaque configs for our driver, in allocation order
    # The pod's name for a claim made from its template (annotation resource.kubernetes.io/pod-claim-name)
    pod_claim_name: str | None = None


def allocated_claim(ref: ClaimRef, claim: Mapping[str, Any], driver: str, pool: str) -> AllocatedClaim:
    """Check that ``claim`` (the ResourceClaim's JSON) is the one the kubelet meant and allocated to us."""
    uid = _get(claim, "metadata", "uid")
    if uid != ref.uid:
        raise ClaimRejected(
            f"claim {ref.namespace}/{ref.name} was deleted and re-created (replaced): "
            f"expected uid {ref.uid}, found {uid}; the kubelet will retry with the new claim"
        )
    allocation = _get(claim, "status", "allocation")
    if not isinstance(allocation, Mapping):
        raise ClaimRejected(
            f"claim {ref} is not allocated; the scheduler allocates it before the pod reaches the node, "
            "so it was probably deallocated: check `kubectl describe resourceclaim`"
        )
    results = _list(allocation, "devices", "results")
    ours = tuple(_result(entry, pool) for entry in results if _is_ours(entry, driver, pool))
    if not ours:
        elsewhere = sorted({f"{e.get('driver')}/{e.get('pool')}" for e in results if isinstance(e, Mapping)})
        raise ClaimRejected(
            f"claim {ref} has no device of driver {driver} in pool {pool}: it is allocated to another "
            f"node's pool or another driver only (results: {', '.join(elsewhere) or 'none'})"
        )
    configs = tuple(
        config
        for index, entry in enumerate(_list(allocation, "devices", "config"))
        if (config := _opaque_config(index, entry, driver)) is not None
    )
    pod_claim_name = _get(claim, "metadata", "annotations", POD_CLAIM_NAME_ANNOTATION)
    return AllocatedClaim(
        ref=ref,
        results=ours,
        configs=configs,
        pod_claim_name=pod_claim_name if isinstance(pod_claim_name, str) and pod_claim_name else None,
    )


def _is_ours(entry: object, driver: str, pool: str) -> bool:
    return isinstance(entry, Mapping) and entry.get("driver") == driver and entry.get("pool") == pool


def _result(entry: Mapping[str, Any], pool: str) -> AllocationResult:
    request, device = entry.get("request"), entry.get("device")
    if not isinstance(request, str) or not request or not isinstance(device, str) or not device:
        raise ClaimRejected(f"malformed allocation result {dict(entry)!r}: request and device are required")
    share_id = entry.get("shareID")
    if share_id is not None and not (isinstance(share_id, str) and is_dns_label(share_id)):
        raise ClaimRejected(
            f"allocation result for device {device} has shareID {share_id!r}, which is not a share id "
            "the scheduler writes (a lower-case UUID)"
        )
    consumed = entry.get("consumedCapacity") or {}
    if not isinstance(consumed, Mapping):
        raise ClaimRejected(f"allocation result for device {device}: consumedCapacity must be a map")
    return AllocationResult(
        request=request,
        pool=pool,
        device=device,
        admin_access=entry.get("adminAccess") is True,
        share_id=share_id,
        consumed=tuple(
            (str(name), _whole_quantity(value, f"device {device}: consumedCapacity {name}"))
            for name, value in sorted(consumed.items())
        ),
    )


def _whole_quantity(value: object, what: str) -> int:
    """A non-negative Kubernetes quantity ("10Gi", "0", "1e3") as a whole number, rounded up.

    Rounded up as the scheduler's ``Quantity.Value()`` does, so that a share is never limited
    to less than it was given.
    """
    try:
        quantity = parse_quantity(value) if isinstance(value, str) else None
    except ValueError:
        quantity = None
    if quantity is None or quantity < 0:
        raise ClaimRejected(f"{what}: {value!r} is not a non-negative quantity such as 10Gi")
    return math.ceil(quantity)


def _opaque_config(index: int, entry: object, driver: str) -> OpaqueConfig | None:
    if not isinstance(entry, Mapping):
        return None
    opaque = entry.get("opaque")
    if not isinstance(opaque, Mapping) or opaque.get("driver") != driver:
        return None  # another driver's config, or a kind of config this API version does not know
    requests = entry.get("requests") or []
    try:
        source = ConfigSource(entry.get("source"))
    except ValueError:
        raise ClaimRejected(
            f"config[{index}] has unknown source {entry.get('source')!r} (expected FromClass or FromClaim)"
        ) from None
    return OpaqueConfig(
        index=index,
        source=source,
        requests=tuple(str(r) for r in requests),
        parameters=opaque.get("parameters"),
    )


def _get(obj: Mapping[str, Any], *path: str) -> Any:
    value: Any = obj
    for key in path:
        if not isinstance(value, Mapping):
            return None
        value = value.get(key)
    return value


def _list(obj: Mapping[str, Any], *path: str) -> list[Any]:
    value = _get(obj, *path)
    return value if isinstance(value, list) else []
