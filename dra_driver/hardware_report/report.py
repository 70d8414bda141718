"""A read-only report of a GPU host as the NVML backend sees it, and its comparison with the catalog.

``hack/hardware-inventory.sh`` runs :func:`main` on a host with NVIDIA GPUs, and the JSON it
writes is the golden file of that hardware (``tests/devices/golden/``): the versions of the
driver, CUDA and NVML, and each GPU as the driver reads and publishes it -- its MIG mode
(current and pending), every GPU-instance profile with its possible placements, the MIG
devices that exist, and the ResourceSlice devices the driver would publish for it.

Nothing here changes a GPU. The NVML backend is opened ``read_only``: it reconciles no MIG
mode, destroys no orphaned instance, and refuses every change; the few reads beyond the
backend's own (the pending MIG mode, NVML's version, NVML's own profile names) are NVML
getters. No MIG mode is switched, nothing is reset, no instance is created or destroyed.

:func:`catalog_differences` compares one GPU of such a report with the catalog entry of its
product (``dra_driver/devices/data/gpu-catalog.yaml``) and with go-nvlib's profile naming, so
a golden file from real hardware shows at once where the catalog -- and so the simulator and
the names the driver publishes -- is wrong.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pynvml

from dra_driver.devices.backend import Backend, DeviceError
from dra_driver.devices.catalog import GpuModel, load_catalog
from dra_driver.devices.nvidia_names import mig_profile_name
from dra_driver.devices.nvml import NvmlBackend
from dra_driver.devices.types import Gpu, Inventory, MigProfile, Placement
from dra_driver.log import configure
from dra_driver.resources.devices import build_devices
from dra_driver.settings import LogFormat

SCHEMA_VERSION = 1


def _placements(placements: Sequence[Placement]) -> list[dict[str, int]]:
    return [{"start": p.start, "size": p.size} for p in placements]


def _profile(profile: MigProfile, nvml_name: str | None) -> dict[str, Any]:
    """A GPU-instance profile under the catalog's field names, so the two compare field by field."""
    return {
        "name": profile.name,
        "nvmlName": nvml_name,  # what NVML itself calls it; the driver publishes ``name``
        "nvmlProfile": profile.nvml_profile,
        "profileId": profile.profile_id,
        "sliceCount": profile.compute_slices,
        "instanceCount": profile.instance_count,
        "memorySizeMB": profile.memory_mib,
        "multiprocessorCount": profile.multiprocessors,
        "copyEngineCount": profile.copy_engines,
        "decoderCount": profile.decoders,
        "encoderCount": profile.encoders,
        "jpegCount": profile.jpeg_engines,
        "ofaCount": profile.ofa_engines,
        "placements": _placements(profile.placements),
    }


def _nvml_reads(gpu: Gpu) -> tuple[dict[str, str | None] | None, dict[int, str]]:
    """The GPU's MIG mode (current, pending) and NVML's own profile names; getters only."""
    try:
        handle = pynvml.nvmlDeviceGetHandleByUUID(gpu.uuid)
        current, pending = pynvml.nvmlDeviceGetMigMode(handle)
    except pynvml.NVMLError:
        return None, {}
    words = {pynvml.NVML_DEVICE_MIG_ENABLE: "enabled", pynvml.NVML_DEVICE_MIG_DISABLE: "disabled"}
    mode: dict[str, str | None] = {
        "current": words.get(current, str(current)),
        "pending": words.get(pending, str(pending)),
    }
    names = {}
    for profile in gpu.mig_profiles:
        try:
            info = pynvml.nvmlDeviceGetGpuInstanceProfileInfoV(handle, profile.nvml_profile)
        except pynvml.NVMLError:
            continue
        name = info.name
        names[profile.nvml_profile] = name.decode() if isinstance(name, bytes) else str(name)
    return mode, names


def gpu_report(gpu: Gpu, *, nvml: bool) -> dict[str, Any]:
    """One GPU; ``nvml`` adds the reads only NVML has (the simulator has no pending mode)."""
    mode, nvml_names = _nvml_reads(gpu) if nvml and gpu.mig_capable else (None, {})
    if mode is None and gpu.mig_capable:
        mode = {"current": "enabled" if gpu.mig_enabled else "disabled", "pending": None}
    return {
        "index": gpu.index,
        "minor": gpu.minor,
        "uuid": gpu.uuid,
        "productName": gpu.product_name,
        "brand": gpu.brand,
        "architecture": gpu.architecture,
        "cudaComputeCapability": "{}.{}".format(*gpu.cuda_compute_capability),
        "memoryBytes": gpu.memory_bytes,
        "memoryTotalMiB": gpu.memory_bytes // 2**20,
        "multiprocessorCount": gpu.multiprocessors,
        "pciDeviceId": f"{gpu.pci_device_id:#06x}",
        "pciVendorId": f"{gpu.pci_vendor_id:#06x}",
        "pciBusId": gpu.pci_bus_id,
        "pcieRoot": gpu.pcie_root,
        "pcieSwitch": gpu.pcie_switch,
        "numaNode": gpu.numa_node,
        "nvlinkRemotes": list(gpu.nvlink_remotes),  # the far end of each active NVLink
        "addressingMode": gpu.addressing_mode,
        "fabric": None
        if gpu.fabric is None
        else {
            "clusterUuid": gpu.fabric.cluster_uuid,
            "cliqueId": gpu.fabric.clique_id,
            "state": gpu.fabric.state.value,
            "status": gpu.fabric.status,
        },
        "migCapable": gpu.mig_capable,
        "migMode": mode,
        "migModeChangeRequiresReset": gpu.mig_mode_change_requires_reset,
        "memorySlices": gpu.memory_slices,
        "migProfiles": [_profile(p, nvml_names.get(p.nvml_profile)) for p in gpu.mig_profiles],
        "migDevices": [
            {
                "uuid": m.uuid,
                "profile": m.profile,
                "profileId": m.profile_id,
                "placement": {"start": m.placement.start, "size": m.placement.size},
                "gpuInstanceId": m.gpu_instance_id,
                "computeInstanceId": m.compute_instance_id,
            }
            for m in gpu.mig_devices
        ],
        "reservedPlacements": [
            {"profile": name, "start": p.start, "size": p.size} for name, p in gpu.reserved_placements
        ],
    }


def _nvml_version() -> str | None:
    try:
        version = pynvml.nvmlSystemGetNVMLVersion()
    except pynvml.NVMLError:
        return None
    return version.decode() if isinstance(version, bytes) else str(version)


def report(backend: Backend, inventory: Inventory) -> dict[str, Any]:
    """The whole host: versions, GPUs, and the devices the driver would publish for them."""
    nvml = isinstance(backend, NvmlBackend)
    published = [
        json.loads(json.dumps(device, default=str))
        for gpu in build_devices(inventory)
        for device in gpu.devices
    ]
    return {
        "schemaVersion": SCHEMA_VERSION,
        "source": "nvml" if nvml else "simulated",
        "readOnly": True,
        "kernel": os.uname().release,
        "versions": {
            "driver": inventory.driver_version,
            "cudaDriver": "{}.{}".format(*inventory.cuda_driver_version),
            "nvml": _nvml_version() if nvml else None,
            "nvidiaMlPy": importlib.metadata.version("nvidia-ml-py"),
        },
        "gpus": [gpu_report(gpu, nvml=nvml) for gpu in sorted(inventory.gpus, key=lambda g: g.index)],
        "publishedDevices": published,
    }


# --- comparison with the catalog ------------------------------------------------------------------

_GPU_FIELDS = (
    "productName",
    "brand",
    "architecture",
    "cudaComputeCapability",
    "memoryTotalMiB",
    "multiprocessorCount",
    "migCapable",
    "migModeChangeRequiresReset",
    "memorySlices",
    "addressingMode",
)


def _catalog_view(model: GpuModel) -> dict[str, Any]:
    """The catalog entry in the report's shape."""
    return {
        "productName": model.product_name,
        "brand": model.brand,
        "architecture": model.architecture,
        "cudaComputeCapability": "{}.{}".format(*model.cuda_compute_capability),
        "memoryTotalMiB": model.memory_mib,
        "multiprocessorCount": model.multiprocessors,
        "migCapable": model.mig_capable,
        "migModeChangeRequiresReset": model.mig_mode_change_requires_reset if model.mig_capable else None,
        "memorySlices": model.memory_slices,
        "addressingMode": model.addressing_mode,
        "migProfiles": {p.name: _profile(p, None) for p in model.mig_profiles},
    }


def catalog_model(gpu: dict[str, Any]) -> GpuModel | None:
    """The catalog entry of a reported GPU: same PCI device id, else same product name."""
    device_id = int(gpu["pciDeviceId"], 16)
    models = list(load_catalog().values())
    by_id = [m for m in models if m.pci_device_id == device_id]
    by_name = [m for m in by_id or models if m.product_name == gpu["productName"]]
    found = by_name or by_id
    return found[0] if len(found) == 1 else None


def catalog_differences(gpu: dict[str, Any]) -> list[str]:
    """Where one reported GPU and its catalog entry (and go-nvlib's naming) disagree; [] if nowhere."""
    model = catalog_model(gpu)
    if model is None:
        return [f"{gpu['productName']} ({gpu['pciDeviceId']}): no single catalog entry has this GPU"]
    where = f"{gpu['productName']} vs catalog {model.key}"
    expected = _catalog_view(model)
    differences = []
    for field in _GPU_FIELDS:
        if field == "migModeChangeRequiresReset" and not gpu["migCapable"]:
            continue
        if gpu[field] != expected[field]:
            differences.append(f"{where}: {field}: hardware {gpu[field]!r}, catalog {expected[field]!r}")
    profiles = {p["name"]: p for p in gpu["migProfiles"]}
    for name in sorted(profiles.keys() ^ expected["migProfiles"].keys()):
        side = "hardware" if name in profiles else "catalog"
        differences.append(f"{where}: profile {name} only in the {side}")
    for name in sorted(profiles.keys() & expected["migProfiles"].keys()):
        ours, theirs = profiles[name], expected["migProfiles"][name]
        for field in ours:
            if field != "nvmlName" and ours[field] != theirs[field]:
                differences.append(
                    f"{where}: profile {name}: {field}: hardware {ours[field]!r}, catalog {theirs[field]!r}"
                )
    for profile in gpu["migProfiles"]:  # the driver's names follow go-nvlib's formula, as NVIDIA's do
        formula = mig_profile_name(profile["nvmlProfile"], profile["memorySizeMB"], gpu["memoryBytes"])
        if profile["name"] != formula:
            differences.append(f"{where}: profile {profile['name']}: go-nvlib's formula names it {formula}")
    return differences


# --- the command -----------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dra_driver.hardware_report",
        description="Write a read-only JSON report of this host's GPUs as the NVML backend reads them.",
    )
    parser.add_argument("--driver-root", type=Path, default=Path("/"), help="where the NVIDIA driver is")
    parser.add_argument(
        "--dev-root",
        type=Path,
        default=None,
        help="where its /dev is (default: driver root if it holds dev/nvidiactl, else /)",
    )
    parser.add_argument("--procfs-root", type=Path, default=Path("/proc"))
    parser.add_argument("--sysfs-root", type=Path, default=Path("/sys"))
    parser.add_argument("--output", "-o", type=Path, default=None, help="the JSON file (default: stdout)")
    args = parser.parse_args(argv)
    configure(LogFormat.AUTO, "warning")  # to stderr: stdout may be the report
    dev_root = args.dev_root
    if dev_root is None:
        dev_root = args.driver_root if (args.driver_root / "dev" / "nvidiactl").exists() else Path("/")
    try:
        backend = NvmlBackend(
            sysfs_root=args.sysfs_root,
            procfs_root=args.procfs_root,
            dev_root=dev_root,
            driver_root=args.driver_root,
            read_only=True,
        )
        try:
            text = json.dumps(report(backend, backend.inventory()), indent=2) + "\n"
        finally:
            backend.close()
    except DeviceError as e:
        print(f"error: hardware report: {e}", file=sys.stderr)
        return 1
    if args.output is None:
        sys.stdout.write(text)
    else:
        args.output.write_text(text)
        print(f"wrote {args.output}", file=sys.stderr)
    return 0
