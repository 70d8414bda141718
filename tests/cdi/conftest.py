"""A node whose NVIDIA driver lives under a driver root, as with the GPU operator."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from typing import Any

import jsonschema
import pytest
import referencing
import referencing.jsonschema

from dra_driver.cdi.spec import CdiDevice, CommonEdits, common_edits
from dra_driver.devices.driver_root import DriverFiles, HostFile
from dra_driver.devices.types import DeviceNode, Gpu, Inventory, MigDevice, Placement

DRIVER = "gpu.dra-driver.dev"
DRIVER_ROOT = "/run/nvidia/driver"
CLAIM_UID = "0b1ef6d2-7c3a-4f59-9d8e-5a4c2b1e9f30"
HOOK = f"{DRIVER_ROOT}/usr/bin/nvidia-cdi-hook"
LIB = "/usr/lib/x86_64-linux-gnu"

# The published CDI schema, vendored beside these tests (schema/SOURCE.md says from where);
# CDI_SCHEMA_DIR points elsewhere.
_VENDORED_SCHEMA = Path(__file__).resolve().parent / "schema"
SCHEMA_DIR = Path(os.environ.get("CDI_SCHEMA_DIR", str(_VENDORED_SCHEMA)))


def _rooted(path: str) -> HostFile:
    return HostFile(host_path=PurePosixPath(f"{DRIVER_ROOT}{path}"), container_path=PurePosixPath(path))


def _gpu(minor: int, uuid: str, mig_devices: tuple[MigDevice, ...] = ()) -> Gpu:
    return Gpu(
        uuid=uuid,
        minor=minor,
        index=minor,
        product_name="NVIDIA H100 80GB HBM3",
        brand="Nvidia",
        architecture="Hopper",
        cuda_compute_capability=(9, 0),
        memory_bytes=80 * 2**30,
        multiprocessors=132,
        pci_bus_id=f"0000:{0x3B + minor:02x}:00.0",
        pci_device_id=0x2330,
        pci_vendor_id=0x10DE,
        device_node=DeviceNode(
            f"/dev/nvidia{minor}", 195, minor, host_path=f"{DRIVER_ROOT}/dev/nvidia{minor}"
        ),
        mig_capable=True,
        mig_enabled=bool(mig_devices),
        mig_devices=mig_devices,
    )


MIG = MigDevice(
    uuid="MIG-5b1c7f7e-2a83-5d3e-9c41-0d6f3e8a2b17",
    parent_uuid="GPU-8a3f1c52-6e0b-4d7a-b9c3-1f2e4d5a6b7c",
    profile="3g.40gb",
    profile_id=9,
    placement=Placement(0, 4),
    gpu_instance_id=2,
    compute_instance_id=0,
    # /proc/driver/nvidia/capabilities/gpu0/mig/gi2/access and .../gi2/ci0/access
    cap_nodes=(
        DeviceNode("/dev/nvidia-caps/nvidia-cap21", 237, 21),
        DeviceNode("/dev/nvidia-caps/nvidia-cap22", 237, 22),
    ),
)
GPU0 = _gpu(0, "GPU-8a3f1c52-6e0b-4d7a-b9c3-1f2e4d5a6b7c", (MIG,))
GPU1 = _gpu(1, "GPU-2d7e9b41-0c5f-4a86-8e13-7b9d2c4f6a80")

INVENTORY = Inventory(
    gpus=(GPU0, GPU1),
    driver_version="580.95.05",
    cuda_driver_version=(13, 0),
    control_nodes=(
        DeviceNode("/dev/nvidiactl", 195, 255, host_path=f"{DRIVER_ROOT}/dev/nvidiactl"),
        DeviceNode("/dev/nvidia-modeset", 195, 254, host_path=f"{DRIVER_ROOT}/dev/nvidia-modeset"),
        DeviceNode("/dev/nvidia-uvm", 510, 0),
        DeviceNode("/dev/nvidia-uvm-tools", 510, 1),
    ),
)

DRIVER_FILES = DriverFiles(
    root=PurePosixPath(DRIVER_ROOT),
    driver_version="580.95.05",
    libraries=(
        _rooted(f"{LIB}/libcuda.so.580.95.05"),
        _rooted(f"{LIB}/libnvidia-ml.so.580.95.05"),
        _rooted(f"{LIB}/libnvidia-ptxjitcompiler.so.580.95.05"),
    ),
    binaries=(_rooted("/usr/bin/nvidia-smi"),),
    firmware=_rooted("/lib/firmware/nvidia/580.95.05"),
)


def full_gpu(gpu: Gpu) -> CdiDevice:
    return CdiDevice(name=f"gpu-{gpu.minor}", device_nodes=(gpu.device_node,), uuid=gpu.uuid)


def mig_device(parent: Gpu, mig: MigDevice) -> CdiDevice:
    name = f"gpu-{parent.minor}-mig-{mig.profile.replace('.', '')}-{mig.profile_id}-{mig.placement.start}"
    return CdiDevice(name=name, device_nodes=(parent.device_node, *mig.cap_nodes), uuid=mig.uuid)


@pytest.fixture
def common() -> CommonEdits:
    return common_edits(INVENTORY, DRIVER_FILES, hook_path=HOOK)


class SchemaChecker:
    """The published CDI JSON schema (draft 7), with defs.json registered as its authors refer to it."""

    def __init__(self, directory: Path) -> None:
        if not directory.is_dir():
            raise FileNotFoundError(f"CDI schema not found in {directory}; set CDI_SCHEMA_DIR")
        defs = json.loads((directory / "defs.json").read_text())
        schema = json.loads((directory / "schema.json").read_text())
        registry: referencing.Registry[Any] = referencing.Registry().with_resource(
            "defs.json", referencing.Resource.from_contents(defs, referencing.jsonschema.DRAFT7)
        )
        self._validator = jsonschema.Draft7Validator(schema, registry=registry)

    def errors(self, spec: Mapping[str, Any]) -> list[str]:
        return [
            f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in self._validator.iter_errors(spec)
        ]


@pytest.fixture(scope="session")
def schema() -> SchemaChecker:
    return SchemaChecker(SCHEMA_DIR)
