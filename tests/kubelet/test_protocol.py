"""Our generated protocol code: it loads in one process, matches the kubelet's wire names, and is fresh."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from google.protobuf.descriptor import FieldDescriptor

REPO = Path(__file__).resolve().parents[2]
PB_MODULES = [
    f"dra_driver.kubelet.pb.{name}"
    for name in (
        "dra.v1.dra_pb2",
        "dra.v1.dra_pb2_grpc",
        "dra.v1beta1.dra_pb2",
        "dra.v1beta1.dra_pb2_grpc",
        "pluginregistration.registration_pb2",
        "pluginregistration.registration_pb2_grpc",
        "health.v1alpha1.health_pb2",
        "health.v1alpha1.health_pb2_grpc",
        "health.v1.health_pb2",
        "health.v1.health_pb2_grpc",
    )
]

DRA_MESSAGES = {
    "Claim": {"namespace": 1, "uid": 2, "name": 3},
    "NodePrepareResourcesRequest": {"claims": 1},
    "NodePrepareResourcesResponse": {"claims": 1},
    "NodePrepareResourceResponse": {"devices": 1, "error": 2},
    "Device": {"request_names": 1, "pool_name": 2, "device_name": 3, "cdi_device_ids": 4},
    "NodeUnprepareResourcesRequest": {"claims": 1},
    "NodeUnprepareResourcesResponse": {"claims": 1},
    "NodeUnprepareResourceResponse": {"error": 1},
}
HEALTH_MESSAGES = {
    "NodeWatchResourcesRequest": {},
    "NodeWatchResourcesResponse": {"devices": 1},
    "DeviceIdentifier": {"pool_name": 1, "device_name": 2},
    "DeviceHealth": {
        "device": 1,
        "health": 2,
        "last_updated_time": 3,
        "health_check_timeout_seconds": 4,
        "message": 5,
    },
}
REGISTRATION_MESSAGES = {
    "InfoRequest": {},
    "PluginInfo": {"type": 1, "name": 2, "endpoint": 3, "supported_versions": 4},
    "RegistrationStatus": {"plugin_registered": 1, "error": 2},
    "RegistrationStatusResponse": {},
}


def _pb2(module: str) -> ModuleType:
    return importlib.import_module(f"dra_driver.kubelet.pb.{module}")


def _fields(descriptor: Any) -> dict[str, int]:
    return {f.name: f.number for f in descriptor.fields}


def test_all_generated_modules_load_into_one_process() -> None:
    modules = [importlib.import_module(name) for name in PB_MODULES]
    packages = {m.DESCRIPTOR.package for m in modules if hasattr(m, "DESCRIPTOR")}
    assert packages == {
        "k8s.io.kubelet.pkg.apis.dra.v1",
        "k8s.io.kubelet.pkg.apis.dra.v1beta1",
        "pluginregistration",
        "v1alpha1",
        "v1",
    }


@pytest.mark.parametrize(
    ("module", "package", "service", "methods", "messages"),
    [
        (
            "dra.v1.dra_pb2",
            "k8s.io.kubelet.pkg.apis.dra.v1",
            "DRAPlugin",
            {"NodePrepareResources", "NodeUnprepareResources"},
            {**DRA_MESSAGES, "Device": {**DRA_MESSAGES["Device"], "share_id": 5}},
        ),
        (
            "dra.v1beta1.dra_pb2",
            "k8s.io.kubelet.pkg.apis.dra.v1beta1",
            "DRAPlugin",
            {"NodePrepareResources", "NodeUnprepareResources"},
            DRA_MESSAGES,
        ),
        (
            "pluginregistration.registration_pb2",
            "pluginregistration",
            "Registration",
            {"GetInfo", "NotifyRegistrationStatus"},
            REGISTRATION_MESSAGES,
        ),
        (
            "health.v1alpha1.health_pb2",
            "v1alpha1",
            "DRAResourceHealth",
            {"NodeWatchResources"},
            HEALTH_MESSAGES,
        ),
        ("health.v1.health_pb2", "v1", "DRAResourceHealth", {"NodeWatchResources"}, HEALTH_MESSAGES),
    ],
)
def test_names_and_field_numbers_are_the_kubelets(
    module: str, package: str, service: str, methods: set[str], messages: dict[str, dict[str, int]]
) -> None:
    file = _pb2(module).DESCRIPTOR
    assert file.package == package
    assert set(file.services_by_name) == {service}
    assert set(file.services_by_name[service].methods_by_name) == methods
    assert {name: _fields(d) for name, d in file.message_types_by_name.items()} == messages


def test_the_v1_share_id_is_optional_and_maps_are_keyed_by_string() -> None:
    v1 = _pb2("dra.v1.dra_pb2").DESCRIPTOR
    assert v1.message_types_by_name["Device"].fields_by_name["share_id"].has_presence
    claims = v1.message_types_by_name["NodePrepareResourcesResponse"].fields_by_name["claims"]
    assert claims.message_type.GetOptions().map_entry
    assert claims.message_type.fields_by_name["key"].type == FieldDescriptor.TYPE_STRING


@pytest.mark.parametrize("module", ["health.v1alpha1.health_pb2", "health.v1.health_pb2"])
def test_health_status_values_are_the_kubelets(module: str) -> None:
    status = _pb2(module).DESCRIPTOR.enum_types_by_name["HealthStatus"]
    assert {v.name: v.number for v in status.values} == {"UNKNOWN": 0, "HEALTHY": 1, "UNHEALTHY": 2}


def test_the_streaming_method_streams_responses_only() -> None:
    for module in ("health.v1alpha1.health_pb2", "health.v1.health_pb2"):
        service = _pb2(module).DESCRIPTOR.services_by_name["DRAResourceHealth"]
        method = service.methods_by_name["NodeWatchResources"]
        assert (method.client_streaming, method.server_streaming) == (False, True)


def test_the_committed_code_is_what_hack_gen_proto_generates() -> None:
    result = subprocess.run(
        [REPO / "hack" / "gen-proto.sh", "--check"],
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
