"""A simulated GPU backend that enforces the rules the hardware enforces.

It stands in for NVML wherever no GPU exists (development, CI, the demo, the
end-to-end tests): a wrong allocation must fail here exactly as it would on a
real GPU. The rules come from NVML and the MIG user guide
(shared/data/gpu-catalog-notes.md):

* a GPU instance occupies the memory slices ``[start, start+size)``; it can be
  created only at a placement its profile offers, only on free slices, only
  while the profile's ``instanceCount`` and the GPU's instance limit (7) allow;
* MIG mode switches on by itself on Hopper and newer, but on Ampere needs a GPU
  reset, which only an administrator can do (:meth:`SimulatedBackend.admin_set_mig_mode`);
* MIG mode cannot be switched on while processes use the full GPU, and a MIG
  device with processes attached cannot be destroyed (:meth:`SimulatedBackend.set_busy`);
* a GPU bound to vfio-pci for passthrough (in the simulated sysfs tree,
  :mod:`dra_driver.simulated.sysfs`) is gone from NVML's view, as on a node;
* a reboot (a new boot id) destroys every MIG device, clears faults and
  "in use" marks, and switches MIG mode off except on Ampere, which keeps it
  in the InfoROM.

Numbering is modelled on the real driver's (the NVML backend reads ids, it never
computes them). A GPU-instance id is the node of the memory-slice tree that the
placement covers: 0 for all eight slices, 1-2 the halves, 3-6 the quarters,
7-14 the eighths -- 15 ids, as many as the driver has GI minors per GPU. The
compute instance spans its GPU instance and has id 0.
Capability device minors follow ``/proc/driver/nvidia-caps/mig-minors``:
``config`` 1, ``monitor`` 2, then per GPU minor 15 GPU instances of 9 minors
each (the GI's ``access`` and 8 compute instances), so gpu<g>/gi<i>/access is
``3 + 135*g + 9*i`` and its ci<c>/access is one more plus ``c``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Literal

from dra_driver.devices.backend import DeviceError, DeviceInUseError, PlacementUnavailableError
from dra_driver.devices.catalog import GpuModel
from dra_driver.devices.host_imex import DEFAULT_SOCKET, IMEX_CTL
from dra_driver.devices.pci import NVIDIA, PciBus
from dra_driver.devices.types import (
    ComputeMode,
    ComputePolicy,
    DeviceNode,
    Gpu,
    Inventory,
    MigDevice,
    MigProfile,
    OrphanedGpuInstance,
    Placement,
    TimeSlice,
)
from dra_driver.simulated.nodes import NVIDIA_MAJOR, NodeProfile, node_gpus, node_profile, profile_fabric
from dra_driver.simulated.state import SimGpu, SimMigDevice, SimState, StateFile
from dra_driver.simulated.sysfs import SimulatedKernel, gpu_tree

DRIVER_VERSION = "580.95.05"
CUDA_DRIVER_VERSION = (13, 0)
NVIDIA_UVM_MAJOR = 510
NVIDIA_CAPS_MAJOR = 237
CONTROL_NODES = (
    DeviceNode("/dev/nvidiactl", NVIDIA_MAJOR, 255),
    DeviceNode("/dev/nvidia-modeset", NVIDIA_MAJOR, 254),
    DeviceNode("/dev/nvidia-uvm", NVIDIA_UVM_MAJOR, 0),
    DeviceNode("/dev/nvidia-uvm-tools", NVIDIA_UVM_MAJOR, 1),
)
STATE_FILE_NAME = "simulated-gpus.json"
HELD_CREATION_POLL_S = 0.1  # how often a held MIG creation looks whether it may go on
HELD_CREATION_MAX_S = 300.0  # and when it gives up, as a hung NVML call would be abandoned
DEFAULT_BOOT_ID_PATH = Path("/proc/sys/kernel/random/boot_id")

_MIG_UUID_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "https://gpu.dra-driver.dev/simulated-mig")


def gpu_instance_id(placement: Placement, memory_slices: int) -> int:
    """The id of the memory-slice tree node that ``placement`` covers (unique among live instances)."""
    return memory_slices // placement.size - 1 + placement.start // placement.size


def mig_cap_nodes(gpu_minor: int, gi_id: int, ci_id: int) -> tuple[DeviceNode, DeviceNode]:
    """The nvidia-caps nodes granting access to a GPU instance and to its compute instance."""
    gi_minor = 3 + 135 * gpu_minor + 9 * gi_id
    ci_minor = gi_minor + 1 + ci_id
    return (
        DeviceNode(f"/dev/nvidia-caps/nvidia-cap{gi_minor}", NVIDIA_CAPS_MAJOR, gi_minor),
        DeviceNode(f"/dev/nvidia-caps/nvidia-cap{ci_minor}", NVIDIA_CAPS_MAJOR, ci_minor),
    )


def placement_refusal(
    profile: MigProfile,
    placement: Placement,
    live: Sequence[tuple[MigProfile, Placement]],
    max_gpu_instances: int,
) -> str | None:
    """Why the hardware would refuse a GPU instance of ``profile`` at ``placement``; None if it would not."""
    if placement not in profile.placements:
        offered = ", ".join(str(p.start) for p in profile.placements)
        return (
            f"profile {profile.name} cannot be placed at memory slices {placement.start}.."
            f"{placement.start + placement.size - 1}; it starts at {offered} with size "
            f"{profile.placements[0].size}"
        )
    clash = next(((p, at) for p, at in live if at.overlaps(placement)), None)
    if clash:
        return (
            f"memory slices {placement.start}..{placement.start + placement.size - 1} overlap the live "
            f"{clash[0].name} instance at {clash[1].start}..{clash[1].start + clash[1].size - 1}"
        )
    same = sum(1 for p, _ in live if p.profile_id == profile.profile_id)
    if same >= profile.instance_count:
        return f"profile {profile.name} allows {profile.instance_count} instance(s) per GPU and has {same}"
    if len(live) >= max_gpu_instances:
        return f"the GPU already holds its maximum of {max_gpu_instances} GPU instances"
    return None


class SimulatedBackend:
    """Simulated GPUs of one node profile, with their state kept in ``state_dir``.

    Every method reads the state file afresh, so changes made by another process
    (the ``simulate`` CLI next to the daemon) are seen at the next call. Methods
    block on file I/O; callers on the event loop use ``asyncio.to_thread``.
    """

    def __init__(
        self,
        profile: str,
        node_name: str,
        state_dir: Path,
        *,
        boot_id_path: Path = DEFAULT_BOOT_ID_PATH,
        fabric: str = "",
        sysfs_root: Path | None = None,
    ) -> None:
        """``fabric`` (``<cluster-uuid>/<clique-id>``) places an NVL72 node in an NVLink clique;
        the GPUs' sysfs tree is made under ``sysfs_root`` (default ``<state_dir>/sysfs``)."""
        self.profile: NodeProfile = node_profile(profile)
        self.node_name = node_name
        self._gpus = node_gpus(self.profile, node_name, profile_fabric(self.profile, fabric))
        self._state = StateFile(state_dir / STATE_FILE_NAME)
        self._boot_id_path = boot_id_path
        self.sysfs_root = sysfs_root or state_dir / "sysfs"
        self._pci: PciBus | None = None  # the tree is made at the first use, like the state file
        self.kernel: SimulatedKernel | None = None  # acts on the tree's writes; tests inject faults there

    # --- Backend -----------------------------------------------------------------------------------

    def inventory(self) -> Inventory:
        state = self._reading()
        return Inventory(
            gpus=tuple(self._gpu_now(gpu, model, state) for gpu, model in self._gpus if self._on_nvidia(gpu)),
            driver_version=DRIVER_VERSION,
            cuda_driver_version=CUDA_DRIVER_VERSION,
            control_nodes=CONTROL_NODES,
        )

    def create_mig_device(self, parent_uuid: str, profile_id: int, placement: Placement) -> MigDevice:
        gpu, model = self._mig_capable(self._find(parent_uuid))
        self._creation_fault(gpu.uuid)
        profile = model.profile_by_id(profile_id)
        if profile is None:
            known = ", ".join(f"{p.profile_id} ({p.name})" for p in model.mig_profiles)
            raise PlacementUnavailableError(
                f"GPU {gpu.uuid} ({gpu.product_name}) has no MIG profile with id {profile_id}; "
                f"its profiles are {known}"
            )
        with self._changing() as state:
            sim = state.gpu(gpu.uuid)
            if not sim.mig_enabled:
                self._check_mig_mode_can_switch_on(gpu, model, sim)
            live = [(self._profile(model, d), self._placement(model, d)) for d in sim.mig_devices]
            refusal = placement_refusal(profile, placement, live, model.max_gpu_instances)
            if refusal:
                raise PlacementUnavailableError(f"cannot create a MIG device on GPU {gpu.uuid}: {refusal}")
            state.mig_serial += 1
            device = SimMigDevice(
                uuid=f"MIG-{uuid.uuid5(_MIG_UUID_NAMESPACE, f'{gpu.uuid}/{state.mig_serial}')}",
                profile_id=profile.profile_id,
                start=placement.start,
                gpu_instance_id=gpu_instance_id(placement, model.memory_slices),
                compute_instance_id=0,
            )
            sim.mig_enabled = True
            sim.mig_devices.append(device)
        return self._mig_device(gpu, model, device)

    def destroy_mig_device(self, parent_uuid: str, mig_uuid: str) -> None:
        gpu, model = self._find(parent_uuid)
        with self._changing() as state:
            sim = state.gpu(gpu.uuid)
            device = next((d for d in sim.mig_devices if d.uuid == mig_uuid), None)
            if device is None:
                return
            if device.busy:
                raise DeviceInUseError(
                    f"MIG device {mig_uuid} on GPU {gpu.uuid} has processes attached; stop them and retry"
                )
            sim.mig_devices.remove(device)
            if not sim.mig_devices and not model.mig_mode_change_requires_reset:
                sim.mig_enabled = False  # as NVML would be told to: the full GPU is usable again

    def compute_policy(self, gpu_uuid: str) -> ComputePolicy:
        gpu, _ = self._find(gpu_uuid)
        sim = self._reading().gpus.get(gpu.uuid)
        if sim is None:
            return ComputePolicy()
        return ComputePolicy(ComputeMode(sim.compute_mode), TimeSlice(sim.time_slice))

    def set_compute_policy(self, gpu_uuid: str, policy: ComputePolicy) -> None:
        """As ``nvidia-smi -c`` and ``nvidia-smi compute-policy --set-timeslice`` would.

        A GPU in MIG mode keeps the default time slice: its MIG devices time-slice with a fixed one.
        """
        gpu, _ = self._find(gpu_uuid)
        with self._changing() as state:
            sim = state.gpu(gpu.uuid)
            if policy.time_slice is not TimeSlice.DEFAULT and sim.mig_enabled:
                raise DeviceError(
                    f"GPU {gpu.uuid} is in MIG mode, where the time slice cannot be set (Not Supported)"
                )
            sim.compute_mode = policy.compute_mode.value
            sim.time_slice = policy.time_slice.value

    def orphaned_gpu_instances(self) -> frozenset[OrphanedGpuInstance]:
        return frozenset()  # creating a simulated MIG device is one step: there is no rollback

    def adopt_orphaned_gpu_instances(self, orphans: Iterable[OrphanedGpuInstance]) -> None:
        pass

    def processes(self, gpu_uuid: str) -> int:
        gpu, _ = self._find(gpu_uuid)
        sim = self._reading().gpus.get(gpu.uuid)
        return 1 if sim is not None and sim.busy else 0

    def pci(self) -> PciBus:
        """The simulated GPUs' sysfs tree: made at the first use, and afresh after a reboot."""
        boot_id = self._boot_id()
        if _read(self._sysfs_boot) != boot_id:  # none yet, or of an earlier boot: all on nvidia again
            self._pci = None
            try:
                shutil.rmtree(self.sysfs_root, ignore_errors=True)
                gpu_tree(self.sysfs_root, (gpu for gpu, _ in self._gpus))
                self._sysfs_boot.write_text(boot_id)
            except OSError as error:
                raise DeviceError(
                    f"cannot make the simulated GPUs' sysfs tree in {self.sysfs_root}: {error}; point "
                    "--sysfs-root or --data-dir at a writable directory"
                ) from None
        if self._pci is None:
            self.kernel = SimulatedKernel(self.sysfs_root)
            self._pci = PciBus(self.sysfs_root, self.kernel.write)
        return self._pci

    @property
    def _sysfs_boot(self) -> Path:
        return self.sysfs_root / ".simulated-boot-id"  # no kernel file: the boot the bindings are of

    def _on_nvidia(self, gpu: Gpu) -> bool:
        """Whether NVML sees the GPU: bound to nvidia, as every GPU is until the tree says otherwise.

        Only reads: a tree of another boot (or none) means every GPU is on nvidia.
        """
        if _read(self._sysfs_boot) != self._boot_id():
            return True
        return PciBus(self.sysfs_root).driver(gpu.pci_bus_id) == NVIDIA

    def close(self) -> None:
        """Nothing to release: all state is in the file."""

    # --- administrator and test-harness operations (the `simulate` CLI) ----------------------------

    def admin_set_mig_mode(self, gpu: str | int, enabled: bool) -> None:
        """Switch MIG mode as ``nvidia-smi -i N -mig 0|1`` would, including the reset Ampere needs."""
        target, _ = self._mig_capable(self._resolve(gpu))
        with self._changing() as state:
            sim = state.gpu(target.uuid)
            if enabled and not sim.mig_enabled and sim.busy:
                raise DeviceInUseError(
                    f"GPU {target.uuid} is in use; MIG mode can only change on an idle GPU"
                )
            if not enabled and sim.mig_devices:
                raise DeviceError(
                    f"GPU {target.uuid} still has {len(sim.mig_devices)} MIG device(s); destroy them first"
                )
            sim.mig_enabled = enabled

    def admin_create_mig(self, gpu: str | int, profile: str, start: int) -> MigDevice:
        """Create a MIG device as an administrator would ("static MIG"), by profile name and start slice.

        The same hardware rules apply as for the driver's own MIG devices.
        """
        target, model = self._mig_capable(self._resolve(gpu))
        chosen = next((p for p in model.mig_profiles if p.name == profile), None)
        if chosen is None:
            known = ", ".join(p.name for p in model.mig_profiles)
            raise PlacementUnavailableError(
                f"GPU {target.uuid} ({target.product_name}) has no MIG profile {profile!r}; profiles: {known}"
            )
        return self.create_mig_device(
            target.uuid, chosen.profile_id, Placement(start, chosen.placements[0].size)
        )

    def set_busy(self, target: str | int, busy: bool) -> None:
        """Mark a GPU (by uuid or index) or a MIG device (by uuid) as having processes attached, or idle."""
        device_uuid = self._resolve(target)[0].uuid if isinstance(target, int) else target
        with self._changing() as state:
            if any(gpu.uuid == device_uuid for gpu, _ in self._gpus):
                sim = state.gpu(device_uuid)
                if busy and sim.mig_enabled:
                    raise DeviceError(
                        f"GPU {device_uuid} is in MIG mode, where the full GPU cannot run processes; "
                        "use one of its MIG devices, or switch MIG mode off first"
                    )
                sim.busy = busy
                return
            devices = (d for sim in state.gpus.values() for d in sim.mig_devices)
            device = next((d for d in devices if d.uuid == device_uuid), None)
            if device is None:
                raise DeviceError(f"no GPU or MIG device {device_uuid} on simulated node {self.node_name}")
            device.busy = busy

    def set_mps_broken(self, gpu: str | int, broken: bool) -> None:
        """Make an MPS server fail to start on a GPU (a fault for tests), or work again."""
        target, _ = self._resolve(gpu)
        with self._changing() as state:
            state.gpu(target.uuid).mps_broken = broken

    def set_mps_held(self, gpu: str | int, held: bool) -> None:
        """Make an MPS server on a GPU wait before it is ready (slow to start), or start at once again."""
        target, _ = self._resolve(gpu)
        with self._changing() as state:
            state.gpu(target.uuid).mps_held = held

    def mps_broken(self, gpu_uuid: str) -> bool:
        """Whether an MPS server fails to start on the GPU (see :meth:`set_mps_broken`)."""
        sim = self._reading().gpus.get(gpu_uuid)
        return sim is not None and sim.mps_broken

    def set_mig_creation(self, gpu: str | int, mode: Literal["ok", "held", "failing"]) -> None:
        """Make creating a MIG device on a GPU wait (held), fail (failing), or work again (ok)."""
        target, _ = self._mig_capable(self._resolve(gpu))
        with self._changing() as state:
            state.gpu(target.uuid).mig_creation = mode

    def _creation_fault(self, gpu_uuid: str) -> None:
        """Wait while creation on the GPU is held; fail while it is failing (see set_mig_creation).

        Runs in the caller's worker thread, as a slow NVML call would; it polls the state file,
        which another process (the `simulate` CLI) changes.
        """
        deadline = time.monotonic() + HELD_CREATION_MAX_S
        while (sim := self._reading().gpus.get(gpu_uuid)) is not None and sim.mig_creation == "held":
            if time.monotonic() > deadline:
                raise DeviceError(f"creating a MIG device on GPU {gpu_uuid} timed out (simulated fault)")
            time.sleep(HELD_CREATION_POLL_S)
        if sim is not None and sim.mig_creation == "failing":
            raise DeviceError(
                f"creating a MIG device on GPU {gpu_uuid} failed: Unknown Error (simulated fault; "
                "`dra-driver simulate mig-creation --mode ok` ends it)"
            )

    def set_host_imex(self, state: Literal["ready", "stopped"]) -> None:
        """Start or stop the simulated host nvidia-imex service (:mod:`dra_driver.devices.host_imex`)."""
        with self._changing() as current:
            current.host_imex = state

    def inject_xid(self, gpu: str | int, xid: int) -> None:
        """Record an Xid event on a GPU, as the kernel driver would report it."""
        target, _ = self._resolve(gpu)
        with self._changing() as state:
            state.gpu(target.uuid).xids.append(xid)

    def recover(self, gpu: str | int) -> None:
        """Forget a GPU's Xid events: it was repaired or reset."""
        target, _ = self._resolve(gpu)
        with self._changing() as state:
            state.gpu(target.uuid).xids.clear()

    def faults(self) -> dict[str, tuple[int, ...]]:
        """Xid events per GPU uuid, oldest first; healthy GPUs are absent."""
        state = self._reading()
        return {
            gpu.uuid: tuple(sim.xids)
            for gpu, _ in self._gpus
            if (sim := state.gpus.get(gpu.uuid)) and sim.xids
        }

    # --- internals ---------------------------------------------------------------------------------

    def _reading(self) -> SimState:
        return self._in_this_boot(self._of_these_gpus(self._state.read()))

    @contextlib.contextmanager
    def _changing(self) -> Iterator[SimState]:
        """The state to change; written back only if the block completes (the GPU is left as it was)."""
        with self._state.update() as state:
            yield self._in_this_boot(self._of_these_gpus(state))

    def _of_these_gpus(self, state: SimState) -> SimState:
        """Refuse the state of another node or profile: its MIG devices would land on the wrong GPUs."""
        mine = (self.profile.name, self.node_name)
        if state.profile and (state.profile, state.node_name) != mine:
            raise DeviceError(
                f"simulated GPU state {self._state.path} belongs to node {state.node_name!r} with profile "
                f"{state.profile!r}, not node {self.node_name!r} with profile {self.profile.name!r}; pass "
                "that node's --node-name and --simulate, another --data-dir, or delete the file to "
                "power-cycle the simulated GPUs"
            )
        state.profile, state.node_name = mine
        return state

    def _in_this_boot(self, state: SimState) -> SimState:
        """Turn ``state`` in place into what the hardware shows in this boot: a new boot id is a reboot."""
        boot_id = self._boot_id()
        if state.boot_id != boot_id:
            state.boot_id = boot_id
            state.gpus = {
                gpu.uuid: SimGpu(mig_enabled=True)
                for gpu, model in self._gpus
                if model.mig_mode_change_requires_reset
                and (old := state.gpus.get(gpu.uuid))
                and old.mig_enabled
            }
        return state

    def _boot_id(self) -> str:
        try:
            return self._boot_id_path.read_text().strip()
        except FileNotFoundError:
            return ""  # no boot id on this OS: the state never counts as stale

    @staticmethod
    def _check_mig_mode_can_switch_on(gpu: Gpu, model: GpuModel, sim: SimGpu) -> None:
        if model.mig_mode_change_requires_reset:
            raise DeviceError(
                f"MIG mode is off on GPU {gpu.uuid} ({gpu.product_name}, {gpu.architecture}) and "
                "switching it on needs a GPU reset, which the driver never does: an administrator "
                f"must enable it (`nvidia-smi -i {gpu.index} -mig 1`, then reset the GPU)"
            )
        if sim.busy:
            raise DeviceInUseError(
                f"GPU {gpu.uuid} has processes using the full GPU; "
                "MIG mode can only be switched on when it is idle"
            )

    def _find(self, gpu_uuid: str) -> tuple[Gpu, GpuModel]:
        found = next(((g, m) for g, m in self._gpus if g.uuid == gpu_uuid), None)
        if found is None:
            raise DeviceError(f"no GPU {gpu_uuid} on simulated node {self.node_name} ({self.profile.name})")
        return found

    def _resolve(self, gpu: str | int) -> tuple[Gpu, GpuModel]:
        """A GPU by uuid or by index."""
        if isinstance(gpu, str):
            return self._find(gpu)
        if not 0 <= gpu < len(self._gpus):
            raise DeviceError(f"no GPU with index {gpu}; node {self.node_name} has 0..{len(self._gpus) - 1}")
        return self._gpus[gpu]

    @staticmethod
    def _mig_capable(found: tuple[Gpu, GpuModel]) -> tuple[Gpu, GpuModel]:
        gpu, model = found
        if not model.mig_capable:
            raise DeviceError(f"GPU {gpu.uuid} ({gpu.product_name}) does not support MIG")
        return found

    @staticmethod
    def _profile(model: GpuModel, device: SimMigDevice) -> MigProfile:
        profile = model.profile_by_id(device.profile_id)
        if profile is None:
            raise DeviceError(
                f"simulated state names MIG profile id {device.profile_id}, unknown to {model.key}"
            )
        return profile

    def _placement(self, model: GpuModel, device: SimMigDevice) -> Placement:
        return Placement(device.start, self._profile(model, device).placements[0].size)

    def _mig_device(self, gpu: Gpu, model: GpuModel, device: SimMigDevice) -> MigDevice:
        return MigDevice(
            uuid=device.uuid,
            parent_uuid=gpu.uuid,
            profile=self._profile(model, device).name,
            profile_id=device.profile_id,
            placement=self._placement(model, device),
            gpu_instance_id=device.gpu_instance_id,
            compute_instance_id=device.compute_instance_id,
            cap_nodes=mig_cap_nodes(gpu.minor, device.gpu_instance_id, device.compute_instance_id),
        )

    def _gpu_now(self, gpu: Gpu, model: GpuModel, state: SimState) -> Gpu:
        sim = state.gpus.get(gpu.uuid)
        if sim is None:
            return gpu
        return dataclasses.replace(
            gpu,
            mig_enabled=sim.mig_enabled,
            mig_devices=tuple(self._mig_device(gpu, model, d) for d in sim.mig_devices),
        )


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except FileNotFoundError:
        return None


class SimulatedHostImex:
    """The :class:`~dra_driver.devices.host_imex.HostImex` check of a simulated node.

    Its host daemon is ready unless ``dra-driver simulate host-imex --state stopped`` stopped it
    (:meth:`SimulatedBackend.set_host_imex`).
    """

    def __init__(self, state_file: Path, socket: str = DEFAULT_SOCKET) -> None:
        self._state = StateFile(state_file)
        self.socket = socket

    def not_ready(self) -> str | None:
        if self._state.read().host_imex == "ready":
            return None
        return (
            f"error running {IMEX_CTL} (socket {self.socket!r}): the host's nvidia-imex service is not "
            "running (simulated; `dra-driver simulate host-imex --state ready` starts it)"
        )
