"""Hypothesis over the parsers: claim JSON (through planning to the CDI spec), opaque configs, the
node's store and the schema-2 checkpoint files its first start imports.

Each target states what the parser may answer: a result, or its own "this input is bad" error
(ClaimRejected, ConfigError, StoreFromNewerDriver), whose message is what the user reads. Any
other exception is a crash: on the node it would be an "internal error" for a claim, or, for a
damaged store or checkpoint, a daemon that cannot start.

Inputs are near-valid documents with random parts replaced, plus arbitrary JSON, so that the
parsers' deep paths are reached and not only their first type check.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import tempfile
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dra_driver.cdi.spec import common_edits
from dra_driver.devices.types import Inventory
from dra_driver.node.claims import ClaimRejected, ConfigSource, OpaqueConfig, allocated_claim
from dra_driver.node.config import API_VERSION, ConfigError, decode_config
from dra_driver.node.legacy import canonical_json
from dra_driver.node.plan import plan_claim
from dra_driver.node.records import StoreFromNewerDriver
from dra_driver.node.store import STORE_FILE, open_store
from dra_driver.node.types import ClaimRef
from dra_driver.simulated.gpus import SimulatedBackend

DRIVER = "gpu.nvidia.com"
POOL = "fuzz-node"
REF = ClaimRef(namespace="ns", name="claim", uid="0b6f3c1e-5a6d-4f8e-9c2b-1d2e3f4a5b6c")

_text = st.text(max_size=12) | st.sampled_from(["", "gpu", "..", "/", "a/b", "../../etc", "\x00", "é☃"])
_scalar = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | _text
json_values = st.recursive(
    _scalar,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_text, inner, max_size=4),
    max_leaves=12,
)


def _maybe(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """The near-valid value most of the time, anything some of the time."""
    return st.one_of(strategy, strategy, strategy, json_values)


_devices = st.sampled_from(
    [
        "gpu-0", "gpu-7", "gpu-8", "gpu-3-mig-1g10gb-19-2", "gpu-3-mig-7g80gb-0-0", "gpu-3-mig-3g40gb-9-4",
        "gpu-1-mig-1g10gb-19-9", "gpu-0-mig-bogus", "", "gpu--1", "../gpu-0",
    ]
) | _text  # fmt: skip
_sharing = st.fixed_dictionaries(
    {},
    optional={
        "strategy": _maybe(st.sampled_from(["TimeSlicing", "MPS", "None", "timeslicing"])),
        "timeSlicingConfig": _maybe(st.fixed_dictionaries({"interval": _maybe(st.sampled_from(
            ["Default", "Short", "Medium", "Long", "Forever"]))})),
        "mpsConfig": _maybe(st.fixed_dictionaries({}, optional={
            "defaultActiveThreadPercentage": _maybe(st.integers(-5, 105)),
            "defaultPinnedDeviceMemoryLimit": _maybe(st.sampled_from(["10Gi", "1", "-1Gi", "1.5Gi", "x"])),
            "defaultPerDevicePinnedMemoryLimit": _maybe(st.dictionaries(_devices, _text, max_size=2)),
        })),
    },
)  # fmt: skip
opaque_parameters = _maybe(
    st.fixed_dictionaries(
        {
            "apiVersion": _maybe(st.sampled_from([API_VERSION, "gpu.nvidia.com/v1", ""])),
            "kind": _maybe(st.sampled_from(["GpuConfig", "MigDeviceConfig", "ComputeDomain", ""])),
        },
        optional={"sharing": _maybe(_sharing), "extra": json_values},
    )
)
_result = _maybe(
    st.fixed_dictionaries(
        {
            "request": _maybe(st.sampled_from(["gpu", "gpus/a", "", "x" * 70])),
            "driver": _maybe(st.just(DRIVER)),
            "pool": _maybe(st.just(POOL)),
            "device": _maybe(_devices),
        },
        optional={"adminAccess": _maybe(st.booleans()), "shareID": _maybe(_text)},
    )
)
_config = _maybe(
    st.fixed_dictionaries(
        {
            "source": _maybe(st.sampled_from(["FromClaim", "FromClass"])),
            "opaque": _maybe(st.fixed_dictionaries(
                {"driver": _maybe(st.just(DRIVER)), "parameters": opaque_parameters}
            )),
        },
        optional={"requests": _maybe(st.lists(st.sampled_from(["gpu", "gpus", "x"]), max_size=3))},
    )
)  # fmt: skip
claims = _maybe(
    st.fixed_dictionaries(
        {
            "metadata": _maybe(st.fixed_dictionaries({"uid": _maybe(st.just(REF.uid))})),
            "status": _maybe(st.fixed_dictionaries({"allocation": _maybe(st.fixed_dictionaries({
                "devices": _maybe(st.fixed_dictionaries({
                    "results": _maybe(st.lists(_result, max_size=4)),
                    "config": _maybe(st.lists(_config, max_size=3)),
                })),
            }))})),
        }
    )
)  # fmt: skip


@dataclass
class ParserFigures:
    cases: dict[str, int] = field(default_factory=dict)
    crashes: dict[str, int] = field(default_factory=dict)
    examples: list[str] = field(default_factory=list)  # the first few crashes, with their traceback


def _target(
    figures: ParserFigures, name: str, strategy: st.SearchStrategy[Any], examples: int, seed: int
) -> Callable[[Callable[[Any], None]], None]:
    def run(body: Callable[[Any], None]) -> None:
        figures.cases[name] = figures.crashes[name] = 0

        @settings(
            max_examples=examples,
            deadline=None,
            database=None,
            derandomize=False,
            suppress_health_check=list(HealthCheck),
        )
        @given(strategy)
        def case(value: Any) -> None:
            figures.cases[name] += 1
            try:
                body(value)
            except Exception:
                figures.crashes[name] += 1
                if len(figures.examples) < 10:
                    figures.examples.append(f"{name}: {value!r:.300}\n{traceback.format_exc(limit=4)}")

        case._hypothesis_internal_use_seed = seed  # type: ignore[attr-defined]
        case()

    return run


def run(examples_per_target: int, seed: int) -> ParserFigures:
    """Five targets, ``examples_per_target`` cases each (a tenth of that for the file-system one)."""
    saved = structlog.get_config()
    # The parsers log every bad file they move aside: right on a node, a flood here.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    try:
        return _run(examples_per_target, seed)
    finally:
        structlog.configure(**saved)


def _run(examples_per_target: int, seed: int) -> ParserFigures:
    figures = ParserFigures()
    with tempfile.TemporaryDirectory(prefix="dra-fuzz-") as scratch:
        backend = SimulatedBackend("dgx-h100", POOL, Path(scratch))
        inventory = backend.inventory()
        edits = common_edits(inventory, None)

        @_target(figures, "claim_json", claims, examples_per_target, seed)
        def _(claim: Any) -> None:
            _claim_to_spec(claim, inventory, edits)

        @_target(figures, "opaque_config", opaque_parameters, examples_per_target, seed)
        def _(parameters: Any) -> None:
            entry = OpaqueConfig(index=0, source=ConfigSource.FROM_CLAIM, requests=(), parameters=parameters)
            with contextlib.suppress(ConfigError):
                decode_config(entry)

        state = Path(scratch) / "state"

        def started(files: dict[str, bytes]) -> None:
            """A first start on a data directory holding ``files``: it must open a store."""
            state.mkdir(exist_ok=True)
            for leftover in state.iterdir():
                leftover.unlink()
            for name, data in files.items():
                (state / name).write_bytes(data)
            # A bad file is moved aside or ignored; one of a newer schema is refused, for the daemon to say.
            with contextlib.suppress(StoreFromNewerDriver):
                open_store(state / STORE_FILE, "boot-a").store.close()

        @_target(figures, "checkpoint_import", _checkpoint_bytes(), examples_per_target // 10, seed)
        def _(data: bytes) -> None:
            started({"checkpoint.json": data})

        @_target(figures, "checkpoint_log_import", _log_bytes(), examples_per_target // 10, seed)
        def _(data: bytes) -> None:
            started({"checkpoint.json": _snapshot(0, {}), "checkpoint.json.log": data})

        store_bytes = st.binary(max_size=400) | st.builds(
            lambda d: b"SQLite format 3\x00" + d, st.binary(max_size=4000)
        )

        @_target(figures, "store_bytes", store_bytes, examples_per_target // 10, seed)
        def _(data: bytes) -> None:
            started({STORE_FILE: data})

        backend.close()
    return figures


def _claim_to_spec(claim: Any, inventory: Inventory, edits: Any) -> None:
    if not isinstance(claim, dict):  # the fetcher returns only JSON objects (see claim_fetcher)
        return
    try:
        allocated = allocated_claim(REF, claim, DRIVER, POOL)
        plan = plan_claim(allocated, inventory, DRIVER, edits)
        json.dumps(plan.cdi_spec if not plan.to_create else {})
    except ClaimRejected:
        pass


def _snapshot(generation: int, claims: dict[str, Any]) -> bytes:
    """A schema-2 ``checkpoint.json`` as earlier versions wrote it."""
    payload = {"bootId": "boot-a", "generation": generation, "claims": claims}
    digest = hashlib.sha256(canonical_json(payload)).hexdigest()
    return json.dumps({"schemaVersion": 2, "checksum": f"sha256:{digest}", "payload": payload}).encode()


def _log_bytes() -> st.SearchStrategy[bytes]:
    """The schema-2 checkpoint's log: a header, then signed entries (of any content), or junk."""

    def signed(body: Any) -> bytes:
        digest = hashlib.sha256(canonical_json(body)).hexdigest()
        return canonical_json({"checksum": f"sha256:{digest}", "entry": body}) + b"\n"

    body = _maybe(
        st.fixed_dictionaries(
            {
                "generation": _maybe(st.integers(0, 3)),
                "set": _maybe(st.dictionaries(_text, json_values, max_size=2)),
                "delete": _maybe(st.lists(_text, max_size=2)),
            }
        )
    )
    header = st.builds(
        lambda b, e: json.dumps({"base": b, "epoch": e}).encode() + b"\n", st.integers(-1, 3), _text
    ) | st.binary(max_size=40)
    line = (
        st.builds(signed, body)
        | st.binary(max_size=60)
        | st.builds(lambda v: json.dumps(v).encode() + b"\n", json_values)
    )
    return st.builds(lambda h, lines: h + b"".join(lines), header, st.lists(line, max_size=4))


def _checkpoint_bytes() -> st.SearchStrategy[bytes]:
    """Random bytes; damaged real checkpoints; and payloads that match their checksum but not the schema."""
    record = st.fixed_dictionaries(
        {
            "namespace": _maybe(st.just("ns")),
            "name": _maybe(st.just("c")),
            "phase": _maybe(st.sampled_from(["PrepareStarted", "PrepareCompleted", "Recovered"])),
            "attempt": _maybe(st.just("ab")),
            "devices": _maybe(st.lists(st.fixed_dictionaries({
                "request": _maybe(st.just("gpu")), "pool": _maybe(st.just(POOL)),
                "device": _maybe(_devices), "cdiDeviceIds": _maybe(st.lists(_text, max_size=2)),
            }, optional={"mig": json_values, "config": json_values}), max_size=2)),
        }
    )  # fmt: skip
    payload = st.fixed_dictionaries(
        {
            "bootId": _maybe(st.just("boot-a")),
            "generation": _maybe(st.integers(-2, 2**70)),
            "claims": _maybe(st.dictionaries(_text, _maybe(record), max_size=3)),
        }
    )

    def signed(value: Any, version: Any) -> bytes:
        digest = hashlib.sha256(canonical_json(value)).hexdigest()
        return json.dumps(
            {"schemaVersion": version, "checksum": f"sha256:{digest}", "payload": value}
        ).encode()

    def damaged(data: bytes, position: int, byte: int, cut: bool) -> bytes:
        if not data:
            return data
        position %= len(data)
        return data[:position] if cut else data[:position] + bytes([byte]) + data[position + 1 :]

    good = st.builds(lambda c: _snapshot(c, {}), st.integers(0, 9))
    return st.one_of(
        st.binary(max_size=200),
        st.builds(signed, payload, _maybe(st.just(2))),
        st.builds(damaged, good, st.integers(0, 10_000), st.integers(0, 255), st.booleans()),
        st.builds(lambda v: json.dumps(v).encode(), json_values),
    )
