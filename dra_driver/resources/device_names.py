"""Names of published devices and counters, as NVIDIA's DRA driver spells them since v25.12.

Claims, DeviceTaintRules and allocation results refer to devices by name, so these names
are an API: they match NVIDIA's (``gpu-0``, ``gpu-0-mig-1g10gb-19-0``: its
``MigSpecTuple.ToCanonicalName``) so that what was written for that driver keeps working,
and they must not change between releases. NVIDIA's v25.8 and earlier spelt MIG devices
``gpu-<minor>-mig-<profile id>-<start>-<size>``; docs/nvidia-compatibility.md says so.
"""

from __future__ import annotations

import re

from dra_driver.names import DNS_LABEL_MAX_LENGTH, is_dns_label

_NOT_IN_LABEL = re.compile(r"[^a-z0-9-]")


def require_dns_label(name: str, what: str) -> str:
    """Return ``name`` if it is a DNS label, else raise ValueError naming ``what`` it is."""
    if not is_dns_label(name):
        raise ValueError(
            f"{what} {name!r} is not a valid DNS label (lower-case alphanumerics and '-', "
            f"starting and ending alphanumeric, at most {DNS_LABEL_MAX_LENGTH} characters); "
            "the API server would reject the ResourceSlice"
        )
    return name


def gpu_device_name(minor: int) -> str:
    """``gpu-<minor>``: the minor number is stable across reboots, unlike the NVML index."""
    return f"gpu-{minor}"


def maintenance_device_name(minor: int) -> str:
    """``gpu-<minor>-maintenance``: the GPU for admin access, outside its counters (not NVIDIA's)."""
    return f"gpu-{minor}-maintenance"


def mig_profile_label(profile: str) -> str:
    """``"1g.10gb+me"`` -> ``"1g10gb-me"``: dots dropped, anything else a label can't hold -> '-'."""
    return _NOT_IN_LABEL.sub("-", profile.lower().replace(".", "")).strip("-")


def mig_device_name(parent_minor: int, profile: str, profile_id: int, placement_start: int) -> str:
    """``gpu-<parent minor>-mig-<profile>-<profile id>-<placement start>``.

    The same name serves a placement offered for dynamic MIG and a MIG device that already
    exists there, so an allocated device keeps its name whichever way it is published.
    The profile id keeps names unique where two profiles map to the same label
    (``1g.24gb+me`` and ``1g.24gb-me``).
    """
    return f"gpu-{parent_minor}-mig-{mig_profile_label(profile)}-{profile_id}-{placement_start}"


PASSTHROUGH_PREFIX = "gpu-vfio-"


def passthrough_device_name(index: int) -> str:
    """``gpu-vfio-<index>``: NVIDIA's name of a GPU's passthrough device, by its place in PCI order."""
    return f"{PASSTHROUGH_PREFIX}{index}"


def counter_set_name(minor: int) -> str:
    """``gpu-<minor>-counter-set``: the counters one physical GPU's partitions share."""
    return f"gpu-{minor}-counter-set"


def memory_slice_counter(index: int) -> str:
    """``memory-slice-<index>``: one counter per MIG memory slice, so placements cannot overlap."""
    return f"memory-slice-{index}"
