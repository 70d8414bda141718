"""Which DRA feature gates and API versions to ask the control plane for.

A binary refuses to start when given a gate it does not know -- one newer than it, or one removed
some releases after going GA -- and warns about GA gates, which are locked on. Which gates are which
changes with every minor release, so they are not hard-coded per version: the flag turns on the
wanted gates that the binary's own --help lists as settable (alpha and beta; GA ones are on anyway).
On 1.37 that leaves the beta ones; on 1.34 it turns on the alpha ones, which is what lets the same
tests run against 1.34 - 1.37.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

# The DRA features the driver publishes or the tests exercise (see facts/resource-api.md).
WANTED_GATES = (
    "DRAAdminAccess",
    "DRAConsumableCapacity",
    "DRADeviceTaintRules",
    "DRADeviceTaints",
    "DRAExtendedResource",
    "DRAPartitionableDevices",
    "DRAPrioritizedList",
    "DRAResourceClaimDeviceStatus",
    "ResourceHealthStatus",  # the pods' allocatedResourcesStatus (kubelet and API server); beta in 1.36
)

# Lines such as "kube:DRAConsumableCapacity=true|false (BETA - default=true)", with or without the
# component prefix.
_SETTABLE_GATE = re.compile(r"(?:\bkube:|\s)([A-Z][A-Za-z0-9]+)=true\|false")


def settable_gates(binary: Path) -> frozenset[str]:
    """The feature gates `binary --help` lists (those it accepts in --feature-gates)."""
    result = subprocess.run([str(binary), "--help"], capture_output=True, text=True, check=False)
    return gates_in_help(result.stdout + result.stderr)


def gates_in_help(help_text: str) -> frozenset[str]:
    return frozenset(_SETTABLE_GATE.findall(help_text))


def feature_gates_flag(settable: frozenset[str]) -> str:
    """The --feature-gates value turning on every wanted gate that is settable."""
    return ",".join(f"{gate}=true" for gate in WANTED_GATES if gate in settable)


def kube_minor(kube_version: str) -> int:
    """The minor release of a Kubernetes version: "v1.36.3" -> 36."""
    return int(kube_version.removeprefix("v").split(".")[1])


def device_taint_rule_version(kube_version: str) -> str:
    """The resource.k8s.io version DeviceTaintRule is served in: v1alpha3 before 1.36, v1beta2 in 1.36,
    v1 from 1.37 (a manifest written for v1 needs its apiVersion changed on older releases)."""
    minor = kube_minor(kube_version)
    return "v1" if minor >= 37 else "v1beta2" if minor == 36 else "v1alpha3"


def runtime_config_flag(kube_version: str) -> str:
    """The --runtime-config value that serves resource.k8s.io/v1 (on by default) and the older versions
    clients may still use, plus the version DeviceTaintRule lives in (device_taint_rule_version)."""
    versions = ["v1beta1", "v1beta2"] + (["v1alpha3"] if kube_minor(kube_version) < 36 else [])
    return ",".join(f"resource.k8s.io/{version}=true" for version in versions)
