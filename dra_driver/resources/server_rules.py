"""What differs in the resource.k8s.io/v1 API between the Kubernetes releases the driver supports.

The driver writes one API version, v1 (served from 1.34), yet a few rules of it changed after 1.34:

- **Counters.** Before 1.35 (``DRAPartitionableDevices`` alpha) a device consumes counters only from
  the counter sets of its own ResourceSlice, and a slice may hold at most 32 counters over all its
  sets. From 1.35 counter sets live in slices of their own and devices of other slices of the pool
  consume them. So on 1.34 each partitioned GPU gets one slice holding its counter set beside its
  full GPU and MIG devices (:func:`dra_driver.resources.slices.split_pool`).
- **Taint effect None** (a taint that only informs) is valid from 1.35; 1.34 knows only NoSchedule
  and NoExecute and refuses the whole slice otherwise.
- **Binding conditions** (``DRADeviceBindingConditions``) are alpha, off by default, in 1.34 and 1.35
  and beta, on by default, from 1.36: only there does ``--binding-conditions=auto`` publish them
  (:mod:`dra_driver.node.binding`). An API server whose gate is off drops the fields silently.

The release comes from the API server's ``/version``; one the driver cannot read counts as the
newest, whose rules are the default everywhere.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_VERSION = re.compile(r"v?(\d+)\.(\d+)")
_RELEASE = re.compile(r"v?1\.\d+(\.\d+)?(-[0-9A-Za-z.]+)?")  # what a user names: v1.34, 1.35.2


@dataclass(frozen=True)
class ServerRules:
    """The API rules of one Kubernetes release that change what the driver writes."""

    counters_beside_devices: bool = False  # before 1.35: counter sets in the devices' own slice
    taint_effect_none: bool = True  # from 1.35
    binding_conditions: bool = True  # DRADeviceBindingConditions on by default: from 1.36


NEWEST = ServerRules()


def rules_of_release(release: str) -> ServerRules:
    """The rules of a release as a user names it ("v1.34", "1.35.2"); ValueError for anything else."""
    if not _RELEASE.fullmatch(release.strip()):
        raise ValueError(f"{release!r} is not a Kubernetes release such as v1.34 or 1.35.2")
    return rules_for(release.strip())


def rules_for(git_version: str) -> ServerRules:
    """The rules of the release a ``/version`` gitVersion names ("v1.34.4", "v1.35.0-rc.1");
    anything that does not look like a 1.x release gets the newest rules."""
    match = _VERSION.match(git_version.strip())
    if match is None or match[1] != "1":
        return NEWEST
    minor = int(match[2])
    return ServerRules(
        counters_beside_devices=minor < 35, taint_effect_none=minor >= 35, binding_conditions=minor >= 36
    )
