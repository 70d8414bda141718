"""The node labels NVIDIA's GPU feature discovery (GFD) sets, computed from an inventory.

Pods of the device-plugin era pick GPU nodes with ``nodeSelector`` and affinity on GFD's
labels (``nvidia.com/gpu.product=NVIDIA-H100-80GB-HBM3``). This reproduces GFD's names and
value formats (k8s-device-plugin, ``internal/lm``) with its ``mig-strategy=mixed``:

* ``nvidia.com/gpu.present=true`` (set on GPU nodes by the GPU operator's NFD rule);
* ``nvidia.com/gpu.{product,count,memory,replicas,sharing-strategy,family,compute.major,
  compute.minor}`` for the node's GPUs (count: all of them, MIG mode or not; memory in MiB;
  product sanitised as GFD does: characters other than ``A-Za-z0-9-_.`` dropped, blanks to '-');
* ``nvidia.com/gpu.machine``: the sanitised DMI product name, ``unknown`` without one;
* ``nvidia.com/mig.capable``, ``nvidia.com/mig.strategy=mixed``, ``nvidia.com/mps.capable=false``;
* ``nvidia.com/cuda.driver.*``, ``cuda.runtime.*``, ``cuda.driver-version.*``,
  ``cuda.runtime-version.*``: the driver and CUDA versions;
* per MIG profile with existing MIG devices (``+`` spelt ``.``: ``mig-1g.10gb.me``),
  ``nvidia.com/mig-<profile>.{count,product,memory,
  multiprocessors,slices.gi,slices.ci,engines.copy,engines.decoder,engines.encoder,engines.jpeg,
  engines.ofa,replicas,sharing-strategy}``.

Not set: ``nvidia.com/gfd.timestamp`` (it would rewrite the node every period for nothing),
``nvidia.com/gpu.mode`` (the PCI class is not in the inventory) and the IMEX/clique labels.
GPUs NVML has lost are not counted, as GFD would not see them; a node without GPUs gets no
labels at all. Every key is under ``nvidia.com/``, the only prefix the labeller may touch.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from typing import Final

from dra_driver.devices.types import Gpu, Inventory, MigProfile

PREFIX: Final = "nvidia.com/"
_NOT_KEPT = re.compile(r"[^A-Za-z0-9\-_. ]")
_FAMILIES = {1: "tesla", 2: "fermi", 3: "kepler", 5: "maxwell", 6: "pascal", 9: "hopper", 10: "blackwell"}
_FAMILIES |= {12: "blackwell", 13: "rubin"}


def sanitise(text: str) -> str:
    """GFD's ``sanitise``: drop what a label value cannot hold, join the words with '-'."""
    return "-".join(_NOT_KEPT.sub("", text).split())


def family(major: int, minor: int) -> str:
    """GFD's ``getArchFamily``: the architecture family of a CUDA compute capability."""
    if major == 7:
        return "volta" if minor < 5 else "turing"
    if major == 8:
        return "ampere" if minor < 9 else "ada-lovelace"
    return _FAMILIES.get(major, "undefined")


def gfd_labels(
    inventory: Inventory, *, lost: Collection[str] = (), machine: str | None = None
) -> dict[str, str]:
    """The labels GFD would set on this node; ``lost`` are uuids of GPUs NVML cannot reach."""
    gpus = [gpu for gpu in inventory.gpus if gpu.uuid not in lost]
    if not gpus:
        return {}
    labels = {f"{PREFIX}gpu.present": "true", f"{PREFIX}gpu.machine": sanitise(machine or "") or "unknown"}
    labels |= _versions(inventory)
    labels[f"{PREFIX}mig.capable"] = str(any(gpu.mig_capable for gpu in gpus)).lower()
    labels[f"{PREFIX}mig.strategy"] = "mixed"
    labels[f"{PREFIX}mps.capable"] = "false"
    # GFD labels from one GPU of the node (the last full GPU it sees wins); counts all of them.
    full = [gpu for gpu in gpus if not gpu.mig_enabled]
    representative = (full or gpus)[-1]
    labels |= _resource_labels(
        "gpu",
        count=len(gpus),
        product=sanitise(representative.product_name),
        memory_mib=representative.memory_bytes // 2**20,
        replicas=1 if full else 0,
    )
    major, minor = representative.cuda_compute_capability
    labels |= {
        f"{PREFIX}gpu.family": family(major, minor),
        f"{PREFIX}gpu.compute.major": str(major),
        f"{PREFIX}gpu.compute.minor": str(minor),
    }
    for gpu, profile, count in _mig_profiles(gpus).values():
        labels |= _mig_labels(gpu, profile, count)
    return labels


def _versions(inventory: Inventory) -> dict[str, str]:
    parts = inventory.driver_version.split(".")
    major, minor = parts[0], parts[1] if len(parts) > 1 else "0"
    revision = parts[2] if len(parts) > 2 else ""
    cuda_major, cuda_minor = (str(v) for v in inventory.cuda_driver_version)
    return {
        f"{PREFIX}cuda.driver.major": major,
        f"{PREFIX}cuda.driver.minor": minor,
        f"{PREFIX}cuda.driver.rev": revision,
        f"{PREFIX}cuda.runtime.major": cuda_major,
        f"{PREFIX}cuda.runtime.minor": cuda_minor,
        f"{PREFIX}cuda.driver-version.major": major,
        f"{PREFIX}cuda.driver-version.minor": minor,
        f"{PREFIX}cuda.driver-version.revision": revision,
        f"{PREFIX}cuda.driver-version.full": inventory.driver_version,
        f"{PREFIX}cuda.runtime-version.major": cuda_major,
        f"{PREFIX}cuda.runtime-version.minor": cuda_minor,
        f"{PREFIX}cuda.runtime-version.full": f"{cuda_major}.{cuda_minor}",
    }


def _resource_labels(
    resource: str, *, count: int, product: str, memory_mib: int, replicas: int
) -> dict[str, str]:
    key = f"{PREFIX}{resource}"
    return {
        f"{key}.count": str(count),
        f"{key}.product": product,
        f"{key}.memory": str(memory_mib),
        f"{key}.replicas": str(replicas),
        f"{key}.sharing-strategy": "none",
    }


def mig_resource_name(profile: str) -> str:
    """The device plugin's name of a MIG profile: ``1g.10gb+me`` -> ``1g.10gb.me`` (``+`` is not
    allowed in label keys or resource names); ``nvidia.com/mig-<this>`` in both."""
    return profile.replace("+", ".")


def _mig_profiles(gpus: list[Gpu]) -> dict[str, tuple[Gpu, MigProfile, int]]:
    """Existing MIG devices by profile name: (the first parent seen, the profile, how many)."""
    found: dict[str, tuple[Gpu, MigProfile, int]] = {}
    for gpu in gpus:
        for mig in gpu.mig_devices:
            profile = gpu.profile(mig.profile)
            if profile is None:
                continue
            parent, _, count = found.get(mig.profile, (gpu, profile, 0))
            found[mig.profile] = (parent, profile, count + 1)
    return found


def _mig_labels(gpu: Gpu, profile: MigProfile, count: int) -> dict[str, str]:
    name = mig_resource_name(profile.name)
    resource = f"mig-{name}"
    labels = _resource_labels(
        resource,
        count=count,
        product="-".join((sanitise(gpu.product_name), "MIG", sanitise(name))),
        memory_mib=profile.memory_mib,
        replicas=1,
    )
    key = f"{PREFIX}{resource}"
    return labels | {
        f"{key}.multiprocessors": str(profile.multiprocessors),
        f"{key}.slices.gi": str(profile.compute_slices),
        f"{key}.slices.ci": str(profile.compute_slices),  # one compute instance over the whole GI
        f"{key}.engines.copy": str(profile.copy_engines),
        f"{key}.engines.decoder": str(profile.decoders),
        f"{key}.engines.encoder": str(profile.encoders),
        f"{key}.engines.jpeg": str(profile.jpeg_engines),
        f"{key}.engines.ofa": str(profile.ofa_engines),
    }
