"""The opaque config API: strict decoding, field-naming errors, precedence, and the generated schema."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dra_driver.node.api_base import quantity_bytes
from dra_driver.node.claims import AllocationResult, ConfigSource, OpaqueConfig
from dra_driver.node.config import (
    API_VERSION,
    ConfigError,
    GpuConfig,
    MigDeviceConfig,
    config_json,
    decode_config,
    effective_config,
    json_schemas,
)

from .builders import gpu_config

REPO = Path(__file__).resolve().parents[2]


def entry(parameters: Any, index: int = 1, source: ConfigSource = ConfigSource.FROM_CLAIM) -> OpaqueConfig:
    return OpaqueConfig(index, source, ("gpu",), parameters)


def test_full_gpu_config_round_trips() -> None:
    parameters = gpu_config(
        {
            "strategy": "MPS",
            "mps": {"defaultActiveThreadPercentage": 50, "defaultPinnedDeviceMemoryLimit": "10Gi"},
        }
    )

    config = decode_config(entry(parameters))

    assert isinstance(config, GpuConfig)
    assert config.sharing.mps is not None
    assert config.sharing.mps.default_active_thread_percentage == 50
    assert config_json(config) == parameters


def test_defaults_are_exclusive() -> None:
    gpu = decode_config(entry(gpu_config()))
    mig = decode_config(entry({"apiVersion": API_VERSION, "kind": "MigDeviceConfig"}))

    assert isinstance(mig, MigDeviceConfig)
    assert gpu.sharing.strategy == mig.sharing.strategy == "Exclusive"
    assert config_json(gpu)["sharing"] == {"strategy": "Exclusive"}


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        (
            gpu_config({"strategy": "Shared"}),
            "config[1] (FromClaim, requests [gpu]): sharing.strategy: "
            "Input should be 'Exclusive', 'TimeSlicing' or 'MPS'",
        ),
        (
            gpu_config({"strategy": "TimeSlicing", "timeSlicing": {"interval": "Forever"}}),
            "sharing.timeSlicing.interval: Input should be 'Default', 'Short', 'Medium' or 'Long'",
        ),
        (
            gpu_config({"strategy": "MPS", "mps": {"defaultActiveThreadPercentage": 0}}),
            "sharing.mps.defaultActiveThreadPercentage: Input should be greater than or equal to 1",
        ),
        (
            gpu_config({"strategy": "MPS", "mps": {"defaultActiveThreadPercentage": "50"}}),
            "sharing.mps.defaultActiveThreadPercentage: Input should be a valid integer",
        ),
        (
            gpu_config({"strategy": "MPS", "mps": {"defaultActiveThreadPercentage": 50.0}}),
            "sharing.mps.defaultActiveThreadPercentage: Input should be a valid integer",
        ),
        (
            gpu_config({"strategy": "MPS", "mps": {"defaultPinnedDeviceMemoryLimit": "lots"}}),
            "sharing.mps.defaultPinnedDeviceMemoryLimit: String should match pattern",
        ),
        (
            gpu_config({"strategy": "MPS", "mps": {"defaultPinnedDeviceMemoryLimit": "0.5"}}),
            "sharing.mps.defaultPinnedDeviceMemoryLimit: '0.5' is not a whole, positive number of bytes",
        ),
        (
            gpu_config({"strategy": "Exclusive", "mps": {}}),
            "sharing: mps is only valid with strategy MPS, not Exclusive",
        ),
        (
            gpu_config({"strategy": "MPS", "timeSlicing": {}}),
            "sharing: timeSlicing is only valid with strategy TimeSlicing, not MPS",
        ),
        (
            gpu_config({"strategy": "MPS", "mpsConfig": {}}),
            "sharing.mpsConfig: Extra inputs are not permitted",
        ),
        ({**gpu_config(), "extra": True}, "extra: Extra inputs are not permitted"),
        (
            {"apiVersion": API_VERSION, "kind": "GpuConfig", "sharing": []},
            "sharing: Input should be an object",
        ),
        (
            {
                "apiVersion": API_VERSION,
                "kind": "MigDeviceConfig",
                "sharing": {"strategy": "TimeSlicing", "timeSlicing": {}},
            },
            "sharing.timeSlicing: a MIG device's time slice cannot be set",
        ),
        (
            {"apiVersion": "resource.nvidia.com/v1", "kind": "GpuConfig"},
            "apiVersion: 'resource.nvidia.com/v1' is not served; use resource.dra-driver.dev/v1alpha1 "
            "(or NVIDIA's resource.nvidia.com/v1beta1)",
        ),
        (
            {"apiVersion": API_VERSION, "kind": "TpuConfig"},
            "kind: 'TpuConfig' is not a kind of resource.dra-driver.dev/v1alpha1; "
            "use GpuConfig or MigDeviceConfig",
        ),
        ("GpuConfig", "parameters must be a JSON object with apiVersion and kind"),
    ],
)
def test_invalid_config_names_entry_and_field(parameters: Any, message: str) -> None:
    with pytest.raises(ConfigError) as error:
        decode_config(entry(parameters))

    assert str(error.value).startswith("config[1] (FromClaim, requests [gpu]): ")
    assert message in str(error.value)


def test_every_wrong_field_is_reported_at_once() -> None:
    parameters = gpu_config({"strategy": "MPS", "mps": {"defaultActiveThreadPercentage": 101, "x": 1}})

    with pytest.raises(ConfigError) as error:
        decode_config(entry(parameters))

    assert "sharing.mps.defaultActiveThreadPercentage: Input should be less than or equal to 100" in str(
        error.value
    )
    assert "sharing.mps.x: Extra inputs are not permitted" in str(error.value)


@pytest.mark.parametrize(
    ("quantity", "expected"),
    [("1", 1), ("10Gi", 10 * 2**30), ("512M", 512 * 10**6), ("1.5Ki", 1536), ("2k", 2000), ("1Ei", 2**60)],
)
def test_quantity_bytes(quantity: str, expected: int) -> None:
    assert quantity_bytes(quantity) == expected


@pytest.mark.parametrize("quantity", ["", "0", "0.1", "1.3Ki", "-1Gi", "1e9", "10gi", "10 Gi", "100m"])
def test_quantity_bytes_rejects(quantity: str) -> None:
    with pytest.raises(ValueError, match=r"is not a memory quantity|is not a whole, positive number"):
        quantity_bytes(quantity)


# --- precedence -----------------------------------------------------------------------------------

REQUESTS = ["a", "b", "a/x", "a/y", "b/x"]


def make_config() -> GpuConfig:
    """A fresh instance: the tests below tell configs apart by identity."""
    return GpuConfig.model_validate(gpu_config())


def pair(source: ConfigSource, *requests: str, index: int = 0) -> tuple[OpaqueConfig, GpuConfig]:
    return OpaqueConfig(index, source, requests, None), make_config()


def test_parent_request_covers_subrequest_results() -> None:
    sub, other_sub, plain = (
        AllocationResult("a/x", "n", "gpu-0"),
        AllocationResult("a/y", "n", "gpu-1"),
        AllocationResult("b", "n", "gpu-2"),
    )
    parent = pair(ConfigSource.FROM_CLAIM, "a")
    exact = pair(ConfigSource.FROM_CLAIM, "a/y")

    chosen = effective_config([sub, other_sub, plain], [parent, exact])

    assert chosen[sub] is parent[1]
    assert chosen[other_sub] is exact[1]
    assert plain not in chosen


def test_config_naming_no_request_applies_to_all() -> None:
    results = [AllocationResult(r, "n", f"gpu-{i}") for i, r in enumerate(REQUESTS)]
    every = pair(ConfigSource.FROM_CLASS)

    assert effective_config(results, [every]) == dict.fromkeys(results, every[1])


def test_claim_config_beats_class_config_listed_after_it() -> None:
    result = AllocationResult("a", "n", "gpu-0")
    claim, klass = pair(ConfigSource.FROM_CLAIM, "a"), pair(ConfigSource.FROM_CLASS)

    assert effective_config([result], [claim, klass])[result] is claim[1]


configs_strategy = st.lists(
    st.tuples(st.sampled_from(ConfigSource), st.lists(st.sampled_from(REQUESTS), max_size=3, unique=True)),
    max_size=8,
)


def applies(requests: tuple[str, ...], request: str) -> bool:
    return not requests or request in requests or request.partition("/")[0] in requests


@given(
    results=st.lists(st.sampled_from(REQUESTS), min_size=1, max_size=5).map(
        lambda rs: [AllocationResult(r, "n", f"gpu-{i}") for i, r in enumerate(rs)]
    ),
    raw_configs=configs_strategy,
)
def test_precedence_properties(results: list[AllocationResult], raw_configs: list[Any]) -> None:
    configs = [pair(source, *requests, index=i) for i, (source, requests) in enumerate(raw_configs)]

    chosen = effective_config(results, configs)

    for result in results:
        applicable = [(e, c) for e, c in configs if applies(e.requests, result.request)]
        if not applicable:
            assert result not in chosen
            continue
        winner_entry = next(e for e, c in configs if c is chosen[result])
        # The winner applies, and comes from the claim whenever any claim config applies ...
        assert applies(winner_entry.requests, result.request)
        from_claim = [e for e, _ in applicable if e.source is ConfigSource.FROM_CLAIM]
        assert (winner_entry.source is ConfigSource.FROM_CLAIM) == bool(from_claim)
        # ... and is the last applicable one of its source.
        same_source = [e for e, _ in applicable if e.source is winner_entry.source]
        assert winner_entry is same_source[-1]


@given(raw_configs=configs_strategy, data=st.data())
def test_interleaving_sources_does_not_matter(raw_configs: list[Any], data: st.DataObject) -> None:
    """Only the order within each source counts: class configs always come first."""
    results = [AllocationResult(r, "n", f"gpu-{i}") for i, r in enumerate(REQUESTS)]
    configs = [pair(source, *requests, index=i) for i, (source, requests) in enumerate(raw_configs)]
    klass = [c for c in configs if c[0].source is ConfigSource.FROM_CLASS]
    claim = [c for c in configs if c[0].source is ConfigSource.FROM_CLAIM]
    # A random interleaving that keeps each source's own order.
    picks = data.draw(st.permutations([0] * len(klass) + [1] * len(claim)))
    queues = [list(klass), list(claim)]
    interleaved = [queues[p].pop(0) for p in picks]

    assert effective_config(results, interleaved) == effective_config(results, klass + claim)


# --- the generated JSON schema ----------------------------------------------------------------------


def test_committed_schema_is_up_to_date() -> None:
    check = subprocess.run(
        [sys.executable, str(REPO / "hack" / "gen-config-schema.py"), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert check.returncode == 0, check.stderr


def schema_for(kind: str) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((REPO / "api" / "config" / "v1alpha1" / f"{kind}.json").read_text())
    return loaded


@pytest.mark.parametrize("kind", ["GpuConfig", "MigDeviceConfig", "VfioDeviceConfig"])
def test_schema_is_valid_json_schema(kind: str) -> None:
    jsonschema.Draft202012Validator.check_schema(schema_for(kind))
    assert set(json_schemas()) == {
        "v1alpha1/GpuConfig.json",
        "v1alpha1/MigDeviceConfig.json",
        "v1alpha1/VfioDeviceConfig.json",
        "resource.nvidia.com/v1beta1/GpuConfig.json",
        "resource.nvidia.com/v1beta1/MigDeviceConfig.json",
        "resource.nvidia.com/v1beta1/VfioDeviceConfig.json",
    }


sharing_values = st.fixed_dictionaries(
    {"strategy": st.sampled_from(["Exclusive", "TimeSlicing", "MPS", "Shared"])},
    optional={
        "timeSlicing": st.fixed_dictionaries(
            {}, optional={"interval": st.sampled_from(["Default", "Long", "x"])}
        ),
        "mps": st.fixed_dictionaries(
            {},
            optional={
                "defaultActiveThreadPercentage": st.integers(-5, 105),
                "defaultPinnedDeviceMemoryLimit": st.sampled_from(["10Gi", "1.5Mi", "big", "3"]),
            },
        ),
        "bogus": st.just(1),
    },
)


@given(kind=st.sampled_from(["GpuConfig", "MigDeviceConfig"]), sharing=sharing_values)
def test_schema_agrees_with_the_driver(kind: str, sharing: dict[str, Any]) -> None:
    """What the driver accepts the schema accepts, and the reverse (for values the schema can judge)."""
    parameters = {"apiVersion": API_VERSION, "kind": kind, "sharing": sharing}
    try:
        decode_config(entry(parameters))
        accepted = True
    except ConfigError:
        accepted = False

    valid = jsonschema.Draft202012Validator(schema_for(kind)).is_valid(parameters)

    assert accepted == valid
