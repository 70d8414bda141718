"""The NVML backend: the node's real GPUs, read and partitioned through pynvml (nvidia-ml-py).

Every method blocks -- NVML is a C library and some calls take long -- so callers
on the event loop use ``asyncio.to_thread``; NVML itself is thread-safe.

Nothing here resets a GPU. MIG mode is switched only on GPUs that switch it
without a reset (Hopper and newer): on, when a MIG device is created on a GPU
whose mode is off; off again, when the last MIG device is destroyed -- but only
where this driver switched it on (recorded in its state directory, so a restart
remembers): MIG mode an administrator enabled stays. MIG mode survives a reboot
and MIG instances do not, so at start-up a GPU the driver had switched on and
that holds no instance any more is switched back off. On Ampere the mode is the
administrator's business and an error says so.

NVML's own failures are contained per GPU: a GPU that fails to answer is left
out of the inventory with a log line, the others are published. Optional reads
(MIG mode, core counts, profiles) treat FunctionNotFound, what an older driver
answers for a call it lacks, like NotSupported. Every public method runs NVML
on the process's one NVML executor and gives up after ``call_timeout`` seconds
(:mod:`dra_driver.devices.nvml_calls`), so an NVML call that hangs fails one
operation with a clear error instead of hanging the daemon. A GPU
instance that a failed creation's rollback could not destroy is remembered
(:class:`~dra_driver.devices.types.OrphanedGpuInstance`; the node keeps them in its store and
hands them back at start), kept off the published devices, and destroyed at the next inventory
read, or when handed back, once NVML answers.

Profile names come from go-nvlib's formula (:func:`mig_profile_name`), never
from the name NVML reports in its v2 profile struct: NVIDIA's DRA driver and
device plugin publish the formula's names, and some drivers' own names differ
(an A100-80GB "3g.39gb" in NVIDIA/mig-parted#31), which would break claims
written against NVIDIA's driver.
"""

from __future__ import annotations

import ctypes
import json
import os
import stat
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pynvml
import structlog

from dra_driver.devices.backend import DeviceError, DeviceInUseError, PlacementUnavailableError
from dra_driver.devices.catalog import load_catalog
from dra_driver.devices.driver_root import LIBRARY_DIRS, find_in
from dra_driver.devices.fabric import fabric_from_nvml
from dra_driver.devices.nvcaps import caps_major, ensure_node, read_capability
from dra_driver.devices.nvidia_names import (
    ARCHITECTURE_HOPPER,
    GPU_INSTANCE_PROFILE_COUNT,
    architecture_name,
    brand_name,
    mig_profile_name,
    normalize_pci_bus_id,
    split_pci_device_id,
)
from dra_driver.devices.nvml_calls import NvmlCalls
from dra_driver.devices.nvml_policy import NvmlComputePolicy
from dra_driver.devices.pci import PciBus, Write
from dra_driver.devices.topology import NVSWITCH_WITHOUT_ADDRESS
from dra_driver.devices.types import (
    ComputePolicy,
    DeviceNode,
    FabricInfo,
    Gpu,
    Inventory,
    MigDevice,
    MigProfile,
    Placement,
)
from dra_driver.devices.types import OrphanedGpuInstance as Orphan

log = structlog.get_logger(__name__)

NVIDIA_MAJOR = 195  # fixed by the kernel module for /dev/nvidia<minor>
CONTROL_DEVICES = ("nvidiactl", "nvidia-modeset", "nvidia-uvm", "nvidia-uvm-tools")

# CUDA cores per multiprocessor by compute capability (the CUDA samples' table): NVML
# reports cores, not multiprocessors, for a full GPU.
_CORES_PER_MULTIPROCESSOR = {
    (7, 0): 64,
    (7, 2): 64,
    (7, 5): 64,
    (8, 0): 64,
    (8, 6): 128,
    (8, 7): 128,
    (8, 9): 128,
    (9, 0): 128,
    (10, 0): 128,
    (10, 3): 128,
    (12, 0): 128,
}

# NVML_COMPUTE_INSTANCE_PROFILE_<n>_SLICE by slice count: the compute instance that spans its GPU instance.
_COMPUTE_INSTANCE_PROFILE_BY_SLICES = {1: 0x0, 2: 0x1, 3: 0x2, 4: 0x3, 7: 0x4, 8: 0x5, 6: 0x6}


# Reads a GPU may not offer: NotSupported, or FunctionNotFound from a driver that predates the call.
_ABSENT = (pynvml.NVMLError_NotSupported, pynvml.NVMLError_FunctionNotFound)
# The file in the state directory naming the GPUs whose MIG mode this driver switched on.
MIG_MODE_FILE = "nvml-mig-mode.json"
DEFAULT_CALL_TIMEOUT = 60.0
_ROLLBACK_ATTEMPTS = 3


@dataclass(frozen=True)
class _MigHandle:
    uuid: str
    gpu_instance_id: int
    compute_instance_id: int


def _nvml_error(e: Exception, action: str) -> DeviceError:
    """An NVML failure as the error type the driver acts on, with what to do next."""
    if isinstance(e, pynvml.NVMLError_InUse):
        return DeviceInUseError(f"{action}: the GPU is in use ({e}); retry once its processes have stopped")
    if isinstance(e, pynvml.NVMLError_InsufficientResources):
        return PlacementUnavailableError(
            f"{action}: the memory slices are taken by a live MIG instance, or the profile's instance "
            f"limit is reached ({e})"
        )
    if isinstance(e, pynvml.NVMLError_NoPermission):
        return DeviceError(f"{action}: {e}; the plugin must run privileged to manage MIG devices")
    if isinstance(e, pynvml.NVMLError_GpuIsLost):
        return DeviceError(f"{action}: the GPU is lost ({e}); drain the node and reset or replace the GPU")
    return DeviceError(f"{action}: {e}")


class NvmlBackend:
    """The node's GPUs as NVML reports them.

    ``sysfs_root``, ``procfs_root`` and ``dev_root`` are where the host's ``/sys``,
    ``/proc`` and ``/dev`` are visible to the plugin (``/`` in a privileged pod
    with host mounts; ``dev_root`` is the driver root when a driver container
    creates the device nodes there). ``read_only`` makes a backend that only reads: it
    reconciles no MIG mode, destroys no orphan and refuses every change (the hardware
    report of ``hack/hardware-inventory.sh``). ``pci_write`` is how passthrough's writes into
    sysfs reach the kernel: plain file writes on a node; where ``sysfs_root`` is a tree of files
    (the tests, on the mock NVML), the stand-in for the kernel that acts on them
    (:class:`~dra_driver.simulated.sysfs.SimulatedKernel`).
    """

    def __init__(
        self,
        *,
        sysfs_root: Path = Path("/sys"),
        procfs_root: Path = Path("/proc"),
        dev_root: Path = Path("/"),
        driver_root: Path | None = None,
        state_dir: Path | None = None,
        call_timeout: float = DEFAULT_CALL_TIMEOUT,
        read_only: bool = False,
        pci_write: Write | None = None,
    ) -> None:
        self._read_only = read_only
        self._sysfs_root = sysfs_root
        self._pci_write = pci_write
        self._procfs_root = procfs_root
        self._dev_root = dev_root
        self._nvml = NvmlCalls(call_timeout)
        self._mig_mode_file = state_dir / MIG_MODE_FILE if state_dir is not None else None
        self._known_gpus: dict[int, str] = {}
        self._last_read: dict[int, Gpu] = {}  # by NVML index, from the last inventory
        self._owned_in_memory: set[str] = set()  # without a state directory
        self._mig_mode_switches = 0
        # GPU instances failed rollbacks left (the node remembers them in its store). NVML work runs
        # in several worker threads at once, hence the lock.
        self._orphans: set[Orphan] = set()
        self._orphans_lock = threading.Lock()
        library = _preload_nvml(driver_root) if driver_root is not None else None
        self._policy = NvmlComputePolicy(driver_root or Path("/"), library, state_dir)
        try:
            self._nvml.run("starting NVML", pynvml.nvmlInit)
        except pynvml.NVMLError as e:
            if driver_root is not None and library is None:
                where = (
                    f"{NVML_SONAME} is not under driver root {driver_root} (searched "
                    f"{', '.join(LIBRARY_DIRS)}) nor on the library path: set --driver-root / "
                    "DRA_DRIVER_ROOT (Helm driverRoot) to where the NVIDIA driver is installed"
                )
            else:
                where = (
                    f"Run the plugin on a node with the NVIDIA driver loaded and {NVML_SONAME} on its "
                    "library path"
                )
            raise DeviceError(
                f"NVML not available: {e}. {where}, or use --simulate PROFILE for simulated GPUs"
            ) from e
        if read_only:
            return
        try:
            self._nvml.run("reconciling MIG mode", self._reconcile_mig_mode)
        except DeviceError as e:  # the GPUs still work; their MIG mode waits for the next start
            log.warning("mig_mode_reconcile_failed", error=str(e))

    # --- Backend -----------------------------------------------------------------------------------

    def orphaned_gpu_instances(self) -> frozenset[Orphan]:
        with self._orphans_lock:
            return frozenset(self._orphans)

    def adopt_orphaned_gpu_instances(self, orphans: Iterable[Orphan]) -> None:
        with self._orphans_lock:
            self._orphans |= set(orphans)
        if self._orphans and not self._read_only:
            try:
                self._nvml.run("destroying orphaned GPU instances", self._destroy_orphans)
            except DeviceError as e:  # tried again at every inventory read
                log.warning("orphaned_gpu_instances_not_destroyed", error=str(e))

    def inventory(self) -> Inventory:
        return self._nvml.run("reading the GPU inventory", self._inventory)

    @property
    def call_timeout(self) -> float:
        """How long an NVML call may take before it counts as hung, in seconds."""
        return self._nvml.timeout

    def known_gpus(self) -> dict[int, str]:
        """The uuid of each GPU by NVML index, as the last inventory read them."""
        return dict(self._known_gpus)

    def mig_mode_switches(self) -> int:
        """How often this backend switched a GPU's MIG mode: each switch may have reset the GPU,
        which ends its NVML event registrations (see :class:`~dra_driver.devices.health.NvmlHealthSource`)."""
        return self._mig_mode_switches

    def create_mig_device(self, parent_uuid: str, profile_id: int, placement: Placement) -> MigDevice:
        self._check_writable("creating a MIG device")
        return self._nvml.run(
            f"creating a MIG device on GPU {parent_uuid}",
            lambda: self._create_mig_device(parent_uuid, profile_id, placement),
            abandoned=self._destroy_abandoned,
        )

    def _destroy_abandoned(self, mig: MigDevice) -> None:
        """A MIG device whose creation outlived its timeout: its claim has failed, so nobody has it."""
        try:
            self._destroy_mig_device(mig.parent_uuid, mig.uuid)
        except (pynvml.NVMLError, DeviceError) as e:
            log.error("abandoned_mig_device_not_destroyed", gpu=mig.parent_uuid, mig=mig.uuid, error=str(e))
            self._orphan(Orphan(mig.parent_uuid, mig.profile_id, mig.placement))
            return
        log.warning("abandoned_mig_device_destroyed", gpu=mig.parent_uuid, mig=mig.uuid)

    def destroy_mig_device(self, parent_uuid: str, mig_uuid: str) -> None:
        self._check_writable("destroying a MIG device")
        self._nvml.run(
            f"destroying MIG device {mig_uuid} on GPU {parent_uuid}",
            lambda: self._destroy_mig_device(parent_uuid, mig_uuid),
        )

    def compute_policy(self, gpu_uuid: str) -> ComputePolicy:
        return self._nvml.run(
            f"reading the compute policy of GPU {gpu_uuid}",
            lambda: self._policy.read(self._handle(gpu_uuid), gpu_uuid),
        )

    def set_compute_policy(self, gpu_uuid: str, policy: ComputePolicy) -> None:
        self._check_writable("setting a compute policy")
        self._nvml.run(
            f"setting the compute policy of GPU {gpu_uuid}",
            lambda: self._policy.set(self._handle(gpu_uuid), gpu_uuid, policy),
        )

    def processes(self, gpu_uuid: str) -> int:
        def count() -> int:
            handle = self._handle(gpu_uuid)
            compute = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
            graphics = pynvml.nvmlDeviceGetGraphicsRunningProcesses(handle)
            return len({p.pid for p in (*compute, *graphics)})

        try:
            return self._nvml.run(f"reading the processes on GPU {gpu_uuid}", count)
        except pynvml.NVMLError as e:
            raise DeviceError(f"cannot read the processes on GPU {gpu_uuid}: {e}") from None

    def pci(self) -> PciBus:
        if self._pci_write is None:
            return PciBus(self._sysfs_root)
        return PciBus(self._sysfs_root, self._pci_write)

    def _check_writable(self, action: str) -> None:
        if self._read_only:
            raise DeviceError(f"{action}: this NVML backend was opened read-only")

    def close(self) -> None:
        try:
            self._nvml.run("shutting NVML down", pynvml.nvmlShutdown)
        except (pynvml.NVMLError, DeviceError) as e:
            log.warning("nvml_shutdown_failed", error=str(e))

    # --- reading -----------------------------------------------------------------------------------

    def _inventory(self) -> Inventory:
        if not self._read_only:
            self._destroy_orphans()
        try:
            count = pynvml.nvmlDeviceGetCount()
            driver_version = pynvml.nvmlSystemGetDriverVersion()
            cuda = pynvml.nvmlSystemGetCudaDriverVersion()
        except pynvml.NVMLError as e:
            raise _nvml_error(e, "reading the GPU inventory") from e
        gpus = []
        for index in range(count):
            try:
                gpus.append(self._gpu(index))
            except (pynvml.NVMLError, DeviceError) as e:
                # One GPU that cannot be read must not take the node's other GPUs with it. One read
                # before stays as it was last seen: it stays published, so that the health watch's
                # taint (a lost GPU) has a device to go on and its pods are evicted.
                error = _nvml_error(e, f"reading GPU {index}") if isinstance(e, pynvml.NVMLError) else e
                last = self._last_read.get(index)
                if last is not None:
                    log.warning(
                        "gpu_read_failed_kept_as_last_read", index=index, gpu=last.uuid, error=str(error)
                    )
                    gpus.append(last)
                    continue
                log.error(
                    "gpu_left_out_of_inventory",
                    index=index,
                    error=str(error),
                    hint="the GPU is not published until it answers; check `nvidia-smi -i INDEX` and dmesg",
                )
        self._last_read = {gpu.index: gpu for gpu in gpus}
        self._known_gpus = {gpu.index: gpu.uuid for gpu in gpus}
        return Inventory(
            gpus=tuple(gpus),
            driver_version=driver_version,
            cuda_driver_version=(cuda // 1000, cuda % 1000 // 10),
            control_nodes=self._control_nodes(),
        )

    def _create_mig_device(self, parent_uuid: str, profile_id: int, placement: Placement) -> MigDevice:
        action = (
            f"creating a MIG device (profile id {profile_id}, memory slices {placement.start}.."
            f"{placement.start + placement.size - 1}) on GPU {parent_uuid}"
        )
        handle = self._handle(parent_uuid)
        try:
            profile = next((p for p in self._profiles(handle) if p.profile_id == profile_id), None)
            if profile is None:
                raise PlacementUnavailableError(f"{action}: the GPU offers no such profile")
            if placement not in profile.placements:
                starts = ", ".join(str(p.start) for p in profile.placements)
                raise PlacementUnavailableError(
                    f"{action}: profile {profile.name} starts only at slices {starts}"
                )
            switched_on = self._switch_mig_mode_on(handle, parent_uuid)
            if switched_on:
                # SetMigMode may reset the GPU, and then its handle and minor number change (nvml.h).
                handle = self._handle(parent_uuid)
            minor = pynvml.nvmlDeviceGetMinorNumber(handle)
        except pynvml.NVMLError as e:
            raise _nvml_error(e, action) from e
        try:
            gpu_instance, compute_instance = self._create_instances(handle, profile, placement, parent_uuid)
        except pynvml.NVMLError as e:
            if switched_on:
                self._switch_mig_mode_off_if_unused(handle, parent_uuid)
            raise _nvml_error(e, action) from e
        try:
            gi_id = pynvml.nvmlGpuInstanceGetInfo(gpu_instance).id
            ci_id = pynvml.nvmlComputeInstanceGetInfo(compute_instance).id
            created = next(
                (
                    m
                    for m in self._mig_handles(handle)
                    if (m.gpu_instance_id, m.compute_instance_id) == (gi_id, ci_id)
                ),
                None,
            )
            if created is None:
                raise DeviceError(f"{action}: NVML lists no MIG device for new GPU instance {gi_id}")
            # Whoever destroyed an orphan here (an administrator, a GPU reset), it is not this one.
            self._forget_orphans(lambda o: o.gpu_uuid == parent_uuid and o.placement.overlaps(placement))
            return MigDevice(
                uuid=created.uuid,
                parent_uuid=parent_uuid,
                profile=profile.name,
                profile_id=profile.profile_id,
                placement=placement,
                gpu_instance_id=gi_id,
                compute_instance_id=ci_id,
                cap_nodes=self._cap_nodes(minor, gi_id, ci_id, make=True),
            )
        except (pynvml.NVMLError, DeviceError) as e:
            # Leave the GPU as it was: a MIG device nobody can use must not outlive the failure.
            self._destroy_instances(
                compute_instance, gpu_instance, Orphan(parent_uuid, profile_id, placement)
            )
            if switched_on:
                self._switch_mig_mode_off_if_unused(handle, parent_uuid)
            if isinstance(e, DeviceError):
                raise
            raise _nvml_error(e, action) from e

    def _destroy_mig_device(self, parent_uuid: str, mig_uuid: str) -> None:
        handle = self._handle(parent_uuid)
        action = f"destroying MIG device {mig_uuid} on GPU {parent_uuid}"
        try:
            found = next((m for m in self._mig_handles(handle) if m.uuid == mig_uuid), None)
            if found is None:
                return
            gpu_instance = pynvml.nvmlDeviceGetGpuInstanceById(handle, found.gpu_instance_id)
            compute_instance = pynvml.nvmlGpuInstanceGetComputeInstanceById(
                gpu_instance, found.compute_instance_id
            )
            # The compute instance first: a GPU instance with a compute instance cannot be destroyed.
            pynvml.nvmlComputeInstanceDestroy(compute_instance)
            pynvml.nvmlGpuInstanceDestroy(gpu_instance)
        except pynvml.NVMLError as e:
            raise _nvml_error(e, action) from e
        self._switch_mig_mode_off_if_unused(handle, parent_uuid)

    def _gpu(self, index: int) -> Gpu:
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        minor = pynvml.nvmlDeviceGetMinorNumber(handle)
        major_cc, minor_cc = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
        architecture = pynvml.nvmlDeviceGetArchitecture(handle)
        pci = pynvml.nvmlDeviceGetPciInfo(handle)
        bus_id = normalize_pci_bus_id(pci.busId.decode() if isinstance(pci.busId, bytes) else pci.busId)
        device_id, vendor_id = split_pci_device_id(pci.pciDeviceId)
        mig_mode = self._mig_mode(handle)
        profiles = self._profiles(handle) if mig_mode is not None else ()
        mig_enabled = mig_mode == pynvml.NVML_DEVICE_MIG_ENABLE
        uuid = pynvml.nvmlDeviceGetUUID(handle)
        mig_devices, reserved = self._mig_devices(handle, uuid, minor, profiles) if mig_enabled else ((), ())
        return Gpu(
            uuid=uuid,
            minor=minor,
            index=index,
            product_name=pynvml.nvmlDeviceGetName(handle),
            brand=brand_name(pynvml.nvmlDeviceGetBrand(handle)),
            architecture=architecture_name(architecture),
            cuda_compute_capability=(major_cc, minor_cc),
            memory_bytes=pynvml.nvmlDeviceGetMemoryInfo(handle).total,
            multiprocessors=self._multiprocessors(handle, (major_cc, minor_cc), device_id),
            pci_bus_id=bus_id,
            pci_device_id=device_id,
            pci_vendor_id=vendor_id,
            device_node=self._device_node(f"nvidia{minor}", (NVIDIA_MAJOR, minor)),
            pcie_root=self._pcie_root(bus_id),
            pcie_switch=self._pcie_switch(bus_id),
            numa_node=self._numa_node(bus_id),
            nvlink_remotes=nvlink_remotes(handle),
            addressing_mode=addressing_mode(handle),
            mig_capable=mig_mode is not None,
            mig_enabled=mig_enabled,
            mig_mode_change_requires_reset=mig_mode is not None and architecture < ARCHITECTURE_HOPPER,
            memory_slices=max((p.start + p.size for m in profiles for p in m.placements), default=0),
            mig_profiles=profiles,
            mig_devices=mig_devices,
            reserved_placements=reserved,
            fabric=self._fabric(handle),
        )

    @staticmethod
    def _fabric(handle: Any) -> FabricInfo | None:
        """The GPU's NVLink fabric info; None where the GPU or the driver has none (pre-Hopper).

        ``nvmlDeviceGetGpuFabricInfo``, as NVIDIA's compute-domain plugin reads it. nvml.h declares
        the struct's ``state`` one byte wide where pynvml reads four, so only its low byte counts.
        """
        info = pynvml.c_nvmlGpuFabricInfo_t()
        try:
            pynvml.nvmlDeviceGetGpuFabricInfo(handle, ctypes.byref(info))
        except _ABSENT:
            return None
        status = _return_text(int(info.status))
        return fabric_from_nvml(bytes(info.clusterUuid), int(info.cliqueId), int(info.state) & 0xFF, status)

    @staticmethod
    def _mig_mode(handle: Any) -> int | None:
        """The current MIG mode, or None when the GPU cannot do MIG."""
        try:
            current, _pending = pynvml.nvmlDeviceGetMigMode(handle)
        except _ABSENT:
            return None
        return int(current)

    @staticmethod
    def _multiprocessors(handle: Any, compute_capability: tuple[int, int], pci_device_id: int) -> int:
        """SM count: CUDA cores over cores per SM; else the catalog's value for this product; else 0."""
        per_sm = _CORES_PER_MULTIPROCESSOR.get(compute_capability)
        if per_sm:
            try:
                return int(pynvml.nvmlDeviceGetNumGpuCores(handle)) // per_sm
            except _ABSENT:
                pass
        known = (m for m in load_catalog().values() if m.pci_device_id == pci_device_id)
        return next((m.multiprocessors for m in known), 0)

    def _profiles(self, handle: Any) -> tuple[MigProfile, ...]:
        """Every GPU-instance profile the GPU offers, with its possible placements."""
        parent_memory = pynvml.nvmlDeviceGetMemoryInfo(handle).total
        profiles = []
        for nvml_profile in range(GPU_INSTANCE_PROFILE_COUNT):
            try:
                info = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, nvml_profile)
            except (*_ABSENT, pynvml.NVMLError_InvalidArgument):
                continue
            profiles.append(
                MigProfile(
                    name=mig_profile_name(nvml_profile, info.memorySizeMB, parent_memory),
                    profile_id=info.id,
                    nvml_profile=nvml_profile,
                    compute_slices=info.sliceCount,
                    instance_count=info.instanceCount,
                    memory_mib=info.memorySizeMB,
                    multiprocessors=info.multiprocessorCount,
                    copy_engines=info.copyEngineCount,
                    decoders=info.decoderCount,
                    encoders=info.encoderCount,
                    jpeg_engines=info.jpegCount,
                    ofa_engines=info.ofaCount,
                    placements=self._placements(handle, info.id),
                )
            )
        return tuple(profiles)

    @staticmethod
    def _placements(handle: Any, profile_id: int) -> tuple[Placement, ...]:
        # NVML's two-call protocol: a NULL array asks for the count, then the caller allocates.
        count = ctypes.c_uint(0)
        pynvml.nvmlDeviceGetGpuInstancePossiblePlacements(handle, profile_id, None, ctypes.pointer(count))
        placements = (pynvml.c_nvmlGpuInstancePlacement_t * count.value)()
        pynvml.nvmlDeviceGetGpuInstancePossiblePlacements(
            handle, profile_id, placements, ctypes.pointer(count)
        )
        return tuple(Placement(p.start, p.size) for p in placements[: count.value])

    @staticmethod
    def _mig_handles(handle: Any) -> Iterator[_MigHandle]:
        for index in range(pynvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
            try:
                mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, index)
            except (pynvml.NVMLError_NotFound, pynvml.NVMLError_InvalidArgument):
                continue  # an empty slot
            except pynvml.NVMLError_NotSupported:
                return  # MIG mode is off: no MIG devices
            yield _MigHandle(
                uuid=pynvml.nvmlDeviceGetUUID(mig),
                gpu_instance_id=pynvml.nvmlDeviceGetGpuInstanceId(mig),
                compute_instance_id=pynvml.nvmlDeviceGetComputeInstanceId(mig),
            )

    def _mig_devices(
        self, handle: Any, gpu_uuid: str, minor: int, profiles: tuple[MigProfile, ...]
    ) -> tuple[tuple[MigDevice, ...], tuple[tuple[str, Placement], ...]]:
        """The GPU's MIG devices, and the placements of GPU instances that are no usable MIG device.

        The GPU instances are listed themselves, not found through the MIG devices (compute
        instances): a GPU instance without a compute instance still holds its memory slices, and
        one with several compute instances is several MIG devices at one placement, which the
        driver does not publish. Both are *reserved*: no device is offered that overlaps them, and
        so is an orphan of a failed rollback that still has its compute instance.
        """
        orphans = {o for o in self.orphaned_gpu_instances() if o.gpu_uuid == gpu_uuid}
        by_instance: dict[int, list[_MigHandle]] = {}
        for mig in self._mig_handles(handle):
            by_instance.setdefault(mig.gpu_instance_id, []).append(mig)
        devices = []
        reserved = []
        seen: set[int] = set()
        for profile in profiles:
            for gi_id, placement in self._gpu_instances(handle, profile):
                seen.add(gi_id)
                migs = by_instance.get(gi_id, [])
                if Orphan(gpu_uuid, profile.profile_id, placement) in orphans:
                    reserved.append((profile.name, placement))  # logged as gpu_instance_orphaned
                    continue
                if len(migs) != 1:
                    log.warning(
                        "gpu_instance_not_published",
                        gpu=gpu_uuid,
                        gpu_instance=gi_id,
                        profile=profile.name,
                        placement=placement.start,
                        compute_instances=len(migs),
                        reason="the driver publishes a GPU instance with exactly one compute instance; "
                        "its memory slices stay reserved",
                    )
                    reserved.append((profile.name, placement))
                    continue
                (mig,) = migs
                devices.append(
                    MigDevice(
                        uuid=mig.uuid,
                        parent_uuid=gpu_uuid,
                        profile=profile.name,
                        profile_id=profile.profile_id,
                        placement=placement,
                        gpu_instance_id=gi_id,
                        compute_instance_id=mig.compute_instance_id,
                        cap_nodes=self._cap_nodes(minor, gi_id, mig.compute_instance_id),
                    )
                )
        for gi_id, migs in by_instance.items():
            if gi_id not in seen:
                raise DeviceError(
                    f"MIG device {migs[0].uuid} is in GPU instance {gi_id}, whose profile NVML does not "
                    "list among the GPU's profiles"
                )
        devices.sort(key=lambda d: (d.gpu_instance_id, d.compute_instance_id))
        return tuple(devices), tuple(reserved)

    @staticmethod
    def _gpu_instances(handle: Any, profile: MigProfile) -> list[tuple[int, Placement]]:
        """The GPU instances of ``profile`` on the GPU: (GPU-instance id, placement)."""
        slots = (pynvml.c_nvmlGpuInstance_t * max(1, profile.instance_count))()
        count = ctypes.c_uint(len(slots))
        try:
            pynvml.nvmlDeviceGetGpuInstances(handle, profile.profile_id, slots, ctypes.byref(count))
        except pynvml.NVMLError_NotSupported:
            return []  # MIG mode is off
        found = []
        for gpu_instance in slots[: count.value]:
            info = pynvml.nvmlGpuInstanceGetInfo(gpu_instance)
            found.append((int(info.id), Placement(info.placement.start, info.placement.size)))
        return found

    def _pci_path(self, bus_id: str) -> tuple[str, ...]:
        """The device's sysfs path below ``devices/``: host bridge, root port, bridges, the device.

        ``("pci0000:3a", "0000:3a:00.0", "0000:3b:00.0", "0000:3c:08.0", "0000:3d:00.0")`` for a GPU
        behind a PCIe switch (upstream port 3b, downstream port 3c:08); empty where sysfs has none.
        """
        devices = (self._sysfs_root / "devices").resolve()
        try:
            path = (self._sysfs_root / "bus" / "pci" / "devices" / bus_id).resolve(strict=True)
            parts = path.relative_to(devices).parts
        except (OSError, ValueError):
            return ()
        return parts if parts and parts[0].startswith("pci") else ()

    def _pcie_root(self, bus_id: str) -> str | None:
        """The PCIe root complex ("pci0000:3a") the sysfs device path of ``bus_id`` lies under."""
        path = self._pci_path(bus_id)
        return path[0] if path else None

    def _pcie_switch(self, bus_id: str) -> str | None:
        """The upstream port of the PCIe switch nearest the GPU (``PIX`` in ``nvidia-smi topo``).

        Below the root port, a switch is an upstream port with the downstream port the GPU hangs
        off: the GPU's grandparent. A GPU straight on a root port (host bridge, root port, GPU) has none.
        """
        path = self._pci_path(bus_id)
        return path[-3] if len(path) >= 5 else None

    def _numa_node(self, bus_id: str) -> int | None:
        """The NUMA node the kernel reports for the device; None for -1 (no NUMA) or no sysfs."""
        try:
            node = int((self._sysfs_root / "bus" / "pci" / "devices" / bus_id / "numa_node").read_text())
        except (OSError, ValueError):
            return None
        return node if node >= 0 else None

    # --- device nodes ------------------------------------------------------------------------------

    def _device_node(self, name: str, expected: tuple[int, int] | None = None) -> DeviceNode:
        """``/dev/<name>`` with the numbers the host's node has; ``expected`` when it is absent."""
        host = self._dev_root / "dev" / name
        host_path = None if self._dev_root == Path("/") else str(host)
        try:
            info = os.stat(host)
        except FileNotFoundError:
            if expected is None:
                raise
            return DeviceNode(f"/dev/{name}", *expected, host_path=host_path)
        if not stat.S_ISCHR(info.st_mode):
            raise DeviceError(f"{host} is not a character device; check the plugin's dev root setting")
        return DeviceNode(f"/dev/{name}", os.major(info.st_rdev), os.minor(info.st_rdev), host_path=host_path)

    def _control_nodes(self) -> tuple[DeviceNode, ...]:
        nodes = []
        for name in CONTROL_DEVICES:
            try:
                nodes.append(self._device_node(name))
            except FileNotFoundError:
                if name == "nvidiactl":
                    raise DeviceError(
                        f"{self._dev_root / 'dev' / name} does not exist: is the NVIDIA driver loaded, "
                        "and is the plugin's dev root the directory that holds the driver's /dev?"
                    ) from None
                # nvidia-uvm and nvidia-modeset appear once their modules load.
                log.info("control_device_absent", device=name)
        return tuple(nodes)

    def _cap_nodes(
        self, gpu_minor: int, gi_id: int, ci_id: int, *, make: bool = False
    ) -> tuple[DeviceNode, DeviceNode]:
        """The nvidia-caps nodes of a MIG device; their minors are in the driver's procfs files.

        Named by their container path only, as NVIDIA's driver does: the runtime makes them in the
        container from their numbers, whether or not the host has them. ``make`` creates the
        host's nodes where missing (:mod:`~dra_driver.devices.nvcaps`), for a device just made.
        """
        gpu_instance = self._procfs_root.joinpath(
            "driver", "nvidia", "capabilities", f"gpu{gpu_minor}", "mig", f"gi{gi_id}"
        )
        major = caps_major(self._procfs_root)
        nodes = []
        for access in (gpu_instance / "access", gpu_instance / f"ci{ci_id}" / "access"):
            capability = read_capability(access)
            if make:
                ensure_node(self._dev_root, capability, major)
            nodes.append(DeviceNode(capability.path, major, capability.minor))
        return nodes[0], nodes[1]

    # --- changing ----------------------------------------------------------------------------------

    @staticmethod
    def _handle(gpu_uuid: str) -> Any:
        try:
            return pynvml.nvmlDeviceGetHandleByUUID(gpu_uuid)
        except pynvml.NVMLError_NotFound:
            raise DeviceError(f"no GPU {gpu_uuid} on this node") from None
        except pynvml.NVMLError as e:
            raise _nvml_error(e, f"looking up GPU {gpu_uuid}") from e

    def _switch_mig_mode_on(self, handle: Any, gpu_uuid: str) -> bool:
        """Make sure MIG mode is on; True if this call switched it on.

        A failed activation (the GPU is in use, or it needs a reset after all) leaves NVML's
        *pending* mode enabled, and the GPU would come up in MIG mode at its next reset: the
        pending mode is put back before the error is raised.
        """
        current, _pending = pynvml.nvmlDeviceGetMigMode(handle)
        if current == pynvml.NVML_DEVICE_MIG_ENABLE:
            return False
        if pynvml.nvmlDeviceGetArchitecture(handle) < ARCHITECTURE_HOPPER:
            raise DeviceError(
                f"MIG mode is off on GPU {gpu_uuid} and switching it on needs a GPU reset on this "
                "architecture, which the driver never does: an administrator must enable it "
                "(`nvidia-smi -i <index> -mig 1`, then reset the GPU)"
            )
        status = pynvml.nvmlDeviceSetMigMode(handle, pynvml.NVML_DEVICE_MIG_ENABLE)
        if status != pynvml.NVML_SUCCESS:
            try:
                pynvml.nvmlDeviceSetMigMode(handle, pynvml.NVML_DEVICE_MIG_DISABLE)
            except pynvml.NVMLError as e:
                log.error("mig_mode_pending_not_restored", gpu=gpu_uuid, error=str(e))
            raise pynvml.NVMLError(status)
        self._mig_mode_switches += 1
        self._record_mig_mode_owner(gpu_uuid, owned=True)
        log.info("mig_mode_switched_on", gpu=gpu_uuid)
        return True

    def _switch_mig_mode_off_if_unused(self, handle: Any, gpu_uuid: str) -> None:
        """Switch MIG mode off once no GPU instance is left, where this driver switched it on.

        Best effort: a failure leaves the GPU in MIG mode, which is safe, so it is logged, not raised.
        """
        if gpu_uuid not in self._mig_mode_owners():
            return  # an administrator's MIG mode: theirs to end
        try:
            if pynvml.nvmlDeviceGetArchitecture(handle) < ARCHITECTURE_HOPPER or self._has_gpu_instances(
                handle
            ):
                return
            status = pynvml.nvmlDeviceSetMigMode(handle, pynvml.NVML_DEVICE_MIG_DISABLE)
            if status != pynvml.NVML_SUCCESS:
                raise pynvml.NVMLError(status)
        except pynvml.NVMLError as e:
            log.warning("mig_mode_switch_off_failed", gpu=gpu_uuid, error=str(e))
            return
        self._mig_mode_switches += 1
        self._record_mig_mode_owner(gpu_uuid, owned=False)
        log.info("mig_mode_switched_off", gpu=gpu_uuid)

    def _has_gpu_instances(self, handle: Any) -> bool:
        return any(self._gpu_instances(handle, profile) for profile in self._profiles(handle))

    def _reconcile_mig_mode(self) -> None:
        """After a reboot: MIG mode the driver switched on, on a GPU without instances, goes off again.

        MIG mode persists across reboots, GPU instances do not; left on, it would hide the full
        GPU for good. GPUs whose MIG mode an administrator set are never touched.
        """
        for gpu_uuid in sorted(self._mig_mode_owners()):
            try:
                handle = pynvml.nvmlDeviceGetHandleByUUID(gpu_uuid)
                current, _pending = pynvml.nvmlDeviceGetMigMode(handle)
            except pynvml.NVMLError_NotFound:
                self._record_mig_mode_owner(gpu_uuid, owned=False)  # the GPU is gone from the node
                continue
            except pynvml.NVMLError as e:
                log.warning("mig_mode_reconcile_failed", gpu=gpu_uuid, error=str(e))
                continue
            if current != pynvml.NVML_DEVICE_MIG_ENABLE:
                self._record_mig_mode_owner(gpu_uuid, owned=False)
                continue
            self._switch_mig_mode_off_if_unused(handle, gpu_uuid)

    def _mig_mode_owners(self) -> set[str]:
        if self._mig_mode_file is None:
            return set(self._owned_in_memory)
        try:
            owners = json.loads(self._mig_mode_file.read_text())["switchedOn"]
        except FileNotFoundError:
            return set()
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("mig_mode_record_unreadable", path=str(self._mig_mode_file), error=str(e))
            return set()
        return {str(uuid) for uuid in owners}

    def _record_mig_mode_owner(self, gpu_uuid: str, *, owned: bool) -> None:
        owners = self._mig_mode_owners()
        (owners.add if owned else owners.discard)(gpu_uuid)
        self._owned_in_memory = owners
        if self._mig_mode_file is None:
            return
        tmp = self._mig_mode_file.with_suffix(".tmp")
        try:
            self._mig_mode_file.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps({"switchedOn": sorted(owners)}) + "\n")
            tmp.replace(self._mig_mode_file)
        except OSError as e:
            log.error("mig_mode_record_failed", path=str(self._mig_mode_file), error=str(e))

    def _create_instances(
        self, handle: Any, profile: MigProfile, placement: Placement, gpu_uuid: str
    ) -> tuple[Any, Any]:
        """A GPU instance at exactly ``placement`` and one compute instance spanning it; all or nothing."""
        where = pynvml.c_nvmlGpuInstancePlacement_t(placement.start, placement.size)
        gpu_instance = pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(
            handle, profile.profile_id, ctypes.pointer(where)
        )
        try:
            ci_profile = pynvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                gpu_instance,
                _COMPUTE_INSTANCE_PROFILE_BY_SLICES[profile.compute_slices],
                pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED,
            )
            compute_instance = pynvml.nvmlGpuInstanceCreateComputeInstance(gpu_instance, ci_profile.id)
        except pynvml.NVMLError:
            self._destroy_instances(None, gpu_instance, Orphan(gpu_uuid, profile.profile_id, placement))
            raise
        return gpu_instance, compute_instance

    def _destroy_instances(self, compute_instance: Any, gpu_instance: Any, orphan: Orphan) -> None:
        """Roll back a half-made MIG device: each step tried again, never given up on silently.

        The caller is already failing, so a failure here is logged, not raised. A GPU instance
        that outlives every attempt is recorded as an orphan (:meth:`orphaned_gpu_instances`): the
        inventory lists its slices as reserved and destroys it once NVML answers again.
        """
        steps = [("compute instance", pynvml.nvmlComputeInstanceDestroy, compute_instance)]
        steps.append(("GPU instance", pynvml.nvmlGpuInstanceDestroy, gpu_instance))
        for what, destroy, instance in steps:
            if instance is None:
                continue
            for attempt in range(1, _ROLLBACK_ATTEMPTS + 1):
                try:
                    destroy(instance)
                    break
                except pynvml.NVMLError as e:
                    log.error(
                        "mig_rollback_failed",
                        gpu=orphan.gpu_uuid,
                        instance=what,
                        attempt=attempt,
                        error=str(e),
                    )
            else:
                # A GPU instance with its compute instance still there cannot be destroyed either.
                self._orphan(orphan)
                log.error(
                    "gpu_instance_orphaned",
                    gpu=orphan.gpu_uuid,
                    profile_id=orphan.profile_id,
                    placement=orphan.placement.start,
                    hint="its slices stay reserved; the driver destroys it once NVML answers again",
                )
                return

    def _destroy_orphans(self) -> None:
        """Destroy the GPU instances failed rollbacks left behind; those NVML still refuses stay recorded."""
        for orphan in sorted(self.orphaned_gpu_instances()):
            try:
                handle = pynvml.nvmlDeviceGetHandleByUUID(orphan.gpu_uuid)
            except pynvml.NVMLError_NotFound:
                # The GPU is gone from the node, and its instances with it.
                self._forget_orphans(orphan.__eq__)
                continue
            except pynvml.NVMLError as e:
                log.warning("orphaned_gpu_instance_not_destroyed", gpu=orphan.gpu_uuid, error=str(e))
                continue
            try:
                self._destroy_orphan(handle, orphan)
            except pynvml.NVMLError as e:
                log.warning(
                    "orphaned_gpu_instance_not_destroyed",
                    gpu=orphan.gpu_uuid,
                    placement=orphan.placement.start,
                    error=str(e),
                )
                continue
            self._forget_orphans(orphan.__eq__)
            self._switch_mig_mode_off_if_unused(handle, orphan.gpu_uuid)

    def _orphan(self, orphan: Orphan) -> None:
        with self._orphans_lock:
            self._orphans.add(orphan)

    def _forget_orphans(self, gone: Callable[[Orphan], bool]) -> None:
        with self._orphans_lock:
            stale = {o for o in self._orphans if gone(o)}
            self._orphans -= stale
        if stale:
            log.info("orphan_record_gone", placements=sorted((o.gpu_uuid, o.placement.start) for o in stale))

    def _destroy_orphan(self, handle: Any, orphan: Orphan) -> None:
        """The orphan's compute instances, then its GPU instance; nothing if it is gone (a GPU reset)."""
        profile = next((p for p in self._profiles(handle) if p.profile_id == orphan.profile_id), None)
        if profile is None:
            return
        gi_id = next((i for i, at in self._gpu_instances(handle, profile) if at == orphan.placement), None)
        if gi_id is None:
            return
        gpu_instance = pynvml.nvmlDeviceGetGpuInstanceById(handle, gi_id)
        for mig in list(self._mig_handles(handle)):
            if mig.gpu_instance_id == gi_id:
                compute = pynvml.nvmlGpuInstanceGetComputeInstanceById(gpu_instance, mig.compute_instance_id)
                pynvml.nvmlComputeInstanceDestroy(compute)
        pynvml.nvmlGpuInstanceDestroy(gpu_instance)
        log.warning(
            "orphaned_gpu_instance_destroyed",
            gpu=orphan.gpu_uuid,
            profile=profile.name,
            placement=orphan.placement.start,
        )


def _return_text(code: int) -> str:
    """An ``nvmlReturn_t`` as NVML words it ("Success"), as in a status field NVML fills in."""
    try:
        text = pynvml.nvmlErrorString(code)
    except pynvml.NVMLError:
        return str(code)
    return text.decode() if isinstance(text, bytes) else str(text)


NVML_SONAME = "libnvidia-ml.so.1"


def _preload_nvml(driver_root: Path) -> Path | None:
    """Load ``libnvidia-ml.so.1`` from the driver root, where no library path points.

    pynvml opens the library by its soname; once a library of that soname is loaded, the
    dynamic loader hands out the loaded one, so loading it by full path first is enough.
    """
    found = find_in(driver_root, LIBRARY_DIRS, NVML_SONAME)
    if found is None:
        return None  # left to the library path; nvmlInit says what is missing
    try:
        ctypes.CDLL(str(driver_root / found), mode=ctypes.RTLD_GLOBAL)
    except OSError as e:
        raise DeviceError(f"cannot load {driver_root / found}: {e}; check the driver root") from e
    return driver_root / found


def nvlink_remotes(handle: Any) -> tuple[str, ...]:
    """The far ends of the GPU's active NVLinks, as ``nvidia-smi nvlink -R`` lists them.

    Each is a PCI bus id -- a GPU's (a bridge) or an NVSwitch's -- or NVSWITCH_WITHOUT_ADDRESS for a
    switch NVML gives no address of. NVML answers NotSupported for a GPU without NVLink and
    InvalidArgument past its last link; a link that cannot be read counts as down.
    """
    remotes: set[str] = set()
    for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
        try:
            if pynvml.nvmlDeviceGetNvLinkState(handle, link) != pynvml.NVML_FEATURE_ENABLED:
                continue
        except pynvml.NVMLError_FunctionNotFound:
            return ()
        except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_InvalidArgument):
            continue
        except pynvml.NVMLError as e:
            log.warning("nvlink_state_unreadable", link=link, error=str(e))
            continue
        remote = _nvlink_remote(handle, link)
        if remote:
            remotes.add(remote)
    return tuple(sorted(remotes))


def _nvlink_remote(handle: Any, link: int) -> str | None:
    """What an active link leads to: a GPU's or switch's bus id; None for a CPU (IBM NPU) or unknown."""
    try:
        kind = pynvml.nvmlDeviceGetNvLinkRemoteDeviceType(handle, link)
    except pynvml.NVMLError:
        kind = pynvml.NVML_NVLINK_DEVICE_TYPE_UNKNOWN
    try:
        pci = pynvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link)
        bus_id = pci.busId.decode() if isinstance(pci.busId, bytes) else str(pci.busId)
    except pynvml.NVMLError:
        bus_id = ""
    if kind == pynvml.NVML_NVLINK_DEVICE_TYPE_IBMNPU:
        return None
    if bus_id.strip("0:.\x00 "):
        return normalize_pci_bus_id(bus_id)
    return NVSWITCH_WITHOUT_ADDRESS if kind == pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH else None


_ADDRESSING_MODES = {
    pynvml.NVML_DEVICE_ADDRESSING_MODE_NONE: "None",
    pynvml.NVML_DEVICE_ADDRESSING_MODE_HMM: "HMM",
    pynvml.NVML_DEVICE_ADDRESSING_MODE_ATS: "ATS",
}


def addressing_mode(handle: Any) -> str | None:
    """NVML's memory addressing mode as NVIDIA's driver publishes it, or None where there is none.

    Only coherent-memory platforms (Grace) have one; a driver without the call (older than
    the 580 series) or a platform without the feature means no attribute, as in go-nvlib.
    """
    try:
        mode = pynvml.nvmlDeviceGetAddressingMode(handle)
    except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_FunctionNotFound):
        return None
    return _ADDRESSING_MODES.get(mode)
