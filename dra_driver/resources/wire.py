"""The resource.k8s.io/v1 JSON this driver writes, as typed dictionaries.

The pure functions of this package produce plain JSON-able dicts (what the API server
receives, field for field), so a golden file or a test compares exactly what is published.
These TypedDicts only give those dicts names and let mypy check every key.
"""

from __future__ import annotations

from typing import NotRequired, TypedDict


class DeviceAttribute(TypedDict, total=False):
    """One of the four value kinds; the API requires exactly one key per attribute."""

    string: str
    int: int
    bool: bool
    version: str  # semver 2.0.0


class CapacityRequestPolicyRange(TypedDict):
    min: str  # Quantities
    max: NotRequired[str]
    step: NotRequired[str]


class CapacityRequestPolicy(TypedDict):
    """How allocations consume a capacity of a device with ``allowMultipleAllocations``."""

    default: str  # a Quantity: what an allocation that does not ask for this capacity consumes
    validRange: CapacityRequestPolicyRange


class DeviceCapacity(TypedDict):
    value: str  # a Quantity, e.g. "85520809984"
    requestPolicy: NotRequired[CapacityRequestPolicy]  # only with allowMultipleAllocations


class Counter(TypedDict):
    value: str  # a Quantity


class CounterSet(TypedDict):
    name: str
    counters: dict[str, Counter]


class DeviceCounterConsumption(TypedDict):
    counterSet: str
    counters: dict[str, Counter]


class DeviceTaint(TypedDict):
    key: str
    effect: str  # "None" | "NoSchedule" | "NoExecute"
    value: NotRequired[str]
    # RFC 3339; the API server fills it in when absent, so a caller that wants it stable
    # across re-publishing (the device list is replaced as a whole) should set it.
    timeAdded: NotRequired[str]


class Device(TypedDict):
    name: str
    attributes: dict[str, DeviceAttribute]
    capacity: dict[str, DeviceCapacity]
    consumesCounters: NotRequired[list[DeviceCounterConsumption]]
    taints: NotRequired[list[DeviceTaint]]
    allowMultipleAllocations: NotRequired[bool]  # consumable capacity (KEP-5075)
    # KEP-5007: the scheduler binds the pod once these device conditions are True in the claim's status
    bindingConditions: NotRequired[list[str]]
    bindingFailureConditions: NotRequired[list[str]]  # ... and schedules it again if one of these is


class ResourcePool(TypedDict):
    name: str
    generation: int
    resourceSliceCount: int


class ResourceSliceSpec(TypedDict):
    driver: str
    pool: ResourcePool
    nodeName: str
    # Exactly one of the two is present (the API allows devices XOR sharedCounters).
    devices: NotRequired[list[Device]]
    sharedCounters: NotRequired[list[CounterSet]]


class OwnerReference(TypedDict):
    apiVersion: str
    kind: str
    name: str
    uid: str
    controller: bool


class SliceMetadata(TypedDict):
    name: str
    annotations: dict[str, str]
    ownerReferences: NotRequired[list[OwnerReference]]


class ResourceSlice(TypedDict):
    """A whole object as this driver applies it (server-side apply: only the fields it owns)."""

    apiVersion: str
    kind: str
    metadata: SliceMetadata
    spec: ResourceSliceSpec
