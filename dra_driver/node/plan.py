"""What preparing a claim means on this node: a pure function of the claim and the inventory.

:func:`plan_claim` resolves every allocated device name to the hardware behind it,
decides each device's effective opaque config, and computes the claim's CDI spec. It
touches nothing, so everything that can be wrong with a claim is found before the
first side effect; the preparer then only records and writes what the plan says.

What the sharing settings do. They are validated (also against the device, e.g. an
MPS memory limit larger than the device), recorded in the checkpoint, and announced
to the container, per device, as environment variables::

    DRA_GPU_SHARING_STRATEGY_<DEVICE>=Exclusive|TimeSlicing|MPS
    DRA_GPU_TIME_SLICE_INTERVAL_<DEVICE>=Default|Short|Medium|Long       (TimeSlicing, full GPUs)
    DRA_GPU_MPS_ACTIVE_THREAD_PERCENTAGE_<DEVICE>=<1-100>               (MPS, when set)
    DRA_GPU_MPS_PINNED_DEVICE_MEMORY_LIMIT_<DEVICE>=<bytes>             (MPS, when set)

(``<DEVICE>`` as in the CDI spec's ``DRA_GPU_UUID_<DEVICE>``: ``gpu-0`` -> ``GPU_0``;
per device, because a container may hold devices with different settings.) The
driver does not change the GPU: it sets no compute mode and no time slice
(``nvidia-smi compute-policy``), and starts no MPS control daemon, so nothing here
enforces sharing. An MPS server run by the workload or an administrator can take
its client limits from these variables (``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``,
``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dra_driver.cdi.spec import (
    UUID_ENV_PREFIX,
    CdiDevice,
    CommonEdits,
    cdi_device_id,
    claim_spec,
    uuid_env_name,
)
from dra_driver.devices.types import DeviceNode, Gpu, Inventory, MigDevice
from dra_driver.node.claims import AllocatedClaim, AllocationResult, ClaimRejected
from dra_driver.node.config import (
    DEFAULT_GPU_CONFIG,
    DEFAULT_MIG_CONFIG,
    ConfigError,
    DeviceConfig,
    GpuConfig,
    GpuSharing,
    MigDeviceConfig,
    MigSharing,
    decode_config,
    effective_config,
    quantity_bytes,
)
from dra_driver.resources.naming import gpu_device_name, mig_device_name


@dataclass(frozen=True)
class Target:
    """The hardware an allocated device name stands for: a full GPU, or an existing MIG device on it."""

    gpu: Gpu
    mig: MigDevice | None = None

    @property
    def uuid(self) -> str:
        return self.mig.uuid if self.mig else self.gpu.uuid

    @property
    def memory_bytes(self) -> int:
        if self.mig is None:
            return self.gpu.memory_bytes
        profile = self.gpu.profile(self.mig.profile)
        return profile.memory_bytes if profile else self.gpu.memory_bytes

    @property
    def device_nodes(self) -> tuple[DeviceNode, ...]:
        return (self.gpu.device_node, *(self.mig.cap_nodes if self.mig else ()))


@dataclass(frozen=True)
class PlannedDevice:
    result: AllocationResult
    target: Target
    config: DeviceConfig  # the effective config; the default when none applies
    cdi_device_id: str


@dataclass(frozen=True)
class ClaimPlan:
    claim: AllocatedClaim
    devices: tuple[PlannedDevice, ...]  # one per allocation result of ours, in allocation order
    cdi_spec: dict[str, Any]


def plan_claim(
    claim: AllocatedClaim, inventory: Inventory, driver_name: str, common: CommonEdits
) -> ClaimPlan:
    """Everything preparing ``claim`` means; :class:`ClaimRejected` if any of it is impossible."""
    targets = {result: _resolve(result.device, inventory) for result in claim.results}
    try:
        decoded = [(entry, decode_config(entry)) for entry in claim.configs]
    except ConfigError as error:
        raise ClaimRejected(str(error)) from None
    gpu_results = [r for r in claim.results if targets[r].mig is None]
    mig_results = [r for r in claim.results if targets[r].mig is not None]
    configs: dict[AllocationResult, DeviceConfig] = {
        **effective_config(gpu_results, [(e, c) for e, c in decoded if isinstance(c, GpuConfig)]),
        **effective_config(mig_results, [(e, c) for e, c in decoded if isinstance(c, MigDeviceConfig)]),
    }
    devices = tuple(
        PlannedDevice(
            result=result,
            target=targets[result],
            config=configs.get(result, DEFAULT_MIG_CONFIG if targets[result].mig else DEFAULT_GPU_CONFIG),
            cdi_device_id=cdi_device_id(driver_name, claim.ref.uid, result.device),
        )
        for result in claim.results
    )
    for device in devices:
        _check_fits(device)
    # Two results naming one device (shares of one device) need only one CDI device.
    cdi_devices = list(dict.fromkeys(_cdi_device(device) for device in devices))
    try:
        spec = claim_spec(driver_name, claim.ref.uid, cdi_devices, common)
    except ValueError as error:
        raise ClaimRejected(f"cannot build the CDI spec for claim {claim.ref}: {error}") from None
    return ClaimPlan(claim=claim, devices=devices, cdi_spec=spec)


def _resolve(device: str, inventory: Inventory) -> Target:
    for gpu in inventory.gpus:
        if device == gpu_device_name(gpu.minor):
            if gpu.mig_enabled:
                raise ClaimRejected(
                    f"device {device} is in MIG mode and cannot be used whole; "
                    "the claim was allocated from a stale ResourceSlice and needs a new allocation"
                )
            return Target(gpu)
        for mig in gpu.mig_devices:
            if device == mig_device_name(gpu.minor, mig.profile, mig.profile_id, mig.placement.start):
                return Target(gpu, mig)
        for profile in gpu.mig_profiles:
            for placement in profile.placements:
                if device == mig_device_name(gpu.minor, profile.name, profile.profile_id, placement.start):
                    raise ClaimRejected(
                        f"device {device} is a MIG placement that would have to be created; this driver "
                        "version prepares full GPUs and existing MIG devices only"
                    )
    known = ", ".join(gpu_device_name(gpu.minor) for gpu in inventory.gpus) or "none"
    raise ClaimRejected(
        f"device {device} does not exist on this node (GPUs: {known}); the claim was allocated from a "
        "stale ResourceSlice: delete the pod so the claim is allocated again"
    )


def _check_fits(device: PlannedDevice) -> None:
    mps = device.config.sharing.mps
    limit = mps.default_pinned_device_memory_limit if mps else None
    if limit is not None and quantity_bytes(limit) > device.target.memory_bytes:
        raise ClaimRejected(
            f"device {device.result.device}: sharing.mps.defaultPinnedDeviceMemoryLimit {limit} exceeds "
            f"the device's memory ({device.target.memory_bytes // 2**20} MiB)"
        )


def _cdi_device(device: PlannedDevice) -> CdiDevice:
    return CdiDevice(
        name=device.result.device,
        device_nodes=device.target.device_nodes,
        env=sharing_env(device.result.device, device.config.sharing),
        uuid=device.target.uuid,
    )


def sharing_env(device: str, sharing: GpuSharing | MigSharing) -> tuple[tuple[str, str], ...]:
    """The variables announcing ``device``'s sharing settings (see the module doc)."""
    suffix = uuid_env_name(device).removeprefix(UUID_ENV_PREFIX)  # the same <DEVICE> as the UUID variable
    env: list[tuple[str, str]] = [(f"DRA_GPU_SHARING_STRATEGY_{suffix}", sharing.strategy)]
    if isinstance(sharing, GpuSharing) and sharing.strategy == "TimeSlicing":
        interval = sharing.time_slicing.interval if sharing.time_slicing else "Default"
        env.append((f"DRA_GPU_TIME_SLICE_INTERVAL_{suffix}", interval))
    if sharing.mps is not None:
        if sharing.mps.default_active_thread_percentage is not None:
            percentage = str(sharing.mps.default_active_thread_percentage)
            env.append((f"DRA_GPU_MPS_ACTIVE_THREAD_PERCENTAGE_{suffix}", percentage))
        if sharing.mps.default_pinned_device_memory_limit is not None:
            limit = str(quantity_bytes(sharing.mps.default_pinned_device_memory_limit))
            env.append((f"DRA_GPU_MPS_PINNED_DEVICE_MEMORY_LIMIT_{suffix}", limit))
    return tuple(env)
