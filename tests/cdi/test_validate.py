"""Every loader rule, broken one at a time, is refused with the field that breaks it."""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from typing import Any

import pytest

from dra_driver.cdi.validate import InvalidSpecError, minimum_version, validate_spec, with_minimum_version

Spec = dict[str, Any]


def valid_spec() -> Spec:
    return {
        "cdiVersion": "0.5.0",
        "kind": "k8s.gpu.dra-driver.dev/claim",
        "devices": [
            {
                "name": "claim-gpu-0",
                "containerEdits": {
                    "env": ["DRA_GPU_UUID_GPU_0=GPU-1"],
                    "deviceNodes": [{"path": "/dev/nvidia0", "type": "c", "major": 195, "minor": 0}],
                },
            }
        ],
        "containerEdits": {
            "env": ["NVIDIA_VISIBLE_DEVICES=void"],
            "deviceNodes": [{"path": "/dev/nvidiactl", "hostPath": "/driver/dev/nvidiactl", "type": "c"}],
            "mounts": [
                {
                    "hostPath": "/driver/lib/libcuda.so.1",
                    "containerPath": "/lib/libcuda.so.1",
                    "options": ["ro"],
                }
            ],
            "hooks": [
                {
                    "hookName": "createContainer",
                    "path": "/usr/bin/nvidia-cdi-hook",
                    "args": ["nvidia-cdi-hook"],
                }
            ],
        },
    }


def device_edits(spec: Spec) -> dict[str, Any]:
    edits: dict[str, Any] = spec["devices"][0]["containerEdits"]
    return edits


def common(spec: Spec) -> dict[str, Any]:
    edits: dict[str, Any] = spec["containerEdits"]
    return edits


DEV = "devices[0].containerEdits"
Mutation = Callable[[Spec], object]

BROKEN_RULES: list[tuple[str, Mutation, str, str]] = [
    # (id, mutation, field, message fragment)
    ("unknown-top-field", lambda s: s.update(metadata={}), "metadata", "unknown field"),
    ("unknown-device-field", lambda s: s["devices"][0].update(id=1), "devices[0].id", "unknown field"),
    ("unknown-edits-field", lambda s: common(s).update(envs=[]), "containerEdits.envs", "unknown field"),
    (
        "unknown-node-field",
        lambda s: device_edits(s)["deviceNodes"][0].update(mode=1),
        f"{DEV}.deviceNodes[0].mode",
        "unknown field",
    ),
    (
        "unknown-mount-field",
        lambda s: common(s)["mounts"][0].update(readOnly=True),
        "containerEdits.mounts[0].readOnly",
        "unknown field",
    ),
    (
        "unknown-hook-field",
        lambda s: common(s)["hooks"][0].update(name="x"),
        "containerEdits.hooks[0].name",
        "unknown field",
    ),
    ("spec-not-object", lambda s: s.clear(), "cdiVersion", "is required"),
    ("missing-kind", lambda s: s.pop("kind"), "kind", "is required"),
    ("missing-devices", lambda s: s.pop("devices"), "devices", "is required"),
    ("no-devices", lambda s: s.update(devices=[]), "devices", "at least one device"),
    ("devices-not-array", lambda s: s.update(devices={}), "devices", "must be an array, not an object"),
    ("kind-without-class", lambda s: s.update(kind="nvidia.com"), "kind", "not of the form vendor/class"),
    (
        "vendor-starts-with-digit",
        lambda s: s.update(kind="1nvidia.com/gpu"),
        "kind",
        "vendor '1nvidia.com' must start with a letter",
    ),
    (
        "class-ends-with-dash",
        lambda s: s.update(kind="nvidia.com/gpu-"),
        "kind",
        "class 'gpu-' must start with a letter, end with",
    ),
    ("class-with-slash", lambda s: s.update(kind="nvidia.com/gpu/x"), "kind", "class 'gpu/x'"),
    ("kind-not-string", lambda s: s.update(kind=7), "kind", "must be a string, not a number"),
    (
        "name-starts-with-dash",
        lambda s: s["devices"][0].update(name="-gpu"),
        "devices[0].name",
        "'-gpu' must start and end",
    ),
    (
        "name-ends-with-colon",
        lambda s: s["devices"][0].update(name="gpu:"),
        "devices[0].name",
        "must start and end",
    ),
    ("name-with-slash", lambda s: s["devices"][0].update(name="a/b"), "devices[0].name", "'a/b'"),
    (
        "duplicate-name",
        lambda s: s["devices"].append(copy.deepcopy(s["devices"][0])),
        "devices[1].name",
        "defined more than once",
    ),
    (
        "missing-device-edits",
        lambda s: s["devices"][0].pop("containerEdits"),
        "devices[0].containerEdits",
        "is required",
    ),
    (
        "empty-device-edits",
        lambda s: s["devices"][0].update(containerEdits={"env": []}),
        DEV,
        "must edit the container",
    ),
    (
        "env-without-equals",
        lambda s: device_edits(s)["env"].append("GPU"),
        f"{DEV}.env[1]",
        "'GPU' is not of the form NAME=value",
    ),
    ("env-without-name", lambda s: common(s)["env"].append("=1"), "containerEdits.env[1]", "NAME=value"),
    ("env-not-string", lambda s: common(s)["env"].append(1), "containerEdits.env[1]", "must be a string"),
    ("env-null", lambda s: common(s).update(env=None), "containerEdits.env", "must be an array, not null"),
    (
        "node-type",
        lambda s: device_edits(s)["deviceNodes"][0].update(type="char"),
        f"{DEV}.deviceNodes[0].type",
        "'char' is not one of",
    ),
    (
        "node-permissions",
        lambda s: device_edits(s)["deviceNodes"][0].update(permissions="rwx"),
        f"{DEV}.deviceNodes[0].permissions",
        "only contain r, w and m",
    ),
    (
        "node-without-path",
        lambda s: device_edits(s)["deviceNodes"][0].pop("path"),
        f"{DEV}.deviceNodes[0].path",
        "needs a path",
    ),
    (
        "node-major-string",
        lambda s: device_edits(s)["deviceNodes"][0].update(major="195"),
        f"{DEV}.deviceNodes[0].major",
        "must be an integer, not a string",
    ),
    (
        "node-minor-bool",
        lambda s: device_edits(s)["deviceNodes"][0].update(minor=True),
        f"{DEV}.deviceNodes[0].minor",
        "must be an integer, not a boolean",
    ),
    (
        "node-uid-negative",
        lambda s: device_edits(s)["deviceNodes"][0].update(uid=-1),
        f"{DEV}.deviceNodes[0].uid",
        "-1 is outside 0..4294967295",
    ),
    (
        "hook-name",
        lambda s: common(s)["hooks"][0].update(hookName="preStart"),
        "containerEdits.hooks[0].hookName",
        "'preStart' is not one of",
    ),
    (
        "hook-without-path",
        lambda s: common(s)["hooks"][0].update(path=""),
        "containerEdits.hooks[0].path",
        "needs the path",
    ),
    (
        "hook-env",
        lambda s: common(s)["hooks"][0].update(env=["DEBUG"]),
        "containerEdits.hooks[0].env[0]",
        "NAME=value",
    ),
    (
        "hook-timeout-zero",
        lambda s: common(s)["hooks"][0].update(timeout=0),
        "containerEdits.hooks[0].timeout",
        "outside 1..",
    ),
    (
        "hook-args-not-strings",
        lambda s: common(s)["hooks"][0].update(args=["x", 2]),
        "containerEdits.hooks[0].args[1]",
        "must be a string",
    ),
    (
        "mount-without-target",
        lambda s: common(s)["mounts"][0].update(containerPath=""),
        "containerEdits.mounts[0].containerPath",
        "non-empty path",
    ),
    (
        "mount-options-string",
        lambda s: common(s)["mounts"][0].update(options="ro"),
        "containerEdits.mounts[0].options",
        "must be an array, not a string",
    ),
    (
        "edits-not-object",
        lambda s: s.update(containerEdits=[]),
        "containerEdits",
        "must be an object, not an array",
    ),
    ("unknown-version", lambda s: s.update(cdiVersion="0.9.0"), "cdiVersion", "unknown version '0.9.0'"),
    (
        "version-too-old-for-host-path",
        lambda s: s.update(cdiVersion="0.4.0"),
        "cdiVersion",
        "hostPath needs at least 0.5.0",
    ),
    (
        "version-too-old-for-annotations",
        lambda s: s.update(annotations={"a": "b"}),
        "cdiVersion",
        "annotations or a '.' in the kind's class needs at least 0.6.0",
    ),
    (
        "version-too-old-for-gids",
        lambda s: common(s).update(additionalGids=[44]),
        "cdiVersion",
        "needs at least 0.7.0",
    ),
    (
        "version-too-old-for-net-devices",
        lambda s: (
            s.update(cdiVersion="0.7.0")
            or common(s).update(netDevices=[{"hostInterfaceName": "eth1", "name": "net1"}])
        ),
        "cdiVersion",
        "needs at least 1.1.0",
    ),
    (
        "annotation-not-string",
        lambda s: s.update(cdiVersion="0.6.0", annotations={"a": 1}),
        "annotations.a",
        "must be a string",
    ),
    (
        "gid-negative",
        lambda s: s.update(cdiVersion="0.7.0") or common(s).update(additionalGids=[-5]),
        "containerEdits.additionalGids[0]",
        "outside 0..",
    ),
    (
        "duplicate-net-device",
        lambda s: (
            s.update(cdiVersion="1.1.0")
            or common(s).update(
                netDevices=[
                    {"hostInterfaceName": "eth1", "name": "a"},
                    {"hostInterfaceName": "eth1", "name": "b"},
                ]
            )
        ),
        "containerEdits.netDevices[1].hostInterfaceName",
        "'eth1' is used by another net device",
    ),
    (
        "net-device-without-name",
        lambda s: (
            s.update(cdiVersion="1.1.0") or common(s).update(netDevices=[{"hostInterfaceName": "eth1"}])
        ),
        "containerEdits.netDevices[0].name",
        "non-empty name",
    ),
    (
        "clos-id-dotdot",
        lambda s: s.update(cdiVersion="0.7.0") or common(s).update(intelRdt={"closID": ".."}),
        "containerEdits.intelRdt.closID",
        "not a valid resctrl group name",
    ),
    (
        "rdt-monitoring-not-bool",
        lambda s: s.update(cdiVersion="1.1.0") or common(s).update(intelRdt={"enableMonitoring": "yes"}),
        "containerEdits.intelRdt.enableMonitoring",
        "true or false",
    ),
]


@pytest.mark.parametrize(
    ("mutate", "field", "fragment"), [pytest.param(*case[1:], id=case[0]) for case in BROKEN_RULES]
)
def test_each_broken_rule_is_refused_naming_the_field(mutate: Mutation, field: str, fragment: str) -> None:
    spec = valid_spec()
    mutate(spec)
    with pytest.raises(InvalidSpecError, match=re.escape(fragment)) as refused:
        validate_spec(spec)
    assert refused.value.field == field
    assert str(refused.value).startswith(f"invalid CDI spec: {field}: ")


@pytest.mark.parametrize(
    ("mutate", "field", "fragment"),
    [pytest.param(*case[1:], id=case[0]) for case in BROKEN_RULES if case[2] != "cdiVersion"],
)
def test_a_spec_built_at_its_minimum_version_is_held_to_every_other_rule(
    mutate: Mutation, field: str, fragment: str
) -> None:
    # with_minimum_version checks a claim's spec once, at prepare: it derives the version, so the
    # version's floor cannot fail, and must still refuse everything else validate_spec refuses.
    spec = valid_spec()
    mutate(spec)
    del spec["cdiVersion"]
    with pytest.raises(InvalidSpecError, match=re.escape(fragment)) as refused:
        with_minimum_version(spec)
    assert refused.value.field == field


def test_a_spec_built_at_its_minimum_version_declares_it_and_passes_the_full_check() -> None:
    spec = valid_spec()
    del spec["cdiVersion"]
    built = with_minimum_version(spec)
    assert built["cdiVersion"] == minimum_version(spec)
    validate_spec(built)
    with pytest.raises(InvalidSpecError, match="derived from the content"):
        with_minimum_version(built)


def test_a_spec_that_is_not_an_object_is_refused() -> None:
    with pytest.raises(InvalidSpecError, match=r"spec: must be an object, not an array"):
        validate_spec([])  # type: ignore[arg-type]


ACCEPTED: list[tuple[str, Mutation]] = [
    ("baseline", lambda s: None),
    ("version-with-v", lambda s: s.update(cdiVersion="v0.5.0")),
    ("newer-version-than-needed", lambda s: s.update(cdiVersion="1.1.0")),
    ("no-cgroup-permissions", lambda s: device_edits(s)["deviceNodes"][0].update(permissions="none")),
    ("read-only-permissions", lambda s: device_edits(s)["deviceNodes"][0].update(permissions="r")),
    ("untyped-node", lambda s: device_edits(s)["deviceNodes"][0].update(type="")),
    ("env-value-with-equals", lambda s: device_edits(s)["env"].append("OPTS=a=b")),
    ("env-only-device", lambda s: s["devices"][0].update(containerEdits={"env": ["A=1"]})),
    ("no-spec-edits", lambda s: s.pop("containerEdits")),
    ("root-clos", lambda s: s.update(cdiVersion="0.7.0") or common(s).update(intelRdt={"closID": "/"})),
    (
        "every-hook-stage",
        lambda s: common(s).update(
            hooks=[
                {"hookName": n, "path": "/h"}
                for n in (
                    "prestart",
                    "createRuntime",
                    "createContainer",
                    "startContainer",
                    "poststart",
                    "poststop",
                )
            ]
        ),
    ),
]


@pytest.mark.parametrize("mutate", [pytest.param(m, id=i) for i, m in ACCEPTED])
def test_what_the_loader_accepts_is_accepted(mutate: Mutation) -> None:
    spec = valid_spec()
    mutate(spec)
    validate_spec(spec)


def _without_host_paths(spec: Spec) -> Spec:
    del common(spec)["deviceNodes"][0]["hostPath"]
    return spec


VERSION_FEATURES: list[tuple[str, Mutation, str]] = [
    ("base-format", lambda s: None, "0.3.0"),
    ("mount-type", lambda s: common(s)["mounts"][0].update(type="bind"), "0.4.0"),
    (
        "device-node-host-path",
        lambda s: device_edits(s)["deviceNodes"][0].update(hostPath="/h/dev/nvidia0"),
        "0.5.0",
    ),
    ("name-starting-with-digit", lambda s: s["devices"][0].update(name="0b1e-gpu-0"), "0.5.0"),
    ("spec-annotations", lambda s: s.update(annotations={"a": "b"}), "0.6.0"),
    ("device-annotations", lambda s: s["devices"][0].update(annotations={"a": "b"}), "0.6.0"),
    ("dotted-class", lambda s: s.update(kind="example.com/gpu.big"), "0.6.0"),
    ("additional-gids", lambda s: device_edits(s).update(additionalGids=[44]), "0.7.0"),
    ("intel-rdt", lambda s: common(s).update(intelRdt={"closID": "gold"}), "0.7.0"),
    ("rdt-schemata", lambda s: common(s).update(intelRdt={"schemata": []}), "1.1.0"),
    ("rdt-monitoring", lambda s: device_edits(s).update(intelRdt={"enableMonitoring": True}), "1.1.0"),
    (
        "net-devices",
        lambda s: device_edits(s).update(netDevices=[{"hostInterfaceName": "eth1", "name": "n"}]),
        "1.1.0",
    ),
]


@pytest.mark.parametrize(("mutate", "version"), [pytest.param(m, v, id=i) for i, m, v in VERSION_FEATURES])
def test_minimum_version_follows_the_newest_feature_used(mutate: Mutation, version: str) -> None:
    spec = _without_host_paths(valid_spec())
    mutate(spec)
    assert minimum_version(spec) == version
    spec["cdiVersion"] = version
    validate_spec(spec)
