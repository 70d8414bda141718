"""Opaque configs checked when a claim is written, with the words prepare would use.

A claim whose config for this driver is misspelt is allocated and then fails at prepare; the
pod never starts and only an event says why. The validating webhook (:mod:`dra_driver.webhook.server`)
refuses it when it is created instead, with the decoder prepare uses
(:func:`dra_driver.node.config.decode_entry`), so the message is the same. Only the index can
differ: here it counts the entries of the object written (a claim's, a template's, a class's),
at prepare the entries of the allocation, where the class's configs come first.

A config whose requests name every request of the claim is described as applying to "all
requests": the 1.37 scheduler's allocator clears such a list in the allocation ("empty means
all"), so that is what prepare says of it (seen on the real node, e2e/real_node/test_webhook.py).
Before 1.37 the allocation keeps the names, and prepare lists them.

A claim or template being created is also checked for capacity requests that no device of this
driver could ever take (:mod:`dra_driver.resources.capacity_fit`), when the webhook knows the
driver's ResourceSlices: more memory than any share may have, a capacity the GPUs do not have.
The scheduler would only say ``cannot allocate all claims`` for it.

An update is judged only when it changes the configs: a claim's or a template's spec cannot
change, and an object written before the webhook (or before a driver upgrade that reads configs
more strictly) must still get its finalizers removed and its labels changed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dra_driver.node.claims import ConfigSource, OpaqueConfig
from dra_driver.node.config import ConfigError, decode_entry
from dra_driver.resources.capacity_fit import OfferIndex

# kind -> (path to the config list, where its configs come from)
_CONFIGS: dict[str, tuple[tuple[str, ...], ConfigSource]] = {
    "ResourceClaim": (("spec", "devices", "config"), ConfigSource.FROM_CLAIM),
    "ResourceClaimTemplate": (("spec", "spec", "devices", "config"), ConfigSource.FROM_CLAIM),
    "DeviceClass": (("spec", "config"), ConfigSource.FROM_CLASS),
}
# kind -> path to the device requests
_REQUESTS: dict[str, tuple[str, ...]] = {
    "ResourceClaim": ("spec", "devices", "requests"),
    "ResourceClaimTemplate": ("spec", "spec", "devices", "requests"),
}


def _at(obj: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        obj = obj.get(key) if isinstance(obj, Mapping) else None
    return obj


def config_problems(obj: Mapping[str, Any], driver_name: str) -> list[str]:
    """What is wrong with ``obj``'s opaque configs for ``driver_name``, one message per entry."""
    path, source = _CONFIGS.get(str(obj.get("kind")), ((), ConfigSource.FROM_CLAIM))
    entries = _at(obj, path)
    # A claim's (or template's) requests sit beside its configs; a DeviceClass has none.
    beside = _at(obj, (*path[:-1], "requests")) if path[-2:-1] == ("devices",) else None
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


def capacity_problems(obj: Mapping[str, Any], offers: OfferIndex) -> list[str]:
    """The requests of ``obj`` (a claim or a template) that no device of the driver can ever take.

    A request with ``firstAvailable`` is refused only when none of its subrequests can be taken;
    a request for a class that is not the driver's, or whose devices are not known, is never.
    """
    requests = _at(obj, _REQUESTS.get(str(obj.get("kind")), ()))
    problems: list[str] = []
    for request in requests if isinstance(requests, list) else []:
        if not isinstance(request, Mapping):
            continue
        name = str(request.get("name", ""))
        if isinstance(request.get("exactly"), Mapping):
            choices = [(name, request["exactly"])]
        else:
            subrequests = request.get("firstAvailable")
            choices = [
                (f"{name}/{sub.get('name', '')}", sub)
                for sub in (subrequests if isinstance(subrequests, list) else [])
                if isinstance(sub, Mapping)
            ]
        found = [_choice_problem(label, choice, offers) for label, choice in choices]
        if found and all(found):
            problems.extend(problem for problem in found if problem)
    return problems


def _choice_problem(label: str, choice: Mapping[str, Any], offers: OfferIndex) -> str | None:
    asked = _at(choice, ("capacity", "requests"))
    if not isinstance(asked, Mapping) or not asked:
        return None
    amounts = {str(name): str(amount) for name, amount in asked.items()}
    return offers.problem(label, str(choice.get("deviceClassName", "")), amounts)


def review(
    admission_review: Mapping[str, Any], driver_name: str, offers: OfferIndex | None = None
) -> dict[str, Any]:
    """The AdmissionReview response for a request: allowed, or refused naming every problem.

    Capacity requests are checked when ``offers`` is given and the object is being created: a
    claim's and a template's spec cannot change afterwards, and an update of one (a finalizer
    removed, a label added) must never be refused because the cluster's GPUs changed since.
    """
    request = admission_review.get("request") or {}
    obj = request.get("object") or {}
    problems = []
    if isinstance(obj, Mapping):
        if _configs_written(request, obj) and (configs := config_problems(obj, driver_name)):
            problems.append(f"opaque config for {driver_name}: " + "; ".join(configs))
        if offers is not None and request.get("operation") == "CREATE":
            problems.extend(capacity_problems(obj, offers))
    return _answer(request, problems)


def refusal(admission_review: Any, message: str) -> dict[str, Any]:
    """The AdmissionReview response refusing a request for ``message``, whatever its object."""
    request = admission_review.get("request") if isinstance(admission_review, Mapping) else None
    return _answer(request if isinstance(request, Mapping) else {}, [message])


def _answer(request: Mapping[str, Any], problems: list[str]) -> dict[str, Any]:
    response: dict[str, Any] = {"uid": request.get("uid", ""), "allowed": not problems}
    if problems:
        response["status"] = {"code": 422, "reason": "Invalid", "message": "; ".join(problems)}
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": response}


def _configs_written(request: Mapping[str, Any], obj: Mapping[str, Any]) -> bool:
    """Whether the request writes ``obj``'s configs: a create, or an update that changes them."""
    old = request.get("oldObject")
    if request.get("operation") != "UPDATE" or not isinstance(old, Mapping):
        return True
    path, _ = _CONFIGS.get(str(obj.get("kind")), ((), ConfigSource.FROM_CLAIM))
    return bool(path) and _at(old, path) != _at(obj, path)
