"""The launcher's decisions that need no running cluster: which gates and API versions to ask for,
and the state file that `cluster down` reads back."""

from __future__ import annotations

from pathlib import Path

import pytest

from e2e.cluster import ClusterInfo, Ports
from e2e.cluster.features import feature_gates_flag, gates_in_help, runtime_config_flag
from e2e.cluster.processes import ProcessRecord

# Abridged `kube-apiserver --help` of 1.37, and the unprefixed form component-base prints (here with
# the alpha gates a 1.34 binary would list).
HELP_1_37 = """
      --feature-gates colonSeparatedMultimapStringString   Comma-separated list ... Options are:
            kube:DRAConsumableCapacity=true|false (BETA - default=true)
            kube:DRAPartitionableDevices=true|false (BETA - default=true)
            kube:DRAWorkloadResourceClaims=true|false (BETA - default=false)
      --runtime-config mapStringString                     A set of key=value pairs ...
"""
HELP_UNPREFIXED = """
      --feature-gates colonSeparatedMultimapStringString   A set of key=value pairs ... Options are:
            DRAAdminAccess=true|false (BETA - default=true)
            DRADeviceTaints=true|false (ALPHA - default=false)
            DRAPartitionableDevices=true|false (ALPHA - default=false)
            DRAPrioritizedList=true|false (BETA - default=true)
"""


def test_only_settable_wanted_gates_are_turned_on_in_1_37() -> None:
    # GA gates (DRADeviceTaints, DRAAdminAccess, ...) are absent from --help: they are on, and passing
    # them would break start-up once a later release removes them.
    assert (
        feature_gates_flag(gates_in_help(HELP_1_37))
        == "DRAConsumableCapacity=true,DRAPartitionableDevices=true"
    )


def test_alpha_gates_listed_without_a_component_prefix_are_turned_on_too() -> None:
    assert feature_gates_flag(gates_in_help(HELP_UNPREFIXED)) == (
        "DRAAdminAccess=true,DRADeviceTaints=true,DRAPartitionableDevices=true,DRAPrioritizedList=true"
    )


@pytest.mark.parametrize(
    ("version", "expected"),
    [
        ("v1.37.2", "resource.k8s.io/v1beta1=true,resource.k8s.io/v1beta2=true"),
        ("v1.36.3", "resource.k8s.io/v1beta1=true,resource.k8s.io/v1beta2=true"),
        (
            "v1.35.4",
            "resource.k8s.io/v1beta1=true,resource.k8s.io/v1beta2=true,resource.k8s.io/v1alpha3=true",
        ),
    ],
)
def test_runtime_config_serves_the_version_device_taint_rules_live_in(version: str, expected: str) -> None:
    assert runtime_config_flag(version) == expected


def test_state_file_round_trips() -> None:
    info = ClusterInfo(
        kube_version="v1.37.2",
        server="https://127.0.0.1:6443",
        kubeconfig=Path("/out/kubeconfig"),
        admin_token="secret",
        ca_file=Path("/out/cluster/apiserver-certs/apiserver.crt"),
        base_dir=Path("/out/cluster"),
        ports=Ports(etcd_client=1, etcd_peer=2, apiserver=6443, scheduler=3, controller_manager=4),
        processes=(
            ProcessRecord(name="etcd", pid=42, start_time=1234, log=Path("/out/cluster/logs/etcd.log")),
        ),
    )

    assert ClusterInfo.from_json(info.to_json()) == info
