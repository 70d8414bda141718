"""The node's GPUs as DRA devices: the pure mapping from an Inventory to resource.k8s.io/v1.

Per physical GPU, in this order:

* the full GPU ``gpu-<minor>``, unless MIG mode is on (then CUDA cannot use it whole);
* MIG devices that exist and that the driver did not create ("static MIG", made by an
  administrator), as concrete devices with their ``uuid``;
* when the GPU offers partitions ("dynamic MIG"), one device per placement that can still be
  created, each consuming its profile's share and exactly its memory slices from the GPU's
  counter set; the full GPU then consumes every counter of that set.

With passthrough on, a GPU in an IOMMU group whose MIG mode is off also has a passthrough device,
``gpu-vfio-<index>`` (NVIDIA's name and attributes, ``type`` ``vfio``): the GPU on vfio-pci for a
virtual machine. It consumes every counter of the GPU's counter set, as the full GPU does, so the
scheduler never allocates it beside the full GPU or a MIG device of it; a GPU that offers no
partitions gets a counter set of its memory alone for that, which its full GPU consumes too.

With consumable capacity on, the full GPU is shareable (``allowMultipleAllocations``, memory
and SMs with request policies: :mod:`dra_driver.resources.capacity`); it keeps its counters.

Static MIG devices stay outside the counter set: they occupy their slices whether or not
anyone allocated them, so counting them only when allocated would let the scheduler hand
out a placement on top of one. Instead the placements that overlap them (or exceed their
profile's instance count) are not offered at all, and the capacities are those of the rest.
MIG devices the driver created itself are published as their placement, under the same name,
so an allocated device keeps its name and its counter accounting.

With binding conditions on (KEP-5007, :mod:`dra_driver.node.binding`), each placement to create
says so: ``bindingConditions: [Ready]`` and ``bindingFailureConditions: [PrepareFailed]``, so that
the scheduler binds a pod only once its MIG device exists; with share binding conditions on too,
so does a shareable full GPU (consumable capacity), whose shares are MPS clients: a pod is bound
only once the GPU's MPS control daemon runs. Other full GPUs and existing MIG devices need no
preparation that can fail after allocation and get none: the scheduler prefers them.

Attribute names are NVIDIA's (unqualified, i.e. in the driver's domain), so CEL written for
NVIDIA's driver works when this one is deployed under that driver name.

Topology (:mod:`dra_driver.devices.topology`): every device carries the standard
``resource.kubernetes.io/numaNode`` and ``pcieRoot``; a full GPU also carries the groups it shares
fast paths with -- ``nvlinkIsland``, ``nvlinkClique`` and ``pcieSwitch`` -- so that a claim's
``matchAttribute`` picks GPUs on one NVLink island or PCIe switch. MIG devices do not get those:
MIG has no peer-to-peer between GPUs, and a MIG device's attributes and capacities are already
near the API's 32.
"""

from __future__ import annotations

import re
import uuid as uuid_module
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

from dra_driver.devices.pci import PassthroughGpu
from dra_driver.devices.topology import nvlink_islands
from dra_driver.devices.types import FabricState, Gpu, Inventory, MigDevice, MigProfile, Placement
from dra_driver.resources.capacity import consumable_capacity, share_policy
from dra_driver.resources.device_names import (
    counter_set_name,
    gpu_device_name,
    maintenance_device_name,
    memory_slice_counter,
    mig_device_name,
    passthrough_device_name,
    require_dns_label,
)
from dra_driver.resources.partitions import ENGINE_COUNTERS, gpu_totals, partition_budget, profile_share
from dra_driver.resources.wire import (
    Counter,
    CounterSet,
    Device,
    DeviceAttribute,
    DeviceCapacity,
    DeviceCounterConsumption,
    DeviceTaint,
)

PCI_BUS_ID = "resource.kubernetes.io/pciBusID"
PCIE_ROOT = "resource.kubernetes.io/pcieRoot"
NUMA_NODE = "resource.kubernetes.io/numaNode"  # standard from Kubernetes 1.37; NVIDIA's driver has it
NVLINK_ISLAND = "nvlinkIsland"
NVLINK_CLIQUE = "nvlinkClique"
PCIE_SWITCH = "pcieSwitch"
# NVIDIA's driver published the bus id under its own domain up to v25.8; claims may still use it.
LEGACY_PCIE_BUS_ID = "pcieBusID"
# The device conditions of KEP-5007 that the plugin reports in the claim's status.devices.
READY_CONDITION = "Ready"  # the type the API's own docs name for a configured device
FAILED_CONDITION = "PrepareFailed"
DEVICE_TAINTS_MAX = 16  # per device, API limit
ATTRIBUTES_AND_CAPACITIES_MAX = 32  # per device, API limit

VERSION_MAX_LENGTH = 64  # API limit for string and version attribute values
_NUMERIC_VERSION = re.compile(r"[0-9]+(\.[0-9]+){0,2}")


def semver(version: str) -> str:
    """A dotted numeric version as semver 2.0.0: ``"580.95.05"`` -> ``"580.95.5"``, ``"13"`` -> ``"13.0.0"``.

    The API only accepts semver in version attributes, and semver forbids leading zeros,
    which NVIDIA driver versions have. Missing minor or patch parts become 0.
    """
    if not _NUMERIC_VERSION.fullmatch(version):
        raise ValueError(
            f"cannot publish version {version!r}: expected one to three dot-separated numbers, "
            "e.g. '580.95.05'"
        )
    parts = [str(int(part)) for part in version.split(".")]
    result = ".".join(parts + ["0"] * (3 - len(parts)))
    if len(result) > VERSION_MAX_LENGTH:
        raise ValueError(f"cannot publish version {version!r}: longer than {VERSION_MAX_LENGTH} characters")
    return result


PartitionPolicy = Callable[[Gpu], bool]
"""Decides which MIG-capable GPUs offer dynamic MIG partitions."""


def partition_all(gpu: Gpu) -> bool:
    """Every GPU whose hardware allows it offers partitions."""
    return True


def partition_none(gpu: Gpu) -> bool:
    """No GPU offers partitions (MIG publishing disabled)."""
    return False


def partition_mig_mode(gpu: Gpu) -> bool:
    """Only the GPUs whose MIG mode is on offer partitions: the driver never switches it on.

    A GPU in MIG mode offers no full GPU, and a GPU with MIG mode off offers no placements, so no
    full GPU consumes counters: an admin-access claim for a full GPU that a workload holds is then
    allocatable on Kubernetes 1.37, which charges admin-access claims against counters
    (kubernetes/kubernetes#140729).
    """
    return gpu.mig_enabled


def partition_selected(ids: Collection[str]) -> PartitionPolicy:
    """Only the GPUs named in ``ids`` by UUID or by minor number ("0") offer partitions."""
    wanted = frozenset(ids)
    return lambda gpu: gpu.uuid in wanted or str(gpu.minor) in wanted


@dataclass(frozen=True)
class GpuDevices:
    """Everything one physical GPU contributes to the pool."""

    devices: tuple[Device, ...]
    # Present when the GPU offers partitions; its devices consume from it.
    counter_set: CounterSet | None = None


def build_devices(
    inventory: Inventory,
    *,
    partition: PartitionPolicy = partition_all,
    owned_mig_uuids: Collection[str] = frozenset(),
    taints: Mapping[str, Sequence[DeviceTaint]] | None = None,
    maintenance: bool = False,
    consumable: bool = False,
    passthrough: Mapping[str, PassthroughGpu] | None = None,
    binding_conditions: bool = False,
    share_binding_conditions: bool = False,
) -> list[GpuDevices]:
    """The devices of every GPU in ``inventory``, ordered by minor number.

    ``partition`` selects the GPUs that offer dynamic MIG; a GPU offers it only when the
    hardware also allows it (see :func:`offers_partitions`). ``owned_mig_uuids`` are the MIG
    devices the driver created for claims; every other MIG device is static. ``taints`` maps a
    device name to the taints to publish on it (names not published here are ignored).
    ``maintenance`` adds each GPU's maintenance device (see :func:`maintenance_device`).
    ``consumable`` makes every full GPU shareable (see :func:`shareable`). ``passthrough`` maps
    the PCI address of each GPU that can be passed through to its passthrough details; those
    GPUs get a passthrough device (see :func:`passthrough_device`) while their MIG mode is off.
    ``binding_conditions`` gives every placement to create the binding conditions of the module doc,
    ``share_binding_conditions`` every shareable GPU.
    """
    result: list[GpuDevices] = []
    islands = nvlink_islands(inventory.gpus)
    for gpu in sorted(inventory.gpus, key=lambda g: g.minor):
        gpu_devices = _gpu_devices(
            inventory,
            gpu,
            partition(gpu) and offers_partitions(gpu),
            owned_mig_uuids,
            islands.get(gpu.uuid),
            binding_conditions,
        )
        place = (passthrough or {}).get(gpu.pci_bus_id)
        if place is not None and not gpu.mig_enabled and not gpu.mig_devices:
            gpu_devices = _with_passthrough(gpu, gpu_devices, place)
        if consumable:
            gpu_devices = GpuDevices(
                devices=tuple(
                    shareable(gpu, device, share_binding_conditions)
                    if device["name"] == gpu_device_name(gpu.minor)
                    else device
                    for device in gpu_devices.devices
                ),
                counter_set=gpu_devices.counter_set,
            )
        if maintenance:
            gpu_devices = GpuDevices(
                devices=(*gpu_devices.devices, maintenance_device(inventory, gpu)),
                counter_set=gpu_devices.counter_set,
            )
        if taints:
            gpu_devices = GpuDevices(
                devices=tuple(
                    _with_taints(device, taints.get(device["name"], ())) for device in gpu_devices.devices
                ),
                counter_set=gpu_devices.counter_set,
            )
        result.append(gpu_devices)
    _check_unique_names(result)
    return result


def offers_partitions(gpu: Gpu) -> bool:
    """Whether placements on ``gpu`` could be created at prepare time.

    That needs MIG mode on, or a GPU that can switch it on without a reset (Hopper and newer):
    an Ampere GPU with MIG off would need a reset, which the driver never does under a node.
    """
    return (
        gpu.mig_capable
        and bool(gpu.mig_profiles)
        and (gpu.mig_enabled or not gpu.mig_mode_change_requires_reset)
    )


def _gpu_devices(
    inventory: Inventory,
    gpu: Gpu,
    partitioned: bool,
    owned: Collection[str],
    island: str | None,
    binding_conditions: bool,
) -> GpuDevices:
    common = _common_attributes(inventory, gpu)
    links = _link_attributes(gpu, island)
    static = tuple(m for m in gpu.mig_devices if not (partitioned and m.uuid in owned))
    static_devices = tuple(
        _mig_device(gpu, _profile_of(gpu, m), m.placement, common, uuid=m.uuid) for m in static
    )
    if not partitioned:
        whole = () if gpu.mig_enabled else (_full_gpu(gpu, common | links),)
        return GpuDevices(devices=whole + static_devices)

    taken = [(m.profile, m.placement) for m in static] + list(gpu.reserved_placements)
    totals = gpu_totals(gpu)
    budget = partition_budget(gpu.mig_profiles, gpu.memory_slices, totals, taken)
    if not budget.offered:
        return GpuDevices(devices=static_devices)
    # The full GPU, when offered, consumes everything the GPU has; every MIG layout fits in that.
    capacities = dict(budget.capacities) if gpu.mig_enabled else totals
    counter_set: CounterSet = {
        "name": require_dns_label(counter_set_name(gpu.minor), "counter set name"),
        "counters": {
            **{name: _counter(capacities[name]) for name in ENGINE_COUNTERS},
            **{memory_slice_counter(i): _counter(1) for i in range(gpu.memory_slices)},
        },
    }
    devices: list[Device] = []
    if not gpu.mig_enabled:
        full = _full_gpu(gpu, common | links)
        full["consumesCounters"] = [
            {"counterSet": counter_set["name"], "counters": dict(counter_set["counters"])}
        ]
        devices.append(full)
    devices.extend(static_devices)
    for profile, placement in budget.offered:
        device = _mig_device(gpu, profile, placement, common, uuid=None)
        share = profile_share(profile)
        device["consumesCounters"] = [
            {
                "counterSet": counter_set["name"],
                "counters": {
                    **{name: _counter(share[name]) for name in ENGINE_COUNTERS},
                    **{memory_slice_counter(i): _counter(1) for i in placement.memory_slices},
                },
            }
        ]
        if binding_conditions:
            device["bindingConditions"] = [READY_CONDITION]
            device["bindingFailureConditions"] = [FAILED_CONDITION]
        devices.append(device)
    return GpuDevices(devices=tuple(devices), counter_set=counter_set)


PASSTHROUGH_TYPE = "vfio"  # NVIDIA's: its DeviceClass vfio.gpu.nvidia.com selects it


def passthrough_device(gpu: Gpu, place: PassthroughGpu) -> Device:
    """``gpu-vfio-<index>``: the GPU bound to vfio-pci for a virtual machine, as NVIDIA's driver has it.

    Its ``uuid`` is NVIDIA's too, a name-based UUID of the PCI address (the GPU's own uuid is
    NVML's, which cannot be read while the GPU is on vfio-pci), and so is its ``addressableMemory``
    capacity: the size of the GPU's 64-bit memory BARs as sysfs gives them, which a VM's firmware
    must map (:meth:`~dra_driver.devices.pci.PciBus.addressable_memory`).
    """
    attributes: dict[str, DeviceAttribute] = {
        "type": {"string": PASSTHROUGH_TYPE},
        "uuid": {"string": str(uuid_module.uuid5(uuid_module.NAMESPACE_DNS, place.address))},
        "deviceID": {"string": f"0x{gpu.pci_device_id:04x}"},
        "vendorID": {"string": f"0x{gpu.pci_vendor_id:04x}"},
        "productName": {"string": gpu.product_name},
        "iommuFDEnabled": {"bool": place.iommufd},
        PCI_BUS_ID: {"string": place.address},
    }
    if gpu.pcie_root:
        attributes[PCIE_ROOT] = {"string": gpu.pcie_root}
    if gpu.numa_node is not None:
        attributes[NUMA_NODE] = {"int": gpu.numa_node}
    return {
        "name": require_dns_label(passthrough_device_name(place.index), "device name"),
        "attributes": attributes,
        "capacity": (
            {"addressableMemory": _capacity(place.addressable_memory)}
            if place.addressable_memory is not None
            else {}
        ),
    }


def _with_passthrough(gpu: Gpu, devices: GpuDevices, place: PassthroughGpu) -> GpuDevices:
    """``devices`` and the GPU's passthrough device, which consumes its whole counter set."""
    counter_set = devices.counter_set
    found = list(devices.devices)
    if counter_set is None:
        counter_set = {
            "name": require_dns_label(counter_set_name(gpu.minor), "counter set name"),
            "counters": {"memory": _counter(gpu.memory_bytes)},
        }
        whole = gpu_device_name(gpu.minor)
        found = [
            {**device, "consumesCounters": [_all_of(counter_set)]} if device["name"] == whole else device
            for device in found
        ]
    device = passthrough_device(gpu, place)
    device["consumesCounters"] = [_all_of(counter_set)]
    return GpuDevices(devices=(*found, device), counter_set=counter_set)


def _all_of(counter_set: CounterSet) -> DeviceCounterConsumption:
    return {"counterSet": counter_set["name"], "counters": dict(counter_set["counters"])}


def _common_attributes(inventory: Inventory, gpu: Gpu) -> dict[str, DeviceAttribute]:
    """What a full GPU and its MIG devices both carry: product, versions, PCI identity."""
    major, minor = gpu.cuda_compute_capability
    cuda_major, cuda_minor = inventory.cuda_driver_version
    attributes: dict[str, DeviceAttribute] = {
        "productName": {"string": gpu.product_name},
        "brand": {"string": gpu.brand},
        "architecture": {"string": gpu.architecture},
        "cudaComputeCapability": {"version": semver(f"{major}.{minor}")},
        "driverVersion": {"version": semver(inventory.driver_version)},
        "cudaDriverVersion": {"version": semver(f"{cuda_major}.{cuda_minor}")},
        "vendor": {"string": "NVIDIA"},
        "pciVendorID": {"string": f"0x{gpu.pci_vendor_id:04x}"},
        "pciDeviceID": {"string": f"0x{gpu.pci_device_id:04x}"},
    }
    if gpu.pci_bus_id:
        attributes[PCI_BUS_ID] = {"string": gpu.pci_bus_id}
        attributes[LEGACY_PCIE_BUS_ID] = {"string": gpu.pci_bus_id}
    if gpu.pcie_root:
        attributes[PCIE_ROOT] = {"string": gpu.pcie_root}
    if gpu.numa_node is not None:
        attributes[NUMA_NODE] = {"int": gpu.numa_node}
    if gpu.addressing_mode:
        attributes["addressingMode"] = {"string": gpu.addressing_mode}
    return attributes


def _link_attributes(gpu: Gpu, island: str | None) -> dict[str, DeviceAttribute]:
    """The fast paths a full GPU shares with others: NVLink island and clique, PCIe switch."""
    attributes: dict[str, DeviceAttribute] = {}
    if island:
        attributes[NVLINK_ISLAND] = {"string": island}
    fabric = gpu.fabric
    if fabric is not None and fabric.state is FabricState.COMPLETED and fabric.status == "Success":
        attributes[NVLINK_CLIQUE] = {"string": fabric.clique}
    if gpu.pcie_switch:
        attributes[PCIE_SWITCH] = {"string": gpu.pcie_switch}
    return attributes


def shareable(gpu: Gpu, device: Device, binding_conditions: bool = False) -> Device:
    """The full GPU ``device`` with consumable memory and SMs; unchanged if ``gpu`` is too small.

    With ``binding_conditions``, a share waits for its GPU's MPS control daemon, which the node
    starts ahead of the binding (the module doc)."""
    policy = share_policy(gpu)
    if policy is None:
        return device
    shared: Device = {
        **device,
        "capacity": consumable_capacity(policy, device["capacity"]),
        "allowMultipleAllocations": True,
    }
    if binding_conditions:
        shared["bindingConditions"] = [READY_CONDITION]
        shared["bindingFailureConditions"] = [FAILED_CONDITION]
    return shared


MAINTENANCE_TYPE = "maintenance"


def maintenance_device(inventory: Inventory, gpu: Gpu) -> Device:
    """``gpu-<minor>-maintenance``: the whole GPU for admin access, consuming no counters.

    The Kubernetes 1.37 scheduler counts an admin-access claim against the shared counters it
    consumes (kubernetes/kubernetes#140729), so admin access to a GPU whose counters a workload
    holds (any of its MIG devices, or the GPU itself) waits for the workload. This device stands
    for the same GPU without counters. It must never reach an ordinary claim, which would then share
    the GPU unaccounted: its ``type`` is one no ordinary DeviceClass selects, the chart's admission
    policy refuses any request for its class without ``adminAccess``, and prepare refuses it too.
    """
    attributes: dict[str, DeviceAttribute] = {
        "type": {"string": MAINTENANCE_TYPE},
        "uuid": {"string": gpu.uuid},
        **_common_attributes(inventory, gpu),
    }
    return {
        "name": require_dns_label(maintenance_device_name(gpu.minor), "device name"),
        "attributes": attributes,
        "capacity": {"memory": _capacity(gpu.memory_bytes)},
    }


def _full_gpu(gpu: Gpu, common: dict[str, DeviceAttribute]) -> Device:
    """The whole GPU, with what it has (:func:`gpu_totals`): what its counter-set consumption is too.

    NVIDIA's driver (with its DynamicMIG gate) gives a MIG-capable GPU the largest of each engine
    count its profiles have, as this one does; its memory and SMs are the GPU's own, where
    NVIDIA's are the largest profile's too (the same on hardware, not on every NVML table).
    """
    totals = gpu_totals(gpu)
    capacity = {
        "memory": _capacity(totals["memory"]),
        "multiprocessors": _capacity(totals["multiprocessors"]),
    }
    if gpu.mig_profiles:
        capacity |= {name: _capacity(totals[counter]) for counter, name in _ENGINE_CAPACITIES.items()}
    return {
        "name": require_dns_label(gpu_device_name(gpu.minor), "device name"),
        "attributes": _full_gpu_attributes(gpu, common),
        "capacity": capacity,
    }


def _full_gpu_attributes(gpu: Gpu, common: dict[str, DeviceAttribute]) -> dict[str, DeviceAttribute]:
    return {"type": {"string": "gpu"}, "uuid": {"string": gpu.uuid}, **common}


# Engine counter -> the capacity that carries its count on a device (counters are DNS labels).
_ENGINE_CAPACITIES: dict[str, str] = {
    "copy-engines": "copyEngines",
    "decoders": "decoders",
    "encoders": "encoders",
    "jpeg-engines": "jpegEngines",
    "ofa-engines": "ofaEngines",
}


def _mig_device(
    gpu: Gpu,
    profile: MigProfile,
    placement: Placement,
    common: dict[str, DeviceAttribute],
    *,
    uuid: str | None,
) -> Device:
    """A MIG device: an existing one when ``uuid`` is given, else a placement to create on demand."""
    attributes = _mig_attributes(gpu, profile, common, uuid)
    name = mig_device_name(gpu.minor, profile.name, profile.profile_id, placement.start)
    capacity = {
        "multiprocessors": _capacity(profile.multiprocessors),
        "copyEngines": _capacity(profile.copy_engines),
        "decoders": _capacity(profile.decoders),
        "encoders": _capacity(profile.encoders),
        "jpegEngines": _capacity(profile.jpeg_engines),
        "ofaEngines": _capacity(profile.ofa_engines),
        "memory": _capacity(profile.memory_bytes),
    }
    if uuid is not None:
        # As NVIDIA's driver does for a MIG device that exists: the memory slices it occupies.
        capacity |= {f"memorySlice{i}": _capacity(1) for i in placement.memory_slices}
    if len(attributes) + len(capacity) > ATTRIBUTES_AND_CAPACITIES_MAX:
        # Only an existing full-size MIG device on a Grace GPU (addressingMode) gets here. The legacy
        # bus id goes first: the standard pciBusID beside it has the same value.
        del attributes[LEGACY_PCIE_BUS_ID]
    name = require_dns_label(name, "MIG device name")
    return {"name": name, "attributes": attributes, "capacity": capacity}


def _mig_attributes(
    gpu: Gpu, profile: MigProfile, common: dict[str, DeviceAttribute], uuid: str | None
) -> dict[str, DeviceAttribute]:
    attributes: dict[str, DeviceAttribute] = {"type": {"string": "mig"}}
    if uuid is not None:
        attributes["uuid"] = {"string": uuid}
    return attributes | {"profile": {"string": profile.name}, "parentUUID": {"string": gpu.uuid}, **common}


def device_attributes(
    inventory: Inventory,
    gpu: Gpu,
    *,
    mig: tuple[MigProfile, str | None] | None = None,
    maintenance: bool = False,
) -> dict[str, DeviceAttribute]:
    """The attributes the pool publishes for one device of ``gpu``, for its device metadata (KEP-5304).

    The whole GPU; with ``mig`` (its profile, and its uuid once it exists) a MIG device of it; with
    ``maintenance`` its maintenance device. A MIG placement the driver created gets the uuid it
    has now, which its published placement lacks: the container needs it, the slice did not.
    """
    if maintenance:
        return dict(maintenance_device(inventory, gpu)["attributes"])
    common = _common_attributes(inventory, gpu)
    if mig is not None:
        profile, uuid = mig
        return _mig_attributes(gpu, profile, common, uuid)
    return _full_gpu_attributes(
        gpu, common | _link_attributes(gpu, nvlink_islands(inventory.gpus).get(gpu.uuid))
    )


def _profile_of(gpu: Gpu, mig: MigDevice) -> MigProfile:
    profile = gpu.profile(mig.profile)
    if profile is None:
        raise ValueError(
            f"MIG device {mig.uuid} on GPU {gpu.uuid} has profile {mig.profile!r}, which the GPU does "
            "not list among its MIG profiles; the device backend must report every profile"
        )
    return profile


def _with_taints(device: Device, taints: Sequence[DeviceTaint]) -> Device:
    if not taints:
        return device
    if len(taints) > DEVICE_TAINTS_MAX:
        raise ValueError(
            f"device {device['name']} has {len(taints)} taints; the API allows at most {DEVICE_TAINTS_MAX}"
        )
    return {**device, "taints": list(taints)}


def _check_unique_names(gpus: Sequence[GpuDevices]) -> None:
    seen: set[str] = set()
    for gpu in gpus:
        for device in gpu.devices:
            if device["name"] in seen:
                raise ValueError(
                    f"two devices are both named {device['name']!r}; GPU minor numbers must be unique "
                    "on a node, check what the device backend reports"
                )
            seen.add(device["name"])


def _capacity(value: int) -> DeviceCapacity:
    return {"value": str(value)}


def _counter(value: int) -> Counter:
    return {"value": str(value)}
