"""Opaque configs checked when a claim is written, with the words prepare would use.

A claim whose config for this driver is misspelt is allocated and then fails at prepare; the
pod never starts and only an event says why. The validating webhook (:mod:`dra_driver.webhook`)
refuses it when it is created instead, with the decoder prepare uses
(:func:`dra_driver.node.config.decode_entry`), so the message is the same. Only the index can
differ: here it counts the entries of the object written (a claim's, a template's, a class's),
at prepare the entries of the allocation, where the class's configs come first.

A config whose requests name every request of the claim is described as applying to "all
requests": the 1.37 scheduler's allocator clears such a list in the allocation ("empty means
all"), so that is what prepare says of it (seen on the real node, e2e/real_node/test_webhook.py).
Before 1.37 the allocation keeps the names, and prepare lists them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dra_driver.node.claims import ConfigSource, OpaqueConfig
from dra_driver.node.config import ConfigError, decode_entry

# kind -> (path to the config list, where its configs come from)
_CONFIGS: dict[str, tuple[tuple[str, ...], ConfigSource]] = {
    "ResourceClaim": (("spec", "devices", "config"), ConfigSource.FROM_CLAIM),
    "ResourceClaimTemplate": (("spec", "spec", "devices", "config"), ConfigSource.FROM_CLAIM),
    "DeviceClass": (("spec", "config"), ConfigSource.FROM_CLASS),
}


def config_problems(obj: Mapping[str, Any], driver_name: str) -> list[str]:
    """What is wrong with ``obj``'s opaque configs for ``driver_name``, one message per entry."""
    path, source = _CONFIGS.get(str(obj.get("kind")), ((), ConfigSource.FROM_CLAIM))
    entries = _walk(obj, path)
    # A claim's (or template's) requests sit beside its configs; a DeviceClass has none.
    beside = _walk(obj, (*path[:-1], "requests")) if path[-2:-1] == ("devices",) else None
    claim_requests = {str(r.get("name")) for r in beside or () if isinstance(r, Mapping)}
    problems = []
    for index, entry in enumerate(entries if isinstance(entries, list) else []):
        opaque = entry.get("opaque") if isinstance(entry, Mapping) else None
        if not isinstance(opaque, Mapping) or opaque.get("driver") != driver_name:
            continue
        requests = tuple(str(r) for r in entry.get("requests") or ())
        if claim_requests and claim_requests <= set(requests):
            requests = ()  # as the allocator writes it (see the module doc)
        try:
            decode_entry(OpaqueConfig(index, source, requests, opaque.get("parameters")))
        except ConfigError as error:
            problems.append(str(error))
    return problems


def _walk(obj: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        obj = obj.get(key) if isinstance(obj, Mapping) else None
    return obj


def review(admission_review: Mapping[str, Any], driver_name: str) -> dict[str, Any]:
    """The AdmissionReview response for a request: allowed, or refused naming every problem."""
    request = admission_review.get("request") or {}
    obj = request.get("object") or {}
    problems = config_problems(obj, driver_name) if isinstance(obj, Mapping) else []
    response: dict[str, Any] = {"uid": request.get("uid", ""), "allowed": not problems}
    if problems:
        response["status"] = {
            "code": 422,
            "reason": "Invalid",
            "message": f"opaque config for {driver_name}: " + "; ".join(problems),
        }
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": response}
