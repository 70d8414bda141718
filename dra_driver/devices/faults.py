"""What can be wrong with a GPU: the faults that health sources report and taints are made from.

Apart from :mod:`dra_driver.devices.health` (which imports NVML and the simulator), so that the
settings and the slices' taints know the faults without loading either.

A fault is one of:

* a critical **Xid** the kernel driver reported for the GPU. Xids that NVIDIA documents as
  errors of the application, not of the device (13, 31, 43, 45, 68, 109 by default), are
  ignored: a CUDA program that faults must not take its GPU out of service;
* a **lost** GPU: NVML answers ``GPU_IS_LOST`` for it (fallen off the bus, or otherwise
  unreachable);
* an **unmonitored** GPU: NVML offers no Xid events for it, so its faults go unseen.

A fault keeps the time it was first seen (``since``) for as long as it lasts, so that what
is published from it does not change while nothing changes on the GPU.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

# NVIDIA's list of Xids caused by applications (bad memory accesses, exceptions, timeouts of the
# program's own work): the GPU itself is fine.
APPLICATION_XIDS = (13, 31, 43, 45, 68, 109)
# Xids after which the GPU is gone until it is reset: 79, "GPU has fallen off the bus".
GPU_LOST_XIDS = (79,)

# What the common Xids mean (NVIDIA's Xid catalog), for log lines and health messages.
XID_MEANINGS = {
    13: "graphics engine exception",
    31: "GPU memory page fault",
    43: "GPU stopped processing",
    45: "preemptive cleanup, due to previous errors",
    48: "double-bit ECC error",
    61: "internal micro-controller breakpoint",
    62: "internal micro-controller halt",
    63: "ECC page retirement or row remapping recording event",
    64: "ECC page retirement or row remapper recording failure",
    68: "video processor exception",
    69: "graphics engine class error",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    109: "context switch timeout",
    119: "GSP RPC timeout",
    120: "GSP error",
    140: "unrecovered ECC error",
}


class FaultKind(StrEnum):
    XID = "xid"
    GPU_LOST = "gpu-lost"
    UNMONITORED = "unmonitored"


@dataclass(frozen=True)
class Fault:
    """One thing wrong with a GPU."""

    kind: FaultKind
    since: int  # unix seconds when it was first seen; kept while the fault lasts
    xid: int | None = None  # FaultKind.XID only
    detail: str = ""  # where or why, e.g. "GPU instance 3"; for people, not for rules

    @property
    def identity(self) -> tuple[FaultKind, int | None]:
        """What makes two observations the same fault (one Xid seen twice is one fault)."""
        return (self.kind, self.xid)

    def describe(self) -> str:
        if self.kind is FaultKind.XID:
            meaning = XID_MEANINGS.get(self.xid or 0, "see NVIDIA's Xid catalog")
            text = f"Xid {self.xid} ({meaning})"
        elif self.kind is FaultKind.GPU_LOST:
            text = "GPU lost: NVML cannot reach it"
        else:
            text = "not monitored"
        return f"{text}: {self.detail}" if self.detail else text


NodeFaults = Mapping[str, tuple[Fault, ...]]
"""The faults of the node's GPUs by GPU uuid, oldest first; a healthy GPU has no entry."""


def carry_over(previous: NodeFaults, observed: Mapping[str, Sequence[Fault]]) -> dict[str, tuple[Fault, ...]]:
    """``observed``, where every fault that was already in ``previous`` keeps its first ``since``.

    A fault observed twice (the same Xid again) is kept once. GPUs without faults are dropped.
    """
    result: dict[str, tuple[Fault, ...]] = {}
    for uuid, faults in observed.items():
        known = {fault.identity: fault for fault in previous.get(uuid, ())}
        kept: dict[tuple[FaultKind, int | None], Fault] = {}
        for fault in faults:
            if fault.identity not in kept:
                kept[fault.identity] = known.get(fault.identity, fault)
        if kept:
            result[uuid] = tuple(sorted(kept.values(), key=lambda f: f.since))
    return result
