"""NVIDIA's opaque config API, ``resource.nvidia.com/v1beta1``, as NVIDIA's DRA driver serves it.

Claims written for NVIDIA's driver (github.com/NVIDIA/k8s-dra-driver-gpu, ``api/nvidia.com/
resource/v1beta1``) carry configs such as::

    apiVersion: resource.nvidia.com/v1beta1
    kind: GpuConfig
    sharing:
      strategy: TimeSlicing
      timeSlicingConfig: {interval: Long}

This module decodes them with NVIDIA's field names and rules and translates them into the
driver's own API (:mod:`dra_driver.node.config`), so everything after decoding (precedence,
the checks against the device, the store, the container's environment) is one code path.

What each field means, next to NVIDIA's driver:

``GpuConfig.sharing`` absent
    no sharing settings: our ``Exclusive`` (NVIDIA's default while its ``TimeSlicingSettings``
    gate is off, which is its default).
``sharing.strategy: TimeSlicing`` with ``timeSlicingConfig.interval``
    Default, Short, Medium or Long (absent: Default); our ``timeSlicing.interval``.
``sharing.strategy: MPS`` with ``mpsConfig``
    ``defaultActiveThreadPercentage`` and ``defaultPinnedDeviceMemoryLimit`` as ours;
    ``defaultPerDevicePinnedMemoryLimit`` maps a device, by uuid or by its index among the
    devices the config applies to, to its own limit (resolved in :mod:`dra_driver.node.plan`).
``MigDeviceConfig``
    the same without ``timeSlicingConfig``.

Differences, all refusals rather than silent changes: NVIDIA's strategies need its
``TimeSlicingSettings``/``MPSSupport`` feature gates, ours need none; an
``mpsConfig`` beside ``strategy: TimeSlicing`` (which NVIDIA ignores on MIG devices) and
``defaultActiveThreadPercentage: 0`` are refused. Like our own API, the driver validates,
records and announces these settings (``DRA_GPU_SHARING_*`` variables); it does not set the
GPU's time slice or start an MPS daemon. Kinds NVIDIA serves that this driver does not
implement (the ComputeDomain configs) get an error naming the kind and the reason.
``VfioDeviceConfig`` (passthrough devices) keeps its fields: ``iommu.backendPolicy``
(LegacyOnly, the default, or PreferIommuFD) and ``iommu.enableAPIDevice`` (false by default,
as NVIDIA's: the container gets ``/dev/vfio/vfio``, or ``/dev/iommu`` under IOMMUFD, only when true).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from pydantic import ConfigDict, Field, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from dra_driver.node.api_base import ApiObject, MemoryQuantity, describe_errors, only_with_strategy

NVIDIA_API_VERSION: Final = "resource.nvidia.com/v1beta1"
NVIDIA_DRIVER_NAME: Final = "gpu.nvidia.com"

Interval = Literal["Default", "Short", "Medium", "Long"]


class TimeSlicingConfig(ApiObject):
    interval: Interval | None = Field(default=None, description="Absent means Default.")


class MpsConfig(ApiObject):
    default_active_thread_percentage: int | None = Field(default=None, ge=1, le=100)
    default_pinned_device_memory_limit: MemoryQuantity | None = None
    default_per_device_pinned_memory_limit: dict[str, MemoryQuantity] | None = Field(
        default=None, description="Device uuid or index (among the config's devices) -> limit."
    )


def _not_with(field_name: str, value: object, strategy: str) -> None:
    if value is not None:
        # NVIDIA's own words (GpuSharing.GetTimeSlicingConfig / GetMpsConfig).
        raise PydanticCustomError(
            "settings_without_strategy", f"cannot use {field_name} with the '{strategy}' strategy"
        )


class GpuSharing(ApiObject):
    model_config = ConfigDict(
        json_schema_extra=only_with_strategy(("timeSlicingConfig", "TimeSlicing"), ("mpsConfig", "MPS"))
    )

    strategy: Literal["TimeSlicing", "MPS"] = Field(
        description="NVIDIA's API has no Exclusive strategy: leave sharing out for no sharing."
    )
    time_slicing_config: TimeSlicingConfig | None = None
    mps_config: MpsConfig | None = None

    @model_validator(mode="after")
    def _settings_match_strategy(self) -> GpuSharing:
        if self.strategy == "TimeSlicing":
            _not_with("MpsConfig", self.mps_config, "TimeSlicing")
        else:
            _not_with("TimeSlicingConfig", self.time_slicing_config, "MPS")
        return self


class MigDeviceSharing(ApiObject):
    # NVIDIA's MIG sharing has no timeSlicingConfig (a MIG device's time slice is fixed).
    model_config = ConfigDict(json_schema_extra=only_with_strategy(("mpsConfig", "MPS")))

    strategy: Literal["TimeSlicing", "MPS"]
    mps_config: MpsConfig | None = None

    @model_validator(mode="after")
    def _settings_match_strategy(self) -> MigDeviceSharing:
        if self.strategy == "TimeSlicing":
            _not_with("MpsConfig", self.mps_config, "TimeSlicing")
        return self


class GpuConfig(ApiObject):
    api_version: Literal["resource.nvidia.com/v1beta1"]
    kind: Literal["GpuConfig"]
    sharing: GpuSharing | None = None


class MigDeviceConfig(ApiObject):
    api_version: Literal["resource.nvidia.com/v1beta1"]
    kind: Literal["MigDeviceConfig"]
    sharing: MigDeviceSharing | None = None


class IommuConfig(ApiObject):
    # NVIDIA's field is required inside iommu (its Validate refuses ""); absent here means LegacyOnly.
    backend_policy: Literal["LegacyOnly", "PreferIommuFD"] | None = None
    enable_api_device: bool | None = Field(default=None, alias="enableAPIDevice")  # NVIDIA's spelling


class VfioDeviceConfig(ApiObject):
    api_version: Literal["resource.nvidia.com/v1beta1"]
    kind: Literal["VfioDeviceConfig"]
    iommu: IommuConfig | None = None


_KINDS: dict[str, type[GpuConfig] | type[MigDeviceConfig] | type[VfioDeviceConfig]] = {
    "GpuConfig": GpuConfig,
    "MigDeviceConfig": MigDeviceConfig,
    "VfioDeviceConfig": VfioDeviceConfig,
}
# NVIDIA serves these too; why this driver does not.
UNSUPPORTED_KINDS: Final[Mapping[str, str]] = {
    "ComputeDomainChannelConfig": "ComputeDomains (IMEX channels) are served by the compute-domain "
    "driver (compute-domain.nvidia.com beside gpu.nvidia.com; the chart's computeDomains), not by this "
    "GPU driver: use the ResourceClaimTemplate the ComputeDomain creates",
    "ComputeDomainDaemonConfig": "ComputeDomains (IMEX daemons) are served by the compute-domain "
    "driver (compute-domain.nvidia.com beside gpu.nvidia.com; the chart's computeDomains), not by this "
    "GPU driver: its controller creates the daemons' claims",
}


def json_schemas(id_prefix: str) -> dict[str, dict[str, Any]]:
    """The JSON schema of each kind this driver serves, by file name under ``api/config/``
    (``resource.nvidia.com/v1beta1/<Kind>.json``); ``$id`` starts with ``id_prefix``: the schemas
    are this driver's reading of NVIDIA's API, not NVIDIA's own."""
    return {
        f"{NVIDIA_API_VERSION}/{kind}.json": {
            "$schema": "https://json-schema.org/draft/2020-12/schema",
            "$id": f"{id_prefix}/{NVIDIA_API_VERSION}/{kind}.json",
            **model.model_json_schema(by_alias=True),
        }
        for kind, model in _KINDS.items()
    }


@dataclass(frozen=True)
class Translated:
    """An NVIDIA config in the driver's own API, and what that API has no field for."""

    parameters: dict[str, Any]  # JSON of resource.dra-driver.dev/v1alpha1
    per_device_pinned_limits: Mapping[str, str] = field(default_factory=dict)


class NvidiaConfigError(ValueError):
    """What is wrong with the config, as ``field: reason`` (the caller names the entry)."""


def translate(parameters: Mapping[str, Any], native_api_version: str) -> Translated:
    """Decode NVIDIA's config strictly and express it in the driver's own API."""
    kind = parameters.get("kind")
    if isinstance(kind, str) and kind in UNSUPPORTED_KINDS:
        raise NvidiaConfigError(f"kind: {kind} of {NVIDIA_API_VERSION}: {UNSUPPORTED_KINDS[kind]}")
    model = _KINDS.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise NvidiaConfigError(
            f"kind: {kind!r} is not a kind of {NVIDIA_API_VERSION} this driver serves; use "
            f"{' or '.join(_KINDS)}"
        )
    try:
        config = model.model_validate_json(json.dumps(parameters))
    except ValidationError as error:
        raise NvidiaConfigError(describe_errors(error)) from None
    if isinstance(config, VfioDeviceConfig):
        iommu = config.iommu or IommuConfig()
        return Translated(
            parameters={
                "apiVersion": native_api_version,
                "kind": config.kind,
                "iommu": {
                    "backendPolicy": iommu.backend_policy or "LegacyOnly",
                    "enableAPIDevice": bool(iommu.enable_api_device),
                },
            }
        )
    sharing: dict[str, Any] = {"strategy": "Exclusive"}
    per_device: Mapping[str, str] = {}
    if config.sharing is not None:
        sharing = {"strategy": config.sharing.strategy}
        if isinstance(config.sharing, GpuSharing) and config.sharing.strategy == "TimeSlicing":
            slicing = config.sharing.time_slicing_config
            sharing["timeSlicing"] = {"interval": (slicing.interval if slicing else None) or "Default"}
        mps = config.sharing.mps_config
        if config.sharing.strategy == "MPS" and mps is not None:
            sharing["mps"] = {
                key: value
                for key, value in (
                    ("defaultActiveThreadPercentage", mps.default_active_thread_percentage),
                    ("defaultPinnedDeviceMemoryLimit", mps.default_pinned_device_memory_limit),
                )
                if value is not None
            }
            per_device = dict(mps.default_per_device_pinned_memory_limit or {})
    return Translated(
        parameters={"apiVersion": native_api_version, "kind": config.kind, "sharing": sharing},
        per_device_pinned_limits=per_device,
    )
