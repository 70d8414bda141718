"""Whether a capacity request can fit any published device: the scheduler's arithmetic, before it runs.

A claim whose ``capacity.requests`` no device can take (more memory than any share may have, a
capacity the GPUs do not have) stays Pending with the scheduler's generic ``cannot allocate all
claims``. The validating webhook (:mod:`dra_driver.node.admission`) refuses such a claim when it is
created instead, from what the driver's ResourceSlices offer. It must refuse exactly what the
scheduler could never allocate anywhere and nothing else, so this module mirrors the allocator's
rules of KEP-5075 (``k8s.io/dynamic-resource-allocation/structured``, ``consumable_capacity.go``),
for one request alone on an empty device:

* a request naming a capacity the device does not have makes the device ineligible;
* the amount consumed is the request rounded up by the capacity's ``requestPolicy``: to
  ``validRange.min`` when below it, then up to the next ``min + n * step``; or up to the smallest
  of ``validValues`` that is not less. A request below the minimum is rounded up, never refused;
* the device is ineligible when the amount consumed violates the policy (above ``validRange.max``,
  off the step grid, not one of ``validValues``; the policy's ``default`` never violates it) or
  exceeds the capacity's ``value``. A capacity without a policy (a device that does not allow
  multiple allocations) takes the request as it is: a minimum the device must have.

What other claims already consume is not counted: a request that fits an empty device is allowed,
and the scheduler decides whether there is room. The capacities a request does not name are not
judged either (they consume the policy's default, whatever the claim says). A device class is
judged only when its selectors are the plain equality tests the chart writes
(``device.driver == "<driver>" && device.attributes["<driver>"].type == "gpu"``, on the attributes
of :data:`SELECTABLE`): any other CEL may let the class match devices this driver does not
publish, or ones the webhook cannot tell apart, so its requests are not judged.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from functools import cached_property
from typing import Any

from dra_driver.resources.quantity import format_quantity, parse_quantity


def _value(quantity: Fraction) -> int:
    """Go's ``Quantity.Value()``: the integer, rounded away from zero. The step arithmetic uses it."""
    return math.ceil(quantity) if quantity >= 0 else math.floor(quantity)


@dataclass(frozen=True)
class CapacityRule:
    """One capacity of a device: its value and its request policy (KEP-5075)."""

    value: Fraction
    has_policy: bool = False
    default: Fraction | None = None
    minimum: Fraction | None = None  # validRange
    maximum: Fraction | None = None
    step: Fraction | None = None
    valid_values: tuple[Fraction, ...] = ()

    @classmethod
    def from_api(cls, capacity: Mapping[str, Any]) -> CapacityRule:
        """From a slice's ``DeviceCapacity``; ValueError when a quantity does not parse."""
        policy = capacity.get("requestPolicy")
        if not isinstance(policy, Mapping):
            return cls(parse_quantity(capacity.get("value")))
        valid_range = policy.get("validRange")
        bounds = valid_range if isinstance(valid_range, Mapping) else {}

        def optional(value: object) -> Fraction | None:
            return None if value is None else parse_quantity(value)

        return cls(
            value=parse_quantity(capacity.get("value")),
            has_policy=True,
            default=optional(policy.get("default")),
            # A validRange always has a minimum (API validation); 0 stands in for a malformed one.
            minimum=optional(bounds.get("min")) or Fraction(0) if isinstance(valid_range, Mapping) else None,
            maximum=optional(bounds.get("max")),
            # A step is positive (API validation); none stands in for a malformed one.
            step=step if (step := optional(bounds.get("step"))) is None or _value(step) > 0 else None,
            valid_values=tuple(parse_quantity(v) for v in policy.get("validValues") or ()),
        )

    def consumed(self, requested: Fraction) -> Fraction:
        """What a request of ``requested`` consumes: rounded up by the policy (calculateConsumedCapacity)."""
        if not self.has_policy:
            return requested
        if self.minimum is not None:
            if requested < self.minimum:
                return self.minimum
            if self.step is None:
                return requested
            low, step = _value(self.minimum), _value(self.step)
            return Fraction(low + step * -(-(_value(requested) - low) // step))
        for valid in self.valid_values:
            if requested <= valid:
                return valid
        return requested

    def violated_by(self, consumed: Fraction) -> bool:
        """Whether consuming ``consumed`` breaks the policy (violatesPolicy)."""
        if not self.has_policy or consumed == self.default:
            return False
        if self.minimum is not None:
            if self.maximum is not None and consumed > self.maximum:
                return True
            if self.step is None:
                return False
            return (_value(consumed) - _value(self.minimum)) % _value(self.step) != 0
        return bool(self.valid_values) and consumed not in self.valid_values

    def takes(self, requested: Fraction) -> bool:
        """Whether one allocation asking ``requested`` fits this capacity of an otherwise idle device."""
        consumed = self.consumed(requested)
        return not self.violated_by(consumed) and consumed <= self.value

    def most(self) -> Fraction | None:
        """The largest request :meth:`takes` allows (for messages); None when it allows none."""
        if not self.has_policy:
            return self.value
        if self.minimum is not None:
            top = min(self.value, self.maximum) if self.maximum is not None else self.value
            if self.step is not None:
                low, step = _value(self.minimum), _value(self.step)
                top = Fraction(low + step * math.floor((top - low) / step))
            return top if top >= self.minimum else None
        allowed = [v for v in self.valid_values if v <= self.value]
        return max(allowed) if allowed else (self.value if not self.valid_values else None)


@dataclass(frozen=True)
class Offer:
    """What one device offers a capacity request; identical GPUs offer the same, so few exist."""

    kind: str  # the device's `type` attribute: gpu, mig, ...
    product: str
    shareable: bool  # allowMultipleAllocations
    capacities: tuple[tuple[str, CapacityRule], ...]

    def __hash__(self) -> int:  # once: offers are counted at every slice event
        return self._hash

    @cached_property
    def _hash(self) -> int:
        return hash((self.kind, self.product, self.shareable, self.capacities))

    def rule(self, name: str) -> CapacityRule | None:
        return dict(self.capacities).get(name)

    def takes(self, requests: Mapping[str, Fraction]) -> bool:
        rules = dict(self.capacities)
        return all(name in rules and rules[name].takes(amount) for name, amount in requests.items())


def device_offer(device: Mapping[str, Any]) -> Offer:
    """The offer of a slice's device; ValueError when one of its quantities does not parse."""
    attributes = device.get("attributes") or {}

    def string(name: str) -> str:
        value = attributes.get(name)
        return str(value.get("string", "")) if isinstance(value, Mapping) else ""

    capacity = device.get("capacity") or {}
    return Offer(
        kind=string("type"),
        product=string("productName"),
        shareable=bool(device.get("allowMultipleAllocations")),
        capacities=tuple(sorted((str(name), CapacityRule.from_api(c)) for name, c in capacity.items())),
    )


# One conjunct of a DeviceClass selector the webhook understands: `device.driver == "x"` or
# `device.attributes["domain"].name == <string, int or bool>`.
_STRING = r"""(?:"((?:[^"\\]|\\.)*)"|'((?:[^'\\]|\\.)*)')"""
_LITERAL = rf"(?:{_STRING}|(-?[0-9]+)|(true|false))"
_DRIVER_TEST = re.compile(rf"device\.driver\s*==\s*{_STRING}")
_ATTRIBUTE_TEST = re.compile(rf"device\.attributes\[{_STRING}\]\.([A-Za-z_][A-Za-z0-9_]*)\s*==\s*{_LITERAL}")


@dataclass(frozen=True)
class ClassFilter:
    """The devices of one of this driver's DeviceClasses: attribute equalities, all of them."""

    attributes: tuple[tuple[str, str | int | bool], ...]

    def matches(self, selectable: Selectable) -> bool:
        for name, wanted in self.attributes:
            # CEL compares a string attribute with a string only, an int with an int, ...
            kind = "bool" if isinstance(wanted, bool) else "int" if isinstance(wanted, int) else "string"
            if (name, kind, wanted) not in selectable:
                return False
        return True


# The attributes a class may select by and still be judged: those the chart's and NVIDIA's
# classes use, and a few more that many devices share. A device is remembered by these alone, so
# a node's devices fold into a handful of entries (not one per GPU and MIG placement, whose
# uuid and PCI address differ): the webhook's memory stays small in a large cluster.
SELECTABLE = ("type", "profile", "productName", "architecture", "brand", "vendor")
Selectable = frozenset[tuple[str, str, str | int | bool]]  # (name, kind, value)


def selectable(device: Mapping[str, Any], driver: str) -> Selectable:
    """The device's :data:`SELECTABLE` attributes, in the driver's domain spelt either way."""
    published = device.get("attributes") or {}
    found: list[tuple[str, str, str | int | bool]] = []
    for name in SELECTABLE:
        value = published.get(name) or published.get(f"{driver}/{name}")
        if isinstance(value, Mapping):
            for kind, v in value.items():
                if isinstance(v, str | int | bool):
                    found.append((name, kind, v))
    return frozenset(found)


def class_filter(device_class: Mapping[str, Any], driver: str) -> ClassFilter | None:
    """The class's devices as a :class:`ClassFilter`, or None when it is not (only) this driver's.

    None unless every selector is a conjunction of equality tests this module understands (on
    :data:`SELECTABLE` attributes) and one of them pins ``device.driver`` to ``driver``: another
    class may match other drivers' devices, whose capacities the webhook does not know.
    """
    selectors = (device_class.get("spec") or {}).get("selectors") or []
    pinned = False
    attributes: list[tuple[str, str | int | bool]] = []
    for selector in selectors:
        expression = ((selector or {}).get("cel") or {}).get("expression")
        if not isinstance(expression, str):
            return None
        for conjunct in _conjuncts(expression):
            if match := _DRIVER_TEST.fullmatch(conjunct):
                if _unquote(match[1], match[2]) != driver:
                    return None
                pinned = True
            elif match := _ATTRIBUTE_TEST.fullmatch(conjunct):
                if _unquote(match[1], match[2]) != driver or match[3] not in SELECTABLE:
                    return None  # an attribute devices are not remembered by
                name = match[3]
                literal: str | int | bool
                if match[4] is not None or match[5] is not None:
                    literal = _unquote(match[4], match[5])
                elif match[6] is not None:
                    literal = int(match[6])
                else:
                    literal = match[7] == "true"
                attributes.append((name, literal))
            else:
                return None
    return ClassFilter(tuple(attributes)) if pinned else None


def _conjuncts(expression: str) -> list[str]:
    """``a && b && c`` split at top-level ``&&`` (none inside quotes), stripped; [] for anything odd."""
    parts, current, quote = [], "", ""
    index = 0
    while index < len(expression):
        char = expression[index]
        if quote:
            current += char
            if char == "\\" and index + 1 < len(expression):
                current += expression[index + 1]
                index += 1
            elif char == quote:
                quote = ""
        elif char in "\"'":
            quote = char
            current += char
        elif expression.startswith("&&", index):
            parts.append(current.strip())
            current = ""
            index += 1
        else:
            current += char
        index += 1
    parts.append(current.strip())
    return parts


def _unquote(double: str | None, single: str | None) -> str:
    text = double if double is not None else single or ""
    return re.sub(r"\\(.)", r"\1", text)


def _noun(kind: str) -> str:
    return {"gpu": "GPU", "mig": "MIG device"}.get(kind, "device")


def request_problem(
    request_name: str, device_class: str, asked: Mapping[str, str], offers: Iterable[Offer]
) -> str | None:
    """Why no device offering one of ``offers`` can take the capacities ``asked``; None when one can.

    ``asked`` are a request's ``capacity.requests`` (quantities as written), ``offers`` those of
    the class's devices; none known, or a quantity that does not parse, means nothing is judged.
    """
    offers = list(offers)
    try:
        requests = {name: parse_quantity(amount) for name, amount in asked.items()}
    except ValueError:  # the API server validates quantities: not from a valid claim
        return None
    if not offers or any(offer.takes(requests) for offer in offers):
        return None
    kinds = {offer.kind for offer in offers}
    things = f"{device_class} {_noun(kinds.pop()) if len(kinds) == 1 else 'device'}"
    names = sorted({name for offer in offers for name, _ in offer.capacities})
    for name in requests:
        if name not in names:
            have = ", ".join(names) if names else "none"
            return (
                f'request "{request_name}" names capacity "{name}", which no {things} has (they have {have})'
            )
    for name, amount in requests.items():
        candidates = [(offer, rule) for offer in offers if (rule := offer.rule(name)) is not None]
        if any(rule.takes(amount) for _, rule in candidates):
            continue
        offer, most = max(
            ((offer, rule.most()) for offer, rule in candidates), key=lambda pair: pair[1] or Fraction(-1)
        )
        where = f" on {offer.product}" if offer.product else ""
        limit = f"({format_quantity(most)}{where})" if most is not None else f"(none{where})"
        have = f"any share of a {things} can have" if offer.shareable else f"any {things} has"
        return f'request "{request_name}" asks for {name} {asked[name]}, more than {have} {limit}'
    together = ", ".join(f"{name} {amount}" for name, amount in asked.items())
    return f'request "{request_name}" asks for {together} together, which no single {things} offers'


class OfferIndex:
    """What the devices of each of this driver's DeviceClasses offer, from its ResourceSlices.

    Kept up to date by the webhook's watches (:mod:`dra_driver.webhook.server`), one slice and one class at
    a time. Each slice is remembered as its devices counted by (:func:`selectable` attributes,
    :class:`Offer`), so a slice that goes takes its devices' offers with it. Until the slices and
    the classes are known, nothing is judged (:meth:`problem` answers None).
    """

    def __init__(self, driver: str) -> None:
        self.driver = driver
        self._slices: dict[str, Counter[_Device]] = {}
        self._filters: dict[str, ClassFilter] = {}
        self._counts: dict[str, Counter[Offer | None]] = {}
        # One object per kind of device, shared by every slice that has one: a thousand nodes of
        # the same GPUs hold a handful. Emptied at each listing, so it cannot grow for ever.
        self._known: dict[object, _Device] = {}

    @property
    def device_count(self) -> int:
        return sum(devices.total() for devices in self._slices.values())

    @property
    def device_kinds(self) -> int:
        """How many distinct devices the index holds: what its memory grows with."""
        return len(self._known)

    def replace_slices(self, slices: Iterable[Mapping[str, Any]]) -> None:
        """The slices listed afresh: those not among them are gone."""
        self._slices.clear()
        self._known.clear()
        for obj in slices:
            self._put_slice(obj)
        self._recount()

    def put_slice(self, obj: Mapping[str, Any]) -> None:
        self._drop_slice(_name(obj))
        self._put_slice(obj)
        self._count(self._slices.get(_name(obj), Counter()), 1)

    def drop_slice(self, obj: Mapping[str, Any]) -> None:
        self._drop_slice(_name(obj))

    def replace_classes(self, classes: Iterable[Mapping[str, Any]]) -> None:
        self._filters.clear()
        for obj in classes:
            self._put_class(obj)
        self._recount()

    def put_class(self, obj: Mapping[str, Any]) -> None:
        self._filters.pop(_name(obj), None)
        self._put_class(obj)
        self._recount()

    def drop_class(self, obj: Mapping[str, Any]) -> None:
        if self._filters.pop(_name(obj), None) is not None:
            self._recount()

    def offers(self, device_class: str) -> list[Offer]:
        """The distinct offers of the class's devices; [] when the class is not (known to be) this
        driver's, when none of its devices is known, or when one of them could not be read."""
        counts = self._counts.get(device_class)
        if not counts or None in counts:
            return []
        return [offer for offer in counts if offer is not None]

    def problem(self, request_name: str, device_class: str, asked: Mapping[str, str]) -> str | None:
        """Why no device of ``device_class`` can ever take the capacities ``asked``; None when one
        can, or when the class's devices are not known.

        A capacity in the driver's domain may be spelt out (``gpu.dra-driver.dev/memory``): it is
        judged as the devices' own ``memory``, which can only let more through.
        """
        domain = f"{self.driver}/"
        named = {name.removeprefix(domain): amount for name, amount in asked.items()}
        return request_problem(request_name, device_class, named, self.offers(device_class))

    def _put_slice(self, obj: Mapping[str, Any]) -> None:
        spec = obj.get("spec") or {}
        if spec.get("driver") != self.driver:
            return
        devices: Counter[_Device] = Counter()
        for device in spec.get("devices") or []:
            devices[self._device(device)] += 1
        self._slices[_name(obj)] = devices

    def _device(self, device: Mapping[str, Any]) -> _Device:
        """The device as the index remembers it, made once per kind of device."""
        attributes = selectable(device, self.driver)
        # repr, not json.dumps: several times faster; two equal devices whose keys differ only in
        # order make one more entry, nothing worse.
        key = (attributes, device.get("allowMultipleAllocations"), repr(device.get("capacity")))
        known = self._known.get(key)
        if known is None:
            try:
                offer: Offer | None = device_offer(device)
            except ValueError:  # not from a valid slice: its class is then not judged at all
                offer = None
            known = self._known[key] = (attributes, offer)
        return known

    def _drop_slice(self, name: str) -> None:
        self._count(self._slices.pop(name, Counter()), -1)

    def _put_class(self, obj: Mapping[str, Any]) -> None:
        found = class_filter(obj, self.driver)
        if found is not None:
            self._filters[_name(obj)] = found

    def _count(self, devices: Counter[_Device], sign: int) -> None:
        for name, found in self._filters.items():
            counts = self._counts.setdefault(name, Counter())
            for (attributes, offer), number in devices.items():
                if found.matches(attributes):
                    counts[offer] += sign * number
            self._counts[name] = +counts  # drops what fell to zero

    def _recount(self) -> None:
        self._counts = {}
        for devices in self._slices.values():
            self._count(devices, 1)


_Device = tuple[Selectable, Offer | None]


def _name(obj: Mapping[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("name", ""))
