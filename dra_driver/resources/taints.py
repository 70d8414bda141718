"""What a GPU's faults mean for the devices published from it. Pure.

A fault of a physical GPU concerns every device made of it: the full GPU ``gpu-<minor>``,
every MIG device on it and every MIG placement it offers. Two audiences are told:

* the **scheduler**, by taints on those devices in the ResourceSlice. A claim that does not
  tolerate a taint is not allocated the device (effect ``NoSchedule``), and pods already
  using it are evicted (``NoExecute``); ``None`` only informs. Keys are in the driver's
  domain, like NVIDIA's under ``gpu.nvidia.com``::

      <driver>/xid=<n>          one per critical Xid; NoSchedule, NoExecute for Xids that mean
                                the GPU is gone (79) -- both settings
      <driver>/gpu-lost         NVML cannot reach the GPU; NoExecute (a setting)
      <driver>/unmonitored      NVML offers no Xid events for the GPU; always None

  ``timeAdded`` is when the fault was first seen, so re-publishing the same faults writes
  the same slices (no churn, and ``tolerationSeconds`` count from the fault);
* the **kubelet**, through the health stream: such a device is Unhealthy (Unknown when its
  GPU is only unmonitored) with a message naming the faults.

When a GPU recovers its taints go, unless the policy keeps them (NVIDIA's driver never
removes them): then they stay until the plugin restarts, while the health stream reports
the truth.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum

from dra_driver.devices.faults import GPU_LOST_XIDS, Fault, FaultKind, NodeFaults, carry_over
from dra_driver.devices.types import Gpu, HealthState, Inventory
from dra_driver.resources.device_names import gpu_device_name, mig_device_name
from dra_driver.resources.wire import DeviceTaint

TAINTS_PER_DEVICE_MAX = 16  # API limit
HEALTH_MESSAGE_MAX = 1024  # the kubelet's limit


class TaintEffect(StrEnum):
    NONE = "None"
    NO_SCHEDULE = "NoSchedule"
    NO_EXECUTE = "NoExecute"


_SEVERITY = {TaintEffect.NONE: 0, TaintEffect.NO_SCHEDULE: 1, TaintEffect.NO_EXECUTE: 2}


@dataclass(frozen=True)
class TaintPolicy:
    """How faults become taints; every field is a setting of the daemon."""

    driver_name: str
    xid_effect: TaintEffect = TaintEffect.NO_SCHEDULE
    gpu_lost_effect: TaintEffect = TaintEffect.NO_EXECUTE
    gpu_lost_xids: frozenset[int] = frozenset(GPU_LOST_XIDS)  # Xids that mean the GPU is gone
    remove_on_recovery: bool = True

    def key(self, kind: FaultKind) -> str:
        return f"{self.driver_name}/{kind.value}"

    def effect(self, fault: Fault) -> TaintEffect:
        if fault.kind is FaultKind.UNMONITORED:
            return TaintEffect.NONE
        if fault.kind is FaultKind.GPU_LOST or fault.xid in self.gpu_lost_xids:
            return self.gpu_lost_effect
        return self.xid_effect


def gpu_devices(gpu: Gpu) -> list[str]:
    """Every device name that can be published for ``gpu``: itself and each MIG placement of it.

    A MIG device, static or made by the driver, is published under its placement's name, so
    this covers it too; names the pool does not hold at the moment are simply not used.
    """
    return [gpu_device_name(gpu.minor)] + [
        mig_device_name(gpu.minor, profile.name, profile.profile_id, placement.start)
        for profile in gpu.mig_profiles
        for placement in profile.placements
    ]


def gpu_taints(faults: Sequence[Fault], policy: TaintPolicy) -> list[DeviceTaint]:
    """The taints of a GPU with ``faults``: the most severe, then the newest, within the API's limit."""
    ranked = sorted(faults, key=lambda f: (_SEVERITY[policy.effect(f)], f.since), reverse=True)
    taints = [_taint(fault, policy) for fault in ranked[:TAINTS_PER_DEVICE_MAX]]
    return sorted(taints, key=lambda t: (t["key"], t.get("value", "")))


def device_taints(
    inventory: Inventory, faults: NodeFaults, policy: TaintPolicy
) -> dict[str, list[DeviceTaint]]:
    """The taints of every device of every faulty GPU, by device name.

    Faults of a GPU that is not in ``inventory`` (it went away) concern no device.
    """
    result: dict[str, list[DeviceTaint]] = {}
    for gpu in inventory.gpus:
        if gpu_faults := faults.get(gpu.uuid):
            taints = gpu_taints(gpu_faults, policy)
            result.update(dict.fromkeys(gpu_devices(gpu), taints))
    return result


def faults_to_taint(tainted: NodeFaults, current: NodeFaults, policy: TaintPolicy) -> NodeFaults:
    """The faults to publish taints for, given those published so far (``tainted``) and the current ones.

    With ``remove_on_recovery`` that is the current faults; without, a fault once tainted stays
    (with its first ``since``) after the GPU recovered.
    """
    if policy.remove_on_recovery:
        return current
    merged = {uuid: [*tainted.get(uuid, ()), *current.get(uuid, ())] for uuid in {*tainted, *current}}
    return carry_over(tainted, merged)


@dataclass(frozen=True)
class DeviceHealth:
    state: HealthState
    message: str = ""


def device_health(inventory: Inventory, faults: NodeFaults) -> dict[str, DeviceHealth]:
    """The health of every device of a faulty GPU, by device name, as the kubelet is told it.

    Devices not in the result are healthy.
    """
    result: dict[str, DeviceHealth] = {}
    for gpu in inventory.gpus:
        if gpu_faults := faults.get(gpu.uuid):
            health = gpu_health(gpu_faults)
            result.update(dict.fromkeys(gpu_devices(gpu), health))
    return result


def unknown_gpus(inventory: Inventory, faults: NodeFaults) -> list[str]:
    """The uuids of faulty GPUs that the inventory does not hold."""
    known = {gpu.uuid for gpu in inventory.gpus}
    return sorted(set(faults) - known)


def gpu_health(faults: Iterable[Fault]) -> DeviceHealth:
    """The health of every device of a GPU with ``faults`` (at least one)."""
    faults = list(faults)
    state = (
        HealthState.UNKNOWN
        if all(fault.kind is FaultKind.UNMONITORED for fault in faults)
        else HealthState.UNHEALTHY
    )
    message = "; ".join(f"{fault.describe()} since {_rfc3339(fault.since)}" for fault in faults)
    if len(message) > HEALTH_MESSAGE_MAX:
        message = message[: HEALTH_MESSAGE_MAX - 3] + "..."
    return DeviceHealth(state, message)


def _taint(fault: Fault, policy: TaintPolicy) -> DeviceTaint:
    taint: DeviceTaint = {"key": policy.key(fault.kind), "effect": policy.effect(fault).value}
    if fault.xid is not None:
        taint["value"] = str(fault.xid)
    taint["timeAdded"] = _rfc3339(fault.since)
    return taint


def _rfc3339(unix_seconds: int) -> str:
    return datetime.fromtimestamp(unix_seconds, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
