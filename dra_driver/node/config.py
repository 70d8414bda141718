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
``VfioDeviceConfig``
    for passthrough devices: ``iommu.backendPolicy`` (LegacyOnly or PreferIommuFD) and
    ``iommu.enableAPIDevice``, as NVIDIA's (docs/passthrough.md).
``MigDeviceConfig``
    for MIG devices. Same strategies, but no ``timeSlicing`` settings: the time-slice
    interval is a property of a full GPU that MIG devices do not have (processes on one
    MIG device are time-sliced with the fixed default), while MPS runs on MIG devices.
    An interval for a MIG device is refused with that reason (either API).

Precedence (resource.k8s.io): class configs come before claim configs, a later entry
overrides an earlier one, and a config applies to the requests it names or to all
requests when it names none. A config naming a ``firstAvailable`` request ``req``
also applies to the results of its subrequests ``req/sub``. A config applies only to
devices of its own kind (GpuConfig to GPUs, MigDeviceConfig to MIG devices), so one
class config per kind can sit side by side; a claim config that names a request whose
results are all of the other kind is refused rather than ignored (see
:mod:`dra_driver.node.plan`).

What prepare does with the settings (validate, announce as env, and apply on the GPU: compute
mode, time slice, an MPS control daemon) is described in :mod:`dra_driver.node.plan` and
:mod:`dra_driver.node.sharing.policy`. NVIDIA's config API
(``resource.nvidia.com/v1beta1``, with its own field names: ``timeSlicingConfig``,
``mpsConfig``) is served too, translated into this one by :mod:`dra_driver.node.nvidia_config`,
so claims written for NVIDIA's driver keep their configs.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal, TypeVar

from pydantic import ConfigDict, Field, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from dra_driver.node import nvidia_config
from dra_driver.node.api_base import ApiObject, MemoryQuantity, describe_errors, only_with_strategy
from dra_driver.node.claims import AllocationResult, ConfigSource, OpaqueConfig

API_VERSION: Final = "resource.dra-driver.dev/v1alpha1"
CONFIG_GROUP, CONFIG_VERSION = API_VERSION.split("/")


class TimeSlicing(ApiObject):
    interval: Literal["Default", "Short", "Medium", "Long"] = Field(
        default="Default", description="Length of the time slice each process gets on the GPU."
    )


class Mps(ApiObject):
    default_active_thread_percentage: int | None = Field(
        default=None,
        ge=1,
        le=100,
        description="Share of the GPU's threads each MPS client may use, in percent.",
    )
    default_pinned_device_memory_limit: MemoryQuantity | None = Field(
        default=None, description="Device memory each MPS client may pin, as a quantity (e.g. 10Gi)."
    )


class GpuSharing(ApiObject):
    model_config = ConfigDict(
        json_schema_extra=only_with_strategy(("timeSlicing", "TimeSlicing"), ("mps", "MPS"))
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


class MigSharing(ApiObject):
    model_config = ConfigDict(json_schema_extra=only_with_strategy(("mps", "MPS")))

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


class GpuConfig(ApiObject):
    """Settings for full GPUs."""

    api_version: Literal["resource.dra-driver.dev/v1alpha1"]
    kind: Literal["GpuConfig"]
    sharing: GpuSharing = Field(default_factory=lambda: GpuSharing.model_validate({"strategy": "Exclusive"}))


class MigDeviceConfig(ApiObject):
    """Settings for MIG devices."""

    api_version: Literal["resource.dra-driver.dev/v1alpha1"]
    kind: Literal["MigDeviceConfig"]
    sharing: MigSharing = Field(default_factory=lambda: MigSharing.model_validate({"strategy": "Exclusive"}))


class Iommu(ApiObject):
    backend_policy: Literal["LegacyOnly", "PreferIommuFD"] = Field(
        default="LegacyOnly",
        description="LegacyOnly: the VFIO group /dev/vfio/<group>. PreferIommuFD: the device's IOMMUFD "
        "cdev /dev/vfio/devices/vfio<N> where the kernel has IOMMUFD, else the group.",
    )
    enable_api_device: bool = Field(
        default=False,
        alias="enableAPIDevice",
        description="Also give the container the IOMMU API device: /dev/vfio/vfio, or /dev/iommu with "
        "the IOMMUFD cdev.",
    )


class VfioDeviceConfig(ApiObject):
    """Settings for passthrough devices (a GPU on vfio-pci for a virtual machine)."""

    api_version: Literal["resource.dra-driver.dev/v1alpha1"]
    kind: Literal["VfioDeviceConfig"]
    iommu: Iommu = Field(default_factory=Iommu)


DeviceConfig = GpuConfig | MigDeviceConfig
AnyConfig = GpuConfig | MigDeviceConfig | VfioDeviceConfig
_KINDS: dict[str, type[GpuConfig] | type[MigDeviceConfig] | type[VfioDeviceConfig]] = {
    "GpuConfig": GpuConfig,
    "MigDeviceConfig": MigDeviceConfig,
    "VfioDeviceConfig": VfioDeviceConfig,
}
# What applies to a device no config names.
DEFAULT_GPU_CONFIG = GpuConfig.model_validate({"apiVersion": API_VERSION, "kind": "GpuConfig"})
DEFAULT_MIG_CONFIG = MigDeviceConfig.model_validate({"apiVersion": API_VERSION, "kind": "MigDeviceConfig"})
DEFAULT_VFIO_CONFIG = VfioDeviceConfig.model_validate({"apiVersion": API_VERSION, "kind": "VfioDeviceConfig"})


class ConfigError(Exception):
    """An opaque config for our driver is invalid; the message names the entry and the field."""


@dataclass(frozen=True)
class Decoded:
    """One decoded opaque config: the settings, and per-device limits only NVIDIA's API can state."""

    config: AnyConfig
    # defaultPerDevicePinnedMemoryLimit of resource.nvidia.com: device uuid or index -> quantity.
    per_device_pinned_limits: Mapping[str, str] = field(default_factory=dict)


def decode_config(entry: OpaqueConfig) -> AnyConfig:
    """Decode one opaque config; :class:`ConfigError` names the entry and every wrong field."""
    return decode_entry(entry).config


def decode_entry(entry: OpaqueConfig) -> Decoded:
    """Decode one opaque config of either API served (ours, or NVIDIA's translated into ours)."""
    parameters = entry.parameters
    if not isinstance(parameters, Mapping):
        raise ConfigError(f"{entry.describe()}: parameters must be a JSON object with apiVersion and kind")
    api_version, kind = parameters.get("apiVersion"), parameters.get("kind")
    _check_no_mig_time_slice(entry, parameters)
    per_device: Mapping[str, str] = {}
    if api_version == nvidia_config.NVIDIA_API_VERSION:
        try:
            translated = nvidia_config.translate(parameters, API_VERSION)
        except nvidia_config.NvidiaConfigError as error:
            raise ConfigError(f"{entry.describe()}: {error}") from None
        parameters, per_device = translated.parameters, translated.per_device_pinned_limits
    elif api_version != API_VERSION:
        raise ConfigError(
            f"{entry.describe()}: apiVersion: {api_version!r} is not served; use {API_VERSION} "
            f"(or NVIDIA's {nvidia_config.NVIDIA_API_VERSION})"
        )
    model = _KINDS.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise ConfigError(
            f"{entry.describe()}: kind: {kind!r} is not a kind of {API_VERSION}; use {' or '.join(_KINDS)}"
        )
    try:
        # Validated as JSON, which it is: errors then speak of objects and arrays, not Python types.
        config = model.model_validate_json(json.dumps(parameters))
    except ValidationError as error:
        raise ConfigError(f"{entry.describe()}: {describe_errors(error)}") from None
    return Decoded(config, per_device)


def _check_no_mig_time_slice(entry: OpaqueConfig, parameters: Mapping[str, Any]) -> None:
    """A time slice for a MIG device: refused with the reason, not as an unknown field."""
    sharing = parameters.get("sharing")
    if parameters.get("kind") != "MigDeviceConfig" or not isinstance(sharing, Mapping):
        return
    for name in ("timeSlicing", "timeSlicingConfig"):
        if name in sharing:
            raise ConfigError(
                f"{entry.describe()}: sharing.{name}: a MIG device's time slice cannot be set (the "
                "hardware time-slices the processes on one MIG device with a fixed slice); remove it, "
                "or ask for a full GPU with a GpuConfig"
            )


def config_json(config: AnyConfig) -> dict[str, Any]:
    """The config as the user would write it (camelCase), with defaults filled in."""
    return config.model_dump(mode="json", by_alias=True, exclude_none=True)


_Config = TypeVar("_Config")


def effective_config(
    results: Sequence[AllocationResult], configs: Sequence[tuple[OpaqueConfig, _Config]]
) -> dict[AllocationResult, _Config]:
    """Which config wins for each result; results no config applies to are left out.

    ``configs`` are one kind's configs in allocation order; this sorts class configs
    before claim configs (stable, so the order within each source is kept) and lets
    the last applicable one win.
    """
    return {result: config for result, (_entry, config) in winning_configs(results, configs).items()}


def winning_configs(
    results: Sequence[AllocationResult], configs: Sequence[tuple[OpaqueConfig, _Config]]
) -> dict[AllocationResult, tuple[OpaqueConfig, _Config]]:
    """:func:`effective_config`, keeping the entry each winner came from."""
    ordered = sorted(configs, key=lambda pair: pair[0].source is ConfigSource.FROM_CLAIM)
    chosen: dict[AllocationResult, tuple[OpaqueConfig, _Config]] = {}
    for entry, config in ordered:
        for result in results:
            if _applies(entry, result):
                chosen[result] = (entry, config)
    return chosen


def _applies(entry: OpaqueConfig, result: AllocationResult) -> bool:
    """All requests when none is named; "req" covers "req/sub"; "req/sub" covers only itself."""
    return not entry.requests or result.request in entry.requests or result.parent_request in entry.requests


def json_schemas() -> dict[str, dict[str, Any]]:
    """The JSON schema of every kind served, by file name under ``api/config/``: the driver's own
    (``v1alpha1/<Kind>.json``) and NVIDIA's (``resource.nvidia.com/v1beta1/<Kind>.json``)."""
    id_prefix = f"https://{CONFIG_GROUP}/schemas"
    return {
        **{
            f"{CONFIG_VERSION}/{kind}.json": {
                "$schema": "https://json-schema.org/draft/2020-12/schema",
                "$id": f"{id_prefix}/{CONFIG_VERSION}/{kind}.json",
                **model.model_json_schema(by_alias=True),
            }
            for kind, model in _KINDS.items()
        },
        **nvidia_config.json_schemas(id_prefix),
    }
