"""The GPU models a simulated node can be built from, read from the data shipped in the package.

The data file (``data/gpu-catalog.yaml``) is a trimmed copy of the project's
research catalog; it says where each value comes from. Profile names are not
trusted from the file: each one is recomputed with go-nvlib's formula and a
mismatch fails loading, so the simulator names profiles exactly as NVIDIA's
tools would on that hardware.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from types import MappingProxyType
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.alias_generators import to_camel

from dra_driver.devices.nvidia_names import (
    ARCHITECTURE_NAMES,
    BRAND_NAMES,
    PCI_VENDOR_NVIDIA,
    mig_profile_name,
    split_pci_device_id,
)
from dra_driver.devices.types import MigProfile, Placement


@dataclass(frozen=True)
class GpuModel:
    """One GPU product, as the hardware would describe itself through NVML."""

    key: str  # "h100-sxm5-80gb"
    product_name: str  # NVML name, "NVIDIA H100 80GB HBM3"
    brand: str  # as published, "Nvidia"
    architecture: str  # as published, "Hopper"
    cuda_compute_capability: tuple[int, int]
    memory_mib: int
    multiprocessors: int
    pci_device_id: int  # 0x2330
    pci_vendor_id: int  # 0x10de
    mig_capable: bool
    mig_mode_change_requires_reset: bool
    memory_slices: int  # 0 when not MIG-capable
    max_gpu_instances: int
    mig_profiles: tuple[MigProfile, ...]
    # NVML's addressing mode on coherent (Grace) systems: "ATS", "HMM" or "None"; None elsewhere.
    addressing_mode: str | None = None

    @property
    def memory_bytes(self) -> int:
        return self.memory_mib * 2**20

    def profile_by_id(self, profile_id: int) -> MigProfile | None:
        return next((p for p in self.mig_profiles if p.profile_id == profile_id), None)


# --- the file's schema (camelCase, unknown fields are errors) -------------------------------------


class _Doc(BaseModel):
    # Built when the catalog is first read (the GPUs' inventory), not when the settings import
    # the node profiles: the daemon's start to its kubelet sockets does not wait for them.
    model_config = ConfigDict(alias_generator=to_camel, extra="forbid", frozen=True, defer_build=True)


class _PlacementsDoc(_Doc):
    size: int = Field(gt=0)
    starts: tuple[int, ...]


class _ProfileDoc(_Doc):
    name: str
    nvml_profile: int
    profile_id: int
    slice_count: int
    instance_count: int
    memory_size_mb: int = Field(alias="memorySizeMB")
    multiprocessor_count: int
    copy_engine_count: int
    decoder_count: int
    encoder_count: int
    jpeg_count: int
    ofa_count: int
    placements: _PlacementsDoc


class _MigDoc(_Doc):
    memory_slices: int
    max_gpu_instances: int
    mig_mode_change_requires_reset: bool
    profiles: tuple[_ProfileDoc, ...]


class _GpuDoc(_Doc):
    key: str
    product_name: str
    brand: str
    architecture: str
    cuda_compute_capability: str
    memory_total_mi_b: int = Field(alias="memoryTotalMiB")
    addressing_mode: Literal["ATS", "HMM", "None"] | None = None
    multiprocessor_count: int
    pci_device_id: int
    mig_capable: bool
    mig: _MigDoc | None = None


class _CatalogDoc(_Doc):
    schema_version: int
    gpus: tuple[_GpuDoc, ...]


# --- conversion ------------------------------------------------------------------------------------


class CatalogError(ValueError):
    """The shipped catalog is inconsistent: a packaging bug, never a user error."""


def _mig_profile(gpu: _GpuDoc, mig: _MigDoc, doc: _ProfileDoc) -> MigProfile:
    where = f"{gpu.key} profile {doc.name!r}"
    expected = mig_profile_name(doc.nvml_profile, doc.memory_size_mb, gpu.memory_total_mi_b * 2**20)
    if doc.name != expected:
        raise CatalogError(f"{where}: go-nvlib's formula names it {expected!r}")
    placements = tuple(Placement(start, doc.placements.size) for start in doc.placements.starts)
    if any(p.start < 0 or p.start + p.size > mig.memory_slices for p in placements):
        raise CatalogError(f"{where}: a placement lies outside memory slices 0..{mig.memory_slices - 1}")
    return MigProfile(
        name=doc.name,
        profile_id=doc.profile_id,
        nvml_profile=doc.nvml_profile,
        compute_slices=doc.slice_count,
        instance_count=doc.instance_count,
        memory_mib=doc.memory_size_mb,
        multiprocessors=doc.multiprocessor_count,
        copy_engines=doc.copy_engine_count,
        decoders=doc.decoder_count,
        encoders=doc.encoder_count,
        jpeg_engines=doc.jpeg_count,
        ofa_engines=doc.ofa_count,
        placements=placements,
    )


def _gpu_model(doc: _GpuDoc) -> GpuModel:
    if doc.brand not in BRAND_NAMES.values():
        raise CatalogError(f"{doc.key}: brand {doc.brand!r} is not a name NVML's brands map to")
    if doc.architecture not in ARCHITECTURE_NAMES.values():
        raise CatalogError(f"{doc.key}: architecture {doc.architecture!r} is not an NVML architecture")
    if doc.mig_capable != (doc.mig is not None):
        raise CatalogError(f"{doc.key}: migCapable and the presence of a mig section disagree")
    major, _, minor = doc.cuda_compute_capability.partition(".")
    device_id, vendor_id = split_pci_device_id(doc.pci_device_id)
    if vendor_id != PCI_VENDOR_NVIDIA:
        raise CatalogError(f"{doc.key}: pciDeviceId {doc.pci_device_id:#x} is not an NVIDIA device")
    mig = doc.mig
    profiles = tuple(_mig_profile(doc, mig, p) for p in mig.profiles) if mig else ()
    if len({p.profile_id for p in profiles}) != len(profiles):
        raise CatalogError(f"{doc.key}: duplicate profile ids")
    return GpuModel(
        key=doc.key,
        product_name=doc.product_name,
        brand=doc.brand,
        architecture=doc.architecture,
        cuda_compute_capability=(int(major), int(minor)),
        memory_mib=doc.memory_total_mi_b,
        multiprocessors=doc.multiprocessor_count,
        pci_device_id=device_id,
        pci_vendor_id=vendor_id,
        mig_capable=doc.mig_capable,
        mig_mode_change_requires_reset=mig.mig_mode_change_requires_reset if mig else False,
        memory_slices=mig.memory_slices if mig else 0,
        max_gpu_instances=mig.max_gpu_instances if mig else 0,
        mig_profiles=profiles,
        addressing_mode=doc.addressing_mode,
    )


def parse_catalog(text: str) -> dict[str, GpuModel]:
    """Parse catalog YAML into models keyed by model key."""
    try:
        doc = _CatalogDoc.model_validate(yaml.safe_load(text))
    except ValidationError as e:
        raise CatalogError(f"GPU catalog does not match its schema: {e}") from e
    if doc.schema_version != 1:
        raise CatalogError(f"GPU catalog schemaVersion {doc.schema_version} is not supported (expected 1)")
    models = {m.key: m for m in map(_gpu_model, doc.gpus)}
    if len(models) != len(doc.gpus):
        raise CatalogError("GPU catalog has duplicate model keys")
    return models


@functools.cache
def load_catalog() -> Mapping[str, GpuModel]:
    """The catalog shipped with the package, parsed once per process."""
    text = resources.files("dra_driver.devices").joinpath("data/gpu-catalog.yaml").read_text()
    return MappingProxyType(parse_catalog(text))


def gpu_model(key: str) -> GpuModel:
    """The catalog model ``key``; the error lists the known keys."""
    catalog = load_catalog()
    try:
        return catalog[key]
    except KeyError:
        raise KeyError(f"no GPU model {key!r} in the catalog; known: {', '.join(sorted(catalog))}") from None
