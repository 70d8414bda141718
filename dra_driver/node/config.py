"""The opaque configuration API: what users put in ``spec.devices.config[].opaque.parameters``.

Users write it in a ResourceClaim (or an administrator in a DeviceClass), addressed to
our driver by name; the scheduler copies it into the claim's allocation and we read it
at prepare time. It is a versioned API of its own, ``resource.dra-driver.dev/v1alpha1``,
one fixed group whatever name the driver is deployed under (the driver name only says
*which* configs are ours), and strict: an unknown field or a wrong type is an error
that names the field, never something silently ignored.

Kinds:

``GpuConfig``
    for full GPUs. ``sharing.strategy`` is ``Exclusive`` (the default), ``TimeSlicing``
    (with ``timeSlicing.interval``: Default, Short, Medium or Long) or ``MPS`` (with
    ``mps.defaultActiveThreadPercentage`` 1-100 and ``mps.defaultPinnedDeviceMemoryLimit``,
    a memory quantity such as ``10Gi``).
``MigDeviceConfig``
    for MIG devices. Same strategies, but no ``timeSlicing`` settings: the time-slice
    interval is a property of a full GPU that MIG devices do not have (processes on one
    MIG device are time-sliced with the fixed default), while MPS runs on MIG devices.

Precedence (resource.k8s.io): class configs come before claim configs, a later entry
overrides an earlier one, and a config applies to the requests it names or to all
requests when it names none. A config naming a ``firstAvailable`` request ``req``
also applies to the results of its subrequests ``req/sub``. A config applies only to
devices of its own kind (GpuConfig to GPUs, MigDeviceConfig to MIG devices), so one
class config per kind can sit side by side; a claim config that names a request whose
results are all of the other kind is refused rather than ignored (see
:mod:`dra_driver.node.plan`).

What prepare does with the settings (validate, record, announce as env; it does not
reconfigure the GPU) is described in :mod:`dra_driver.node.plan`. NVIDIA's config API
(``resource.nvidia.com/v1beta1``) is not accepted: such a config for our driver name
fails with an apiVersion error rather than being half understood.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from decimal import Decimal
from typing import Annotated, Any, Final, Literal, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.alias_generators import to_camel
from pydantic_core import PydanticCustomError

from dra_driver.node.claims import AllocationResult, ConfigSource, OpaqueConfig

API_VERSION: Final = "resource.dra-driver.dev/v1alpha1"
CONFIG_GROUP, CONFIG_VERSION = API_VERSION.split("/")

_MULTIPLIERS = {
    "": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
}  # fmt: skip
_QUANTITY_PATTERN = r"^([0-9]+(?:\.[0-9]+)?)(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$"


def quantity_bytes(quantity: str) -> int:
    """A memory quantity ("10Gi", "512M", "1.5Gi") as bytes; ValueError unless a whole positive number.

    The subset of Kubernetes quantities that make sense for memory: no sign, no
    exponent, no milli.
    """
    match = re.fullmatch(_QUANTITY_PATTERN, quantity)
    if match is None:
        raise ValueError(f"{quantity!r} is not a memory quantity such as 10Gi or 512M")
    value = Decimal(match[1]) * _MULTIPLIERS[match[2] or ""]
    if value <= 0 or value != value.to_integral_value():
        raise ValueError(f"{quantity!r} is not a whole, positive number of bytes")
    return int(value)


def _check_quantity(quantity: str) -> str:
    try:
        quantity_bytes(quantity)
    except ValueError as error:
        raise PydanticCustomError("memory_quantity", str(error)) from None
    return quantity


MemoryQuantity = Annotated[
    str, Field(pattern=_QUANTITY_PATTERN, examples=["10Gi", "512Mi"]), AfterValidator(_check_quantity)
]


class _ApiObject(BaseModel):
    """Strict: unknown fields and values of the wrong JSON type are errors, never coerced."""

    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        frozen=True,
        alias_generator=to_camel,
        field_title_generator=lambda name, _info: to_camel(name),
    )


class TimeSlicing(_ApiObject):
    interval: Literal["Default", "Short", "Medium", "Long"] = Field(
        default="Default", description="Length of the time slice each process gets on the GPU."
    )


class Mps(_ApiObject):
    default_active_thread_percentage: int | None = Field(
        default=None,
        ge=1,
        le=100,
        description="Share of the GPU's threads each MPS client may use, in percent.",
    )
    default_pinned_device_memory_limit: MemoryQuantity | None = Field(
        default=None, description="Device memory each MPS client may pin, as a quantity (e.g. 10Gi)."
    )


def _only_with_strategy(*settings: tuple[str, str]) -> dict[str, Any]:
    """The schema form of :func:`_check_settings`: ``field`` may appear only with ``strategy``."""
    return {
        "allOf": [
            {
                "if": {"required": [field], "properties": {field: {"not": {"type": "null"}}}},
                "then": {"properties": {"strategy": {"const": strategy}}},
            }
            for field, strategy in settings
        ]
    }


class GpuSharing(_ApiObject):
    model_config = ConfigDict(
        json_schema_extra=_only_with_strategy(("timeSlicing", "TimeSlicing"), ("mps", "MPS"))
    )

    strategy: Literal["Exclusive", "TimeSlicing", "MPS"] = Field(
        description="Exclusive: no sharing settings. TimeSlicing or MPS: how the pods and containers "
        "sharing this claim share the GPU."
    )
    time_slicing: TimeSlicing | None = Field(default=None, description="Only with strategy TimeSlicing.")
    mps: Mps | None = Field(default=None, description="Only with strategy MPS.")

    @model_validator(mode="after")
    def _settings_match_strategy(self) -> GpuSharing:
        _check_settings("timeSlicing", self.time_slicing, "TimeSlicing", self.strategy)
        _check_settings("mps", self.mps, "MPS", self.strategy)
        return self


class MigSharing(_ApiObject):
    model_config = ConfigDict(json_schema_extra=_only_with_strategy(("mps", "MPS")))

    strategy: Literal["Exclusive", "TimeSlicing", "MPS"] = Field(
        description="Exclusive: no sharing settings. TimeSlicing (the fixed MIG time slice) or MPS."
    )
    mps: Mps | None = Field(default=None, description="Only with strategy MPS.")

    @model_validator(mode="after")
    def _settings_match_strategy(self) -> MigSharing:
        _check_settings("mps", self.mps, "MPS", self.strategy)
        return self


def _check_settings(field: str, value: object, wanted: str, strategy: str) -> None:
    if value is not None and strategy != wanted:
        raise PydanticCustomError(
            "settings_without_strategy", f"{field} is only valid with strategy {wanted}, not {strategy}"
        )


class GpuConfig(_ApiObject):
    """Settings for full GPUs."""

    api_version: Literal["resource.dra-driver.dev/v1alpha1"]
    kind: Literal["GpuConfig"]
    sharing: GpuSharing = Field(default_factory=lambda: GpuSharing.model_validate({"strategy": "Exclusive"}))


class MigDeviceConfig(_ApiObject):
    """Settings for MIG devices."""

    api_version: Literal["resource.dra-driver.dev/v1alpha1"]
    kind: Literal["MigDeviceConfig"]
    sharing: MigSharing = Field(default_factory=lambda: MigSharing.model_validate({"strategy": "Exclusive"}))


DeviceConfig = GpuConfig | MigDeviceConfig
_KINDS: dict[str, type[GpuConfig] | type[MigDeviceConfig]] = {
    "GpuConfig": GpuConfig,
    "MigDeviceConfig": MigDeviceConfig,
}
# What applies to a device no config names.
DEFAULT_GPU_CONFIG = GpuConfig.model_validate({"apiVersion": API_VERSION, "kind": "GpuConfig"})
DEFAULT_MIG_CONFIG = MigDeviceConfig.model_validate({"apiVersion": API_VERSION, "kind": "MigDeviceConfig"})


class ConfigError(Exception):
    """An opaque config for our driver is invalid; the message names the entry and the field."""


def decode_config(entry: OpaqueConfig) -> DeviceConfig:
    """Decode one opaque config; :class:`ConfigError` names the entry and every wrong field."""
    parameters = entry.parameters
    if not isinstance(parameters, Mapping):
        raise ConfigError(f"{entry.describe()}: parameters must be a JSON object with apiVersion and kind")
    api_version, kind = parameters.get("apiVersion"), parameters.get("kind")
    if api_version != API_VERSION:
        raise ConfigError(f"{entry.describe()}: apiVersion: {api_version!r} is not served; use {API_VERSION}")
    model = _KINDS.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise ConfigError(
            f"{entry.describe()}: kind: {kind!r} is not a kind of {API_VERSION}; use {' or '.join(_KINDS)}"
        )
    try:
        # Validated as JSON, which it is: errors then speak of objects and arrays, not Python types.
        return model.model_validate_json(json.dumps(parameters))
    except ValidationError as error:
        problems = "; ".join(
            f"{'.'.join(str(part) for part in e['loc']) or '(object)'}: {e['msg']}" for e in error.errors()
        )
        raise ConfigError(f"{entry.describe()}: {problems}") from None


def config_json(config: DeviceConfig) -> dict[str, Any]:
    """The config as the user would write it (camelCase), with defaults filled in."""
    return config.model_dump(mode="json", by_alias=True, exclude_none=True)


_Config = TypeVar("_Config", bound=DeviceConfig)


def effective_config(
    results: Sequence[AllocationResult], configs: Sequence[tuple[OpaqueConfig, _Config]]
) -> dict[AllocationResult, _Config]:
    """Which config wins for each result; results no config applies to are left out.

    ``configs`` are one kind's configs in allocation order; this sorts class configs
    before claim configs (stable, so the order within each source is kept) and lets
    the last applicable one win.
    """
    ordered = sorted(configs, key=lambda pair: pair[0].source is ConfigSource.FROM_CLAIM)
    chosen: dict[AllocationResult, _Config] = {}
    for entry, config in ordered:
        for result in results:
            if _applies(entry, result):
                chosen[result] = config
    return chosen


def _applies(entry: OpaqueConfig, result: AllocationResult) -> bool:
    """All requests when none is named; "req" covers "req/sub"; "req/sub" covers only itself."""
    return not entry.requests or result.request in entry.requests or result.parent_request in entry.requests


def json_schemas() -> dict[str, dict[str, Any]]:
    """The JSON schema of every kind, by file name under ``api/config/``."""
    return {
        f"{CONFIG_VERSION}/{kind}.json": {
            "$schema": "https://json-schema.org/draft/2020-12/schema",
            "$id": f"https://{CONFIG_GROUP}/schemas/{CONFIG_VERSION}/{kind}.json",
            **model.model_json_schema(by_alias=True),
        }
        for kind, model in _KINDS.items()
    }
