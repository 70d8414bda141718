"""The node's state against the plain model on the NVML backend, over the mock libnvidia-ml.so.1.

The machine of :mod:`tests.node.test_state_model` (same rules, same reference model, same
comparisons after every step), with the hardware underneath swapped: six H100 of NVIDIA's go-nvml
mock (``dgxh100:6``, see docs/mock-nvml.md), the driver's :class:`NvmlBackend` loaded from a driver
root as on a host, dynamic MIG devices created and destroyed through NVML (MIG mode switched on and
off with them), compute modes set through NVML and time slices through the mock's ``nvidia-smi``,
and passthrough claims moving GPUs to vfio-pci in a sysfs tree of the mock's GPUs
(``install_gpu_tree``), whose bindings the mock reads: a GPU on vfio-pci is gone from NVML's view.

How the GPUs behave across the machine's faults, and why that is honest:

* The GPUs' state is the mock's state directory (``MOCK_NVML_STATE_DIR``), which the library reads
  at every call: it lives outside the driver as a GPU does. A restart or a second instance is a
  new :class:`NvmlBackend` (as a new process loads NVML; its start-up reconciles MIG mode and
  destroys orphaned GPU instances) and finds the MIG devices, MIG mode and compute modes the GPUs
  kept. Nothing the model does reboots the node, so nothing resets a GPU.
* A crash leaves the GPUs as they were at the crash point: the mock's state directory, the
  capability files it writes under the node's procfs and the sysfs tree (driver links included)
  are among the directories a crash puts back.
* The driver's record of the GPUs whose MIG mode it switched on lives in the data directory, so a
  lost state forgets it: such a GPU stays in MIG mode (it cannot be told from an administrator's)
  and its full GPU is no longer given. The model counts that GPU as kept in MIG mode for good.
"""

from __future__ import annotations

import dataclasses
import json
import os
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings

from dra_driver.cdi.spec import common_edits
from dra_driver.devices.nvml import NvmlBackend
from dra_driver.devices.pci import PciBus
from dra_driver.devices.types import Inventory
from dra_driver.node.preparer import NodePreparer
from dra_driver.resources.device_names import mig_device_name
from dra_driver.simulated.mps_daemons import LocalMpsDaemons
from tests.mock_nvml import MockNvml, install_driver_root, install_gpu_tree, install_procfs

from .builders import DRIVER, NODE, InMemoryClaims, Node, RecordingObserver
from .test_state_model import (
    FIRST_UID,
    LAST_UID,
    MODEL_SETTINGS,
    NVML_NODE,
    NodeStateModel,
    a_mig_device_goes_with_its_claim_after_the_state_was_lost,
    the_reviews_sequence,
)

MACHINE = "dgxh100:6"
STATIC_GPU = 1  # gpu-1 holds the administrator's 3g.40gb at slice 0 (NVML_NODE.static_mig)
THREE_G_PROFILE_ID = 2  # NVIDIA's H100 mock: the NVML_GPU_INSTANCE_PROFILE_3_SLICE constant
THREE_SLICE_COMPUTE_PROFILE = 0x2  # NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE
NVML_ONE_G_START = 3  # where the regression example's 1g.10gb lies on gpu-0
CALL_TIMEOUT_S = 30.0  # NVML on the mock answers at once; only a hang would reach it
MOCK_STATE_FILE = "state.json"  # in MOCK_NVML_STATE_DIR (hack/mock-nvml/state.go)


class NvmlNodeStateModel(NodeStateModel):
    """The machine on six mock H100: only the node's hardware and how an instance starts differ."""

    variant = "mock_nvml"
    shape = NVML_NODE

    def _make_node(self) -> Node:
        self.mock = MockNvml()
        self.gpus = self.root / "gpus"  # the mock's state directory: the GPUs
        self.procfs = install_procfs(self.root / "proc")
        boot = self.procfs / "sys" / "kernel" / "random" / "boot_id"
        boot.parent.mkdir(parents=True)
        boot.write_text(f"{uuid.uuid4()}\n")
        (self.root / "boot_id").write_text(boot.read_text())  # --boot-id-file
        self.driver_root = install_driver_root(self.root / "driver-root")
        self.sysfs = self.root / "sys"  # the GPUs' tree, made once NVML has named them (below)
        self.mock.configure(MACHINE, state_dir=self.gpus, proc_root=self.procfs, sysfs_root=self.sysfs)
        # The mock's nvidia-smi, which the driver runs to set a time slice, finds the GPUs here.
        self._environment = os.environ.get("MOCK_NVML_STATE_DIR")
        os.environ["MOCK_NVML_STATE_DIR"] = str(self.gpus)
        self.hardware("mig", STATIC_GPU, 1)
        self.hardware("create-gi", STATIC_GPU, THREE_G_PROFILE_ID, 0)
        instance = self.mock.state(self.gpus)["gpus"][STATIC_GPU]["gpuInstances"][0]["id"]
        self.hardware("create-ci", STATIC_GPU, instance, THREE_SLICE_COMPUTE_PROFILE)
        self.backends: list[NvmlBackend] = []
        self._mps = LocalMpsDaemons(self.root / "mps")
        # What the comparisons read the GPUs through, as nvidia-smi would: it changes nothing.
        observer = self._backend(read_only=True)
        inventory = observer.inventory()
        self._common_edits = common_edits(inventory, None)
        # By GPU minor and profile id, the names of the profiles (NVML's state names only the id)
        self._profiles = {
            (gpu.minor, p.profile_id): p.name for gpu in inventory.gpus for p in gpu.mig_profiles
        }
        # Passthrough moves GPUs in the tree; the mock stops listing a GPU that is off nvidia there.
        self.kernel = install_gpu_tree(self.sysfs, inventory)
        self.passthrough = PciBus(self.sysfs).passthrough_gpus()  # as with --passthrough on
        self.gpu_addresses = {f"gpu-{gpu.minor}": gpu.pci_bus_id for gpu in inventory.gpus}
        for device, gpu in self.shape.passthrough_of.items():
            assert f"gpu-vfio-{self.passthrough[self.gpu_addresses[gpu]].index}" == device
        return Node(self.root, observer, InMemoryClaims(), RecordingObserver())  # type: ignore[arg-type]

    def hardware(self, *command: Any) -> str:
        """A command of the mock's control interface on this machine's GPUs (docs/mock-nvml.md)."""
        return self.mock.control(" ".join(str(word) for word in command), self.gpus)

    def _backend(self, read_only: bool = False) -> NvmlBackend:
        backend = NvmlBackend(
            sysfs_root=self.sysfs,
            procfs_root=self.procfs,
            dev_root=self.driver_root,
            driver_root=self.driver_root,
            state_dir=None if read_only else self.data_dir,
            call_timeout=CALL_TIMEOUT_S,
            read_only=read_only,
            pci_write=None if read_only else self.kernel.write,
        )
        self.backends.append(backend)
        return backend

    def _hardware_dirs(self) -> tuple[Path, ...]:
        return (self.gpus, self.procfs, self.sysfs)

    def _new_preparer(self) -> NodePreparer:
        """A new process: its own NVML backend, which reconciles MIG mode and orphans as it starts."""
        backend = self._backend()
        watch = _InventoryWatch(backend, self.gpus / MOCK_STATE_FILE, self.gpu_addresses.values())
        node = self.node
        return NodePreparer(
            driver_name=DRIVER,
            node_name=NODE,
            backend=backend,
            inventory=watch.current,
            on_inventory_changed=watch.deliver,
            claims=node.claims,
            specs=node.specs,
            common_edits=self._common_edits,
            store_path=node.store_path,
            boot_id_path=node.boot_id_path,
            observer=node.observer,
            mps=self.mps,
            consumable=True,
            passthrough=self.passthrough,
        )

    @property
    def mps(self) -> LocalMpsDaemons:
        return self._mps

    # The comparisons read the GPUs as the mock keeps them, in its state file: an inventory through
    # NVML, or the mock's `state` command, after every step would take most of the machine's time.

    def _gpu_state(self) -> list[dict[str, Any]]:
        gpus: list[dict[str, Any]] = json.loads((self.gpus / MOCK_STATE_FILE).read_bytes())["gpus"]
        return gpus

    def _mig_devices(self) -> set[str]:
        return {
            mig_device_name(
                gpu["minor"],
                self._profiles[(gpu["minor"], instance["profileId"])],
                instance["profileId"],
                instance["placement"]["start"],
            )
            for gpu in self._gpu_state()
            for instance in gpu["gpuInstances"]
        }

    def _changed_gpu_settings(self) -> dict[str, str]:
        changed = {}
        for gpu in self._gpu_state():
            mode, time_slice = gpu.get("computeMode", 0), gpu.get("timeSlice", 0)
            if mode or time_slice:
                changed[f"gpu-{gpu['minor']}"] = f"compute mode {mode}, time slice {time_slice}"
        return changed

    def _mig_mode_the_driver_switched_on(self) -> set[str]:
        gpus = self._gpu_state()
        return {f"gpu-{gpu['minor']}" for n, gpu in enumerate(gpus) if gpu["migCurrent"] and n != STATIC_GPU}

    def teardown(self) -> None:
        try:
            super().teardown()
        finally:
            for backend in self.backends:
                backend.close()
            if self._environment is None:
                os.environ.pop("MOCK_NVML_STATE_DIR", None)
            else:
                os.environ["MOCK_NVML_STATE_DIR"] = self._environment


class _InventoryWatch:
    """An instance's view of the GPUs, as the app keeps it (``dra_driver.gpu_plugin.watches.InventoryWatch``).

    The app reads the inventory once, takes the one a MIG change reads after it, and re-reads it
    periodically; here the periodic read has always happened before the kubelet's next call: the
    view is read again whenever the GPUs' MIG layout or their drivers changed since (another
    instance made or destroyed a MIG device, or moved a GPU to vfio-pci or back). An inventory
    through NVML takes long; the mock's state file and the sysfs links, a moment.
    """

    def __init__(self, backend: NvmlBackend, hardware: Path, addresses: Iterable[str]) -> None:
        self._backend = backend
        self._hardware = hardware
        self._addresses = tuple(addresses)
        self._seen = self._layout()
        self._inventory = backend.inventory()

    def _layout(self) -> str:
        gpus = json.loads(self._hardware.read_bytes())["gpus"]
        bus = self._backend.pci()
        drivers = [bus.driver(address) for address in self._addresses]
        return json.dumps([[(gpu["migCurrent"], gpu["gpuInstances"]) for gpu in gpus], drivers])

    def current(self) -> Inventory:
        now = self._layout()
        if now != self._seen:
            self._seen, self._inventory = now, self._backend.inventory()
        return self._inventory

    def deliver(self, latest: Inventory) -> None:
        self._seen, self._inventory = self._layout(), latest


# Fewer and shorter sequences than on the simulator: a step here costs several times as much
# (NVML's C interface, the mock's state file); `make reliability` runs many more.
NVML_MODEL_SETTINGS = settings(MODEL_SETTINGS, max_examples=5, stateful_step_count=20)
NvmlNodeStateModel.TestCase.settings = NVML_MODEL_SETTINGS
TestNvmlNodeStateModel = NvmlNodeStateModel.TestCase


# --- the regression examples on the NVML backend ----------------------------------------------------


@dataclasses.dataclass
class NvmlNode:
    node: Node
    restart: Callable[[], None]  # the driver's process ends; the next loads NVML again


@pytest.fixture
def nvml_node(tmp_path: Path) -> Iterator[NvmlNode]:
    """Three H100 of the mock (gpu-1 with the administrator's 3g.40gb), a driver root, procfs, boot id.

    The mock's machine lives in this process, outside any backend: a restart loads NVML again
    (a new :class:`NvmlBackend`) and finds the GPUs as they were.
    """
    mock = MockNvml()
    procfs = install_procfs(tmp_path / "proc")
    root = install_driver_root(tmp_path / "driver-root")
    mock.configure("dgxh100:3", proc_root=procfs)
    mock.control(f"mig {STATIC_GPU} 1")
    mock.control(f"create-gi {STATIC_GPU} {THREE_G_PROFILE_ID} 0")
    mock.control(f"create-ci {STATIC_GPU} 1 {THREE_SLICE_COMPUTE_PROFILE}")
    (tmp_path / "boot_id").write_text(f"{uuid.uuid4()}\n")
    backends: list[NvmlBackend] = []

    def load_nvml() -> NvmlBackend:
        backends.append(
            NvmlBackend(procfs_root=procfs, dev_root=root, driver_root=root, state_dir=tmp_path / "state")
        )
        return backends[-1]

    node = Node(tmp_path, load_nvml(), InMemoryClaims(), RecordingObserver())  # type: ignore[arg-type]
    yield NvmlNode(node, lambda: setattr(node, "backend", load_nvml()))
    for backend in backends:
        backend.close()


@pytest.mark.parametrize("device", ["gpu-2", NVML_NODE.static_mig])
@pytest.mark.parametrize("admin_uid", [FIRST_UID, LAST_UID])
async def test_the_reviews_sequence_keeps_the_device_with_its_workload_on_nvml(
    nvml_node: NvmlNode, admin_uid: str, device: str
) -> None:
    """Issue 20's sequence (see test_state_model) on the NVML backend: nobody else gets the device."""
    await the_reviews_sequence(nvml_node.node, device, admin_uid, nvml_node.restart)


async def test_a_mig_device_made_through_nvml_goes_with_its_unprepare_after_the_state_was_lost(
    nvml_node: NvmlNode,
) -> None:
    device = f"gpu-0-mig-1g10gb-0-{NVML_ONE_G_START}"
    await a_mig_device_goes_with_its_claim_after_the_state_was_lost(nvml_node.node, device, nvml_node.restart)
