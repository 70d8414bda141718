"""NVIDIA's config API (resource.nvidia.com/v1beta1): claims written for NVIDIA's driver keep it."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dra_driver.node.claims import ClaimRejected, ConfigSource, OpaqueConfig
from dra_driver.node.config import ConfigError, GpuConfig, MigDeviceConfig, config_json, decode_config

from .builders import Node, opaque, result
from .test_plan import device_env, plan

NVIDIA = "resource.nvidia.com/v1beta1"


def nvidia(kind: str = "GpuConfig", sharing: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    config: dict[str, Any] = {"apiVersion": NVIDIA, "kind": kind, **extra}
    if sharing is not None:
        config["sharing"] = sharing
    return config


def decode(parameters: Any) -> GpuConfig | MigDeviceConfig:
    return decode_config(OpaqueConfig(0, ConfigSource.FROM_CLAIM, ("gpu",), parameters))


@pytest.mark.parametrize(
    ("parameters", "ours"),
    [
        (nvidia(), {"strategy": "Exclusive"}),
        (
            nvidia(sharing={"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}}),
            {"strategy": "TimeSlicing", "timeSlicing": {"interval": "Long"}},
        ),
        (
            nvidia(sharing={"strategy": "TimeSlicing"}),
            {"strategy": "TimeSlicing", "timeSlicing": {"interval": "Default"}},
        ),
        (
            nvidia(sharing={"strategy": "TimeSlicing", "timeSlicingConfig": {}}),
            {"strategy": "TimeSlicing", "timeSlicing": {"interval": "Default"}},
        ),
        (
            nvidia(
                sharing={
                    "strategy": "MPS",
                    "mpsConfig": {
                        "defaultActiveThreadPercentage": 50,
                        "defaultPinnedDeviceMemoryLimit": "10Gi",
                    },
                }
            ),
            {
                "strategy": "MPS",
                "mps": {"defaultActiveThreadPercentage": 50, "defaultPinnedDeviceMemoryLimit": "10Gi"},
            },
        ),
        (nvidia(sharing={"strategy": "MPS"}), {"strategy": "MPS"}),
        (nvidia("MigDeviceConfig"), {"strategy": "Exclusive"}),
        (nvidia("MigDeviceConfig", {"strategy": "TimeSlicing"}), {"strategy": "TimeSlicing"}),
        (
            nvidia(
                "MigDeviceConfig", {"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 20}}
            ),
            {"strategy": "MPS", "mps": {"defaultActiveThreadPercentage": 20}},
        ),
    ],
)
def test_nvidia_config_means_the_same_in_our_api(parameters: dict[str, Any], ours: dict[str, Any]) -> None:
    config = decode(parameters)

    assert config.kind == parameters["kind"]
    assert config_json(config)["sharing"] == ours


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        (
            nvidia(sharing={"strategy": "Exclusive"}),
            "sharing.strategy: Input should be 'TimeSlicing' or 'MPS'",
        ),
        (
            nvidia(sharing={"strategy": "TimeSlicing", "timeSlicing": {"interval": "Long"}}),
            "sharing.timeSlicing: Extra inputs are not permitted",
        ),
        (
            nvidia(sharing={"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Forever"}}),
            "sharing.timeSlicingConfig.interval: Input should be 'Default', 'Short', 'Medium' or 'Long'",
        ),
        (
            nvidia(sharing={"strategy": "MPS", "timeSlicingConfig": {}}),
            "sharing: cannot use TimeSlicingConfig with the 'MPS' strategy",
        ),
        (
            nvidia(sharing={"strategy": "TimeSlicing", "mpsConfig": {}}),
            "sharing: cannot use MpsConfig with the 'TimeSlicing' strategy",
        ),
        (
            nvidia(sharing={"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 101}}),
            "sharing.mpsConfig.defaultActiveThreadPercentage: Input should be less than or equal to 100",
        ),
        (
            nvidia(sharing={"strategy": "MPS", "mpsConfig": {"defaultPinnedDeviceMemoryLimit": "lots"}}),
            "sharing.mpsConfig.defaultPinnedDeviceMemoryLimit: String should match pattern",
        ),
        (
            nvidia("MigDeviceConfig", {"strategy": "TimeSlicing", "timeSlicingConfig": {}}),
            "sharing.timeSlicingConfig: a MIG device's time slice cannot be set",
        ),
        (nvidia(metadata={"name": "x"}), "metadata: Extra inputs are not permitted"),
        (
            nvidia("VfioDeviceConfig", iommu={"backendPolicy": "Legacy"}),
            "iommu.backendPolicy: Input should be 'LegacyOnly' or 'PreferIommuFD'",
        ),
        (
            nvidia("ComputeDomainChannelConfig"),
            "ComputeDomains (IMEX channels) are served by the compute-domain driver",
        ),
        (
            nvidia("TpuConfig"),
            "kind: 'TpuConfig' is not a kind of resource.nvidia.com/v1beta1 this driver serves; "
            "use GpuConfig or MigDeviceConfig or VfioDeviceConfig",
        ),
    ],
)
def test_invalid_nvidia_config_names_the_entry_and_the_field(
    parameters: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError) as error:
        decode(parameters)

    assert str(error.value).startswith("config[0] (FromClaim, requests [gpu]): ")
    assert message in str(error.value)


def test_nvidia_time_slicing_reaches_the_container(node: Node) -> None:
    slicing = nvidia(sharing={"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}})

    planned = plan(node, [result("gpu-0")], [opaque(slicing)])

    env = device_env(planned, "gpu-0")
    assert env["DRA_GPU_SHARING_STRATEGY_GPU_0"] == "TimeSlicing"
    assert env["DRA_GPU_TIME_SLICE_INTERVAL_GPU_0"] == "Long"


def test_per_device_pinned_limits_by_index_and_uuid_override_the_default(node: Node) -> None:
    uuid_1 = node.backend.inventory().gpus[1].uuid
    mps = nvidia(
        sharing={
            "strategy": "MPS",
            "mpsConfig": {
                "defaultPinnedDeviceMemoryLimit": "1Gi",
                "defaultPerDevicePinnedMemoryLimit": {"0": "2Gi", uuid_1: "3Gi"},
            },
        }
    )

    planned = plan(node, [result("gpu-0"), result("gpu-1"), result("gpu-2")], [opaque(mps)])

    limits = [
        device_env(planned, f"gpu-{i}")[f"DRA_GPU_MPS_PINNED_DEVICE_MEMORY_LIMIT_GPU_{i}"] for i in range(3)
    ]
    assert limits == [str(2 * 2**30), str(3 * 2**30), str(2**30)]


def test_per_device_pinned_limit_naming_no_device_rejects_the_claim(node: Node) -> None:
    mps = nvidia(
        sharing={"strategy": "MPS", "mpsConfig": {"defaultPerDevicePinnedMemoryLimit": {"5": "1Gi"}}}
    )

    with pytest.raises(
        ClaimRejected, match=re.escape("defaultPerDevicePinnedMemoryLimit: invalid device '5'")
    ):
        plan(node, [result("gpu-0"), result("gpu-1")], [opaque(mps)])


def test_per_device_pinned_limit_beyond_the_device_rejects_the_claim(node: Node) -> None:
    mps = nvidia(
        sharing={"strategy": "MPS", "mpsConfig": {"defaultPerDevicePinnedMemoryLimit": {"0": "1Ti"}}}
    )

    with pytest.raises(ClaimRejected, match="defaultPinnedDeviceMemoryLimit 1Ti exceeds the device's memory"):
        plan(node, [result("gpu-0")], [opaque(mps)])


def test_our_own_api_and_nvidias_sit_side_by_side(node: Node) -> None:
    ours = {
        "apiVersion": "resource.dra-driver.dev/v1alpha1",
        "kind": "GpuConfig",
        "sharing": {"strategy": "MPS"},
    }
    theirs = nvidia(sharing={"strategy": "TimeSlicing"})

    planned = plan(
        node,
        [result("gpu-0", "a"), result("gpu-1", "b")],
        [opaque(ours, requests=["a"]), opaque(theirs, requests=["b"])],
    )

    assert [d.config.sharing.strategy for d in planned.devices] == ["MPS", "TimeSlicing"]


# --- the generated JSON schema of NVIDIA's kinds (api/config/resource.nvidia.com/v1beta1) ----------

SCHEMA_DIR = Path(__file__).resolve().parents[2] / "api" / "config" / "resource.nvidia.com" / "v1beta1"


def nvidia_schema(kind: str) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((SCHEMA_DIR / f"{kind}.json").read_text())
    return loaded


@pytest.mark.parametrize("kind", ["GpuConfig", "MigDeviceConfig"])
def test_nvidia_schema_is_valid_json_schema_and_refuses_a_misspelt_field(kind: str) -> None:
    schema = nvidia_schema(kind)
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    assert validator.is_valid(nvidia(kind, sharing={"strategy": "MPS", "mpsConfig": {}}))
    # Our own API's spelling is a mistake in NVIDIA's.
    assert not validator.is_valid(nvidia(kind, sharing={"strategy": "MPS", "mps": {}}))


memory_limits = st.sampled_from(["10Gi", "1.5Mi", "big", "3"])
nvidia_sharing_values = st.fixed_dictionaries(
    {"strategy": st.sampled_from(["TimeSlicing", "MPS", "Exclusive"])},
    optional={
        "timeSlicingConfig": st.one_of(
            st.none(),
            st.fixed_dictionaries({}, optional={"interval": st.sampled_from(["Default", "Long", "x"])}),
        ),
        "mpsConfig": st.one_of(
            st.none(),
            st.fixed_dictionaries(
                {},
                optional={
                    "defaultActiveThreadPercentage": st.integers(-5, 105),
                    "defaultPinnedDeviceMemoryLimit": memory_limits,
                    "defaultPerDevicePinnedMemoryLimit": st.dictionaries(
                        st.sampled_from(["0", "GPU-1"]), memory_limits, max_size=2
                    ),
                },
            ),
        ),
        "timeSlicing": st.just({}),
    },
)


@given(
    kind=st.sampled_from(["GpuConfig", "MigDeviceConfig"]),
    sharing=st.one_of(st.none(), nvidia_sharing_values),
)
def test_nvidia_schema_agrees_with_the_driver(kind: str, sharing: dict[str, Any] | None) -> None:
    """What the driver accepts in NVIDIA's API the schema accepts, and the reverse."""
    parameters = nvidia(kind, sharing=sharing)
    try:
        decode(parameters)
        accepted = True
    except ConfigError:
        accepted = False

    valid = jsonschema.Draft202012Validator(nvidia_schema(kind)).is_valid(parameters)

    assert accepted == valid, parameters
