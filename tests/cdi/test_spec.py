"""The claim spec a container runtime reads, checked against golden files and the runtime's rules.

Regenerate the golden files after an intended change with
``UPDATE_GOLDEN=1 .venv/bin/pytest tests/cdi`` and review the diff.
"""

from __future__ import annotations

import json
import os
import re
import string
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dra_driver.cdi.spec import (
    CdiDevice,
    CommonEdits,
    Mount,
    cdi_device_id,
    cdi_kind,
    claim_spec,
    common_edits,
)
from dra_driver.cdi.store import SpecStore
from dra_driver.cdi.validate import validate_spec
from dra_driver.devices.driver_root import DriverFiles, HostFile
from dra_driver.devices.types import DeviceNode, Inventory

from .conftest import (
    CLAIM_UID,
    DRIVER,
    DRIVER_FILES,
    DRIVER_ROOT,
    GPU0,
    GPU1,
    HOOK,
    INVENTORY,
    LIB,
    MIG,
    SchemaChecker,
    full_gpu,
    mig_device,
)

GOLDEN = Path(__file__).parent / "golden"

CASES = {
    "one_gpu": [full_gpu(GPU0)],
    "two_gpus": [full_gpu(GPU0), full_gpu(GPU1)],
    "mig_device": [mig_device(GPU0, MIG)],
}


def container_env(spec: Mapping[str, Any], device_names: Sequence[str]) -> dict[str, str]:
    """The environment a runtime gives a container that gets these devices of the spec.

    The CDI rule: the spec-level edits once, then each device's edits in order; a
    later entry with the same NAME replaces the earlier one.
    """
    env: dict[str, str] = {}
    devices = {device["name"]: device for device in spec["devices"]}
    for entries in [spec["containerEdits"].get("env", [])] + [
        devices[name]["containerEdits"].get("env", []) for name in device_names
    ]:
        for entry in entries:
            name, _, value = entry.partition("=")
            env[name] = value
    return env


@pytest.mark.parametrize("case", CASES)
def test_spec_matches_golden_file(case: str, common: CommonEdits) -> None:
    text = json.dumps(claim_spec(DRIVER, CLAIM_UID, CASES[case], common), indent=2) + "\n"
    golden = GOLDEN / f"{case}.json"
    if os.environ.get("UPDATE_GOLDEN"):
        golden.parent.mkdir(exist_ok=True)
        golden.write_text(text)
    assert text == golden.read_text()


@pytest.mark.parametrize("case", CASES)
def test_spec_passes_the_published_schema_and_the_loader_rules(
    case: str, common: CommonEdits, schema: SchemaChecker
) -> None:
    spec = claim_spec(DRIVER, CLAIM_UID, CASES[case], common)
    assert schema.errors(spec) == []
    validate_spec(spec)


def test_each_device_is_reachable_by_the_id_handed_to_the_kubelet(common: CommonEdits) -> None:
    spec = claim_spec(DRIVER, CLAIM_UID, CASES["two_gpus"], common)
    assert [cdi_device_id(DRIVER, CLAIM_UID, device.name) for device in CASES["two_gpus"]] == [
        f"{spec['kind']}={device['name']}" for device in spec["devices"]
    ]
    assert cdi_device_id(DRIVER, CLAIM_UID, "gpu-1") == f"k8s.{DRIVER}/claim={CLAIM_UID}-gpu-1"
    assert cdi_kind(DRIVER) == "k8s.gpu.dra-driver.dev/claim"


def test_a_container_learns_exactly_the_gpus_it_got(common: CommonEdits) -> None:
    spec = claim_spec(DRIVER, CLAIM_UID, CASES["two_gpus"], common)
    gpu0, gpu1 = (f"{CLAIM_UID}-gpu-0", f"{CLAIM_UID}-gpu-1")

    both = container_env(spec, [gpu0, gpu1])
    assert both == {
        "NVIDIA_VISIBLE_DEVICES": "void",
        "DRA_GPU_UUID_GPU_0": GPU0.uuid,
        "DRA_GPU_UUID_GPU_1": GPU1.uuid,
    }
    # A container that names only the request that got gpu-1 sees only gpu-1.
    assert container_env(spec, [gpu1]) == {"NVIDIA_VISIBLE_DEVICES": "void", "DRA_GPU_UUID_GPU_1": GPU1.uuid}


def test_a_mig_device_brings_its_parent_node_and_both_capability_nodes(common: CommonEdits) -> None:
    spec = claim_spec(DRIVER, CLAIM_UID, CASES["mig_device"], common)
    (device,) = spec["devices"]
    assert device["name"] == f"{CLAIM_UID}-gpu-0-mig-3g40gb-9-0"
    assert device["containerEdits"]["deviceNodes"] == [
        {
            "path": "/dev/nvidia0",
            "hostPath": f"{DRIVER_ROOT}/dev/nvidia0",
            "type": "c",
            "major": 195,
            "minor": 0,
        },
        {"path": "/dev/nvidia-caps/nvidia-cap21", "type": "c", "major": 237, "minor": 21},
        {"path": "/dev/nvidia-caps/nvidia-cap22", "type": "c", "major": 237, "minor": 22},
    ]
    assert device["containerEdits"]["env"] == [f"DRA_GPU_UUID_GPU_0_MIG_3G40GB_9_0={MIG.uuid}"]


def test_driver_files_are_mounted_read_only_from_the_driver_root(common: CommonEdits) -> None:
    mounts = claim_spec(DRIVER, CLAIM_UID, CASES["one_gpu"], common)["containerEdits"]["mounts"]
    assert DRIVER_FILES.firmware is not None
    files = (*DRIVER_FILES.libraries, *DRIVER_FILES.binaries, DRIVER_FILES.firmware)
    assert [(m["hostPath"], m["containerPath"]) for m in mounts] == [
        (str(f.host_path), str(f.container_path)) for f in files
    ]
    assert all(m["hostPath"] == DRIVER_ROOT + m["containerPath"] for m in mounts)
    assert all(m["options"] == ["ro", "nosuid", "nodev", "rbind", "rprivate"] for m in mounts)


def test_hooks_make_the_mounted_libraries_loadable(common: CommonEdits) -> None:
    hooks = claim_spec(DRIVER, CLAIM_UID, CASES["one_gpu"], common)["containerEdits"]["hooks"]
    assert hooks == [
        {
            "hookName": "createContainer",
            "path": HOOK,
            "args": ["nvidia-cdi-hook", "create-symlinks", "--link", f"libcuda.so.1::{LIB}/libcuda.so"],
        },
        {
            "hookName": "createContainer",
            "path": HOOK,
            "args": ["nvidia-cdi-hook", "enable-cuda-compat", "--host-driver-version=580.95.05"],
        },
        {
            "hookName": "createContainer",
            "path": HOOK,
            "args": ["nvidia-cdi-hook", "update-ldcache", "--folder", LIB],
        },
        {
            "hookName": "createContainer",
            "path": HOOK,
            "args": ["nvidia-cdi-hook", "disable-device-node-modification"],
        },
    ]


def test_an_older_hook_runs_only_the_commands_it_has() -> None:
    edits = common_edits(
        INVENTORY, DRIVER_FILES, hook_path=HOOK, hook_commands=("create-symlinks", "update-ldcache")
    )
    assert [hook.args[1] for hook in edits.hooks] == ["create-symlinks", "update-ldcache"]


def test_no_hook_binary_means_no_hooks() -> None:
    edits = common_edits(INVENTORY, DRIVER_FILES)
    assert edits.hooks == ()
    assert "hooks" not in claim_spec(DRIVER, CLAIM_UID, CASES["one_gpu"], edits)["containerEdits"]


def test_without_driver_files_only_nodes_and_env_are_common() -> None:
    spec = claim_spec(DRIVER, CLAIM_UID, CASES["one_gpu"], common_edits(INVENTORY, None, hook_path=HOOK))
    assert spec["containerEdits"] == {
        "env": ["NVIDIA_VISIBLE_DEVICES=void"],
        "deviceNodes": [
            {
                "path": "/dev/nvidiactl",
                "hostPath": f"{DRIVER_ROOT}/dev/nvidiactl",
                "type": "c",
                "major": 195,
                "minor": 255,
            },
            {
                "path": "/dev/nvidia-modeset",
                "hostPath": f"{DRIVER_ROOT}/dev/nvidia-modeset",
                "type": "c",
                "major": 195,
                "minor": 254,
            },
            {"path": "/dev/nvidia-uvm", "type": "c", "major": 510, "minor": 0},
            {"path": "/dev/nvidia-uvm-tools", "type": "c", "major": 510, "minor": 1},
        ],
    }


@pytest.mark.parametrize(
    ("claim_uid", "host_path", "version"),
    [
        pytest.param("b1ef6d2c-7c3a-4f59-9d8e-5a4c2b1e9f30", None, "0.3.0", id="letter-uid-on-plain-host"),
        pytest.param("0b1ef6d2-7c3a-4f59-9d8e-5a4c2b1e9f30", None, "0.5.0", id="digit-uid"),
        pytest.param("b1ef6d2c-7c3a-4f59-9d8e-5a4c2b1e9f30", "/host/dev/nvidia0", "0.5.0", id="host-path"),
        pytest.param("b1ef6d2c-7c3a-4f59-9d8e-5a4c2b1e9f30", "/dev/nvidia0", "0.3.0", id="same-host-path"),
    ],
)
def test_spec_declares_the_oldest_version_its_content_needs(
    claim_uid: str, host_path: str | None, version: str
) -> None:
    device = CdiDevice("gpu-0", (DeviceNode("/dev/nvidia0", 195, 0, host_path=host_path),), uuid=GPU0.uuid)
    spec = claim_spec(DRIVER, claim_uid, [device], CommonEdits((), (), ()))
    assert spec["cdiVersion"] == version


def test_every_spec_built_from_the_nodes_common_edits_carries_their_version_and_checks() -> None:
    # The common edits are built and checked once per node and shared by the claims' specs: each
    # spec must still declare what they need and read back as valid, and a bad one still fails.
    control = DeviceNode("/dev/nvidiactl", 195, 255, host_path=f"{DRIVER_ROOT}/dev/nvidiactl")
    common = CommonEdits((control,), (), ())
    device = CdiDevice("gpu-0", (DeviceNode("/dev/nvidia0", 195, 0),), uuid=GPU0.uuid)
    for uid in ("b1ef6d2c-7c3a-4f59-9d8e-5a4c2b1e9f30", "c2ef6d2c-7c3a-4f59-9d8e-5a4c2b1e9f31"):
        spec = claim_spec(DRIVER, uid, [device], common)
        assert spec["cdiVersion"] == "0.5.0"  # the control node's hostPath
        validate_spec(json.loads(json.dumps(spec)))
    broken = CommonEdits((), (Mount("", "/usr/lib/libcuda.so.1"),), ())
    for _ in range(2):
        with pytest.raises(ValueError, match=r"containerEdits\.mounts\[0\]\.hostPath"):
            claim_spec(DRIVER, CLAIM_UID, [device], broken)


def test_devices_of_a_claim_may_share_a_variable_with_one_value() -> None:
    marker = (("DRA_ADMIN_ACCESS", "true"),)
    devices = [
        CdiDevice("gpu-0", (GPU0.device_node,), marker),
        CdiDevice("gpu-1", (GPU1.device_node,), marker),
    ]
    spec = claim_spec(DRIVER, CLAIM_UID, devices, CommonEdits((), (), ()))
    assert container_env(spec, [d["name"] for d in spec["devices"]])["DRA_ADMIN_ACCESS"] == "true"


@pytest.mark.parametrize(
    ("devices", "fragment"),
    [
        pytest.param([], "needs at least one device", id="no-devices"),
        pytest.param([full_gpu(GPU0), full_gpu(GPU0)], "'gpu-0' is listed twice", id="duplicate-device"),
        pytest.param(
            [CdiDevice("GPU_0", (GPU0.device_node,))], "'GPU_0' is not a DNS label", id="not-dns-label"
        ),
        pytest.param([CdiDevice("gpu-0", ())], "devices[0].containerEdits", id="nothing-to-inject"),
        pytest.param(
            [
                CdiDevice("gpu-0", (GPU0.device_node,), (("MODE", "a"),)),
                CdiDevice("gpu-1", (GPU1.device_node,), (("MODE", "b"),)),
            ],
            "device 'gpu-1' sets MODE='b' but device 'gpu-0' sets MODE='a'",
            id="conflicting-env",
        ),
        pytest.param(
            [CdiDevice("gpu-0", (GPU0.device_node,), (("NVIDIA_VISIBLE_DEVICES", "all"),))],
            "but the claim sets NVIDIA_VISIBLE_DEVICES='void'",
            id="overrides-void",
        ),
        pytest.param(
            [CdiDevice("gpu-0", (GPU0.device_node,), (("BAD=NAME", "x"),))],
            "'BAD=NAME' is not a variable name",
            id="bad-env-name",
        ),
    ],
)
def test_claim_spec_refuses_what_a_runtime_would_get_wrong(devices: list[CdiDevice], fragment: str) -> None:
    with pytest.raises(ValueError, match=re.escape(fragment)):
        claim_spec(DRIVER, CLAIM_UID, devices, CommonEdits((), (), ()))


@pytest.mark.parametrize(
    ("driver", "claim_uid", "device", "fragment"),
    [
        pytest.param("gpu_dra/x", CLAIM_UID, "gpu-0", "class 'x/claim'", id="slash-in-driver"),
        pytest.param(
            "gpu.dra-driver.dev-",
            CLAIM_UID,
            "gpu-0",
            "vendor 'k8s.gpu.dra-driver.dev-'",
            id="driver-ends-dash",
        ),
        pytest.param(DRIVER, "../x", "gpu-0", "claim UID '../x'", id="traversal-uid"),
        pytest.param(DRIVER, "", "gpu-0", "claim UID ''", id="empty-uid"),
        pytest.param(DRIVER, CLAIM_UID, "gpu:0", "'gpu:0' is not a DNS label", id="colon-device"),
    ],
)
def test_ids_are_refused_for_names_cdi_cannot_carry(
    driver: str, claim_uid: str, device: str, fragment: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(fragment)):
        cdi_device_id(driver, claim_uid, device)


def test_a_container_path_claimed_by_two_host_files_is_refused() -> None:
    target = PurePosixPath(f"{LIB}/libcuda.so.1")
    files = DriverFiles(
        root=PurePosixPath(DRIVER_ROOT),
        driver_version="580.95.05",
        libraries=(
            HostFile(PurePosixPath("/a/libcuda.so.1"), target),
            HostFile(PurePosixPath("/b/libcuda.so.1"), target),
        ),
        binaries=(),
        firmware=None,
    )
    with pytest.raises(ValueError, match=re.escape(f"would both be mounted at {LIB}/libcuda.so.1")):
        common_edits(INVENTORY, files)


# Names from Kubernetes look like the first alternative; the others probe the edges.
_NAME_CHARS = string.ascii_letters + string.digits + "-_.:/ =\n\u00e9"
claim_uids = st.one_of(st.uuids().map(str), st.text(_NAME_CHARS, max_size=300))
device_names = st.one_of(
    st.from_regex(r"gpu-[0-9]{1,2}(-mig-[1-7]g[0-9]{1,3}gb-[0-9]{1,2}-[0-7])?", fullmatch=True),
    st.text(_NAME_CHARS, max_size=70),
)


@given(claim_uid=claim_uids, names=st.lists(device_names, max_size=3))
def test_any_names_give_a_valid_spec_file_or_a_clear_refusal(
    claim_uid: str, names: list[str], schema: SchemaChecker
) -> None:
    devices = [CdiDevice(name, (GPU0.device_node,), uuid=GPU0.uuid) for name in names]
    with tempfile.TemporaryDirectory() as directory:
        store = SpecStore(Path(directory), DRIVER)
        try:
            path = store.write(claim_uid, claim_spec(DRIVER, claim_uid, devices, CommonEdits((), (), ())))
        except ValueError as refusal:
            assert list(Path(directory).iterdir()) == []
            # The refusal names what was wrong: the claim UID, a device name, or the missing devices.
            message = str(refusal)
            assert any(repr(text) in message for text in (claim_uid, *names)) or (
                not names and "needs at least one device" in message
            )
            return
        assert list(Path(directory).iterdir()) == [path]
        written = json.loads(path.read_text())
        validate_spec(written)
        assert schema.errors(written) == []
        assert [d["name"] for d in written["devices"]] == [f"{claim_uid}-{name}" for name in names]


def test_the_hook_adds_nvidias_glx_and_optical_flow_links() -> None:
    version = "580.95.05"
    libraries = tuple(
        HostFile(PurePosixPath(f"{DRIVER_ROOT}{LIB}/{name}"), PurePosixPath(f"{LIB}/{name}"))
        for name in (
            f"libcuda.so.{version}",
            f"libGLX_nvidia.so.{version}",
            f"libnvidia-opticalflow.so.{version}",
        )
    )
    files = DriverFiles(PurePosixPath(DRIVER_ROOT), version, libraries, (), None)
    inventory = Inventory(gpus=(), driver_version=version, cuda_driver_version=(13, 0))
    (links, _compat, ldcache, _nodes) = common_edits(inventory, files, hook_path=HOOK).hooks
    assert links.args == (
        "nvidia-cdi-hook",
        "create-symlinks",
        "--link",
        f"libcuda.so.1::{LIB}/libcuda.so",
        "--link",
        f"libGLX_nvidia.so.{version}::{LIB}/libGLX_indirect.so.0",
        "--link",
        f"libnvidia-opticalflow.so.1::{LIB}/libnvidia-opticalflow.so",
    )
    assert ldcache.args == ("nvidia-cdi-hook", "update-ldcache", "--folder", LIB)
