"""What preparing a claim means on this node: a pure function of the claim and the inventory.

:func:`plan_claim` resolves every allocated device name to the hardware behind it,
decides each device's effective opaque config, and computes the claim's CDI spec. It
touches nothing, so everything that can be wrong with a claim is found before the
first side effect; the preparer then only records, creates and writes what the plan says.

A device name resolves to one of three things (names follow
:mod:`dra_driver.resources.device_names`, the rule the published slices use):

* a full GPU, ``gpu-<minor>``: refused while the GPU has MIG devices, because CUDA
  cannot use it whole then;
* a MIG device that exists: a static one an administrator made, or one this driver
  made earlier for the same claim (a repeated prepare uses it again);
* a MIG placement to create (dynamic MIG), only on a GPU that offers partitions (the
  same rule that publishes them). Its CDI spec needs the new device's uuid and
  capability nodes, so the plan's spec is complete once :meth:`ClaimPlan.with_created`
  has been given every created device.

A passthrough device, ``gpu-vfio-<index>`` (NVIDIA's name: the GPU's place in PCI order), resolves
to its GPU while that GPU is on the nvidia driver with MIG mode off; the preparer binds it to
vfio-pci. Its CDI device gives ``/dev/vfio/<group>`` (numbers left to the runtime: the kernel
picks them when the group appears) and announces ``DRA_GPU_PASSTHROUGH_<DEVICE>=<gpu>,<address>``,
which tells recovery which GPU to bind back should the store be lost. The claim's spec then holds
no driver files, hooks or control nodes (the VM's process gets no NVIDIA driver); with
``iommu.enableAPIDevice`` it gets ``/dev/vfio/vfio``. Under ``PreferIommuFD`` on a kernel with
IOMMUFD the device is its cdev ``/dev/vfio/devices/vfio<N>`` and the API device ``/dev/iommu``;
the cdev is named once the GPU is on vfio-pci, so such a plan's spec is complete after
:meth:`ClaimPlan.with_cdev`. A claim holds passthrough devices only,
as NVIDIA's driver has it: a VM and a CUDA container do not share a claim.

A result with a ``shareID`` is a share of a full GPU published with consumable capacity
(:mod:`dra_driver.node.shares`): it is checked against the GPU's request policy and, unless it
takes the whole GPU, prepared with MPS limited to what it consumed. Its CDI device carries the
share id in its name, so the shares of one GPU never collide.

With device metadata on (``--device-metadata``, :mod:`dra_driver.cdi.metadata`) the plan also holds
each request's metadata file, listing its devices with the attributes the pool publishes for them,
and every device of the request mounts that file in the spec.

Whether a placement overlaps a live instance is not decided here: the inventory may
be seconds old, and the hardware refuses an overlap when the device is created.

Admin access (a monitoring or maintenance pod in a namespace labelled
``resource.kubernetes.io/admin-access: "true"``) resolves like any other allocation but
never to a MIG device to create. A GPU's maintenance device, ``gpu-<minor>-maintenance``
(``dra_driver.resources.devices.maintenance_device``), resolves to the whole GPU, for
admin access only, also in MIG mode. Either way admin access looks at a device some
workload may be using, so it gets that device as it is, announced by
``DRA_GPU_ADMIN_ACCESS_<DEVICE>=true`` (which also tells recovery, should the store be lost).
The store does not count it against the device (:mod:`dra_driver.node.store`), so unpreparing
it leaves the workload's claim alone.

What the sharing settings do. They are validated here (also against the device, e.g. an
MPS memory limit larger than the device), and announced to the container, per device, as
environment variables::

    DRA_GPU_SHARING_STRATEGY_<DEVICE>=Exclusive|TimeSlicing|MPS
    DRA_GPU_TIME_SLICE_INTERVAL_<DEVICE>=Default|Short|Medium|Long       (TimeSlicing, full GPUs)
    DRA_GPU_MPS_ACTIVE_THREAD_PERCENTAGE_<DEVICE>=<1-100>               (MPS, when set)
    DRA_GPU_MPS_PINNED_DEVICE_MEMORY_LIMIT_<DEVICE>=<bytes>             (MPS, when set)

(``<DEVICE>`` as in the CDI spec's ``DRA_GPU_UUID_<DEVICE>``: ``gpu-0`` -> ``GPU_0``;
per device, because a container may hold devices with different settings.) What they
change on the GPU -- compute mode and time slice, and an MPS control daemon per claim
whose pipe and shm directories and ``CUDA_MPS_*`` limits every container gets --
is planned by :mod:`dra_driver.node.sharing.policy` from this plan, before anything is
changed, and applied and undone by :mod:`dra_driver.node.sharing.applier`
(docs/sharing.md).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path

from dra_driver.cdi.metadata import (
    MOUNT_OPTIONS,
    ClaimIdentity,
    MetadataDevice,
    base_request,
    container_path,
    host_path,
    metadata_stream,
)
from dra_driver.cdi.spec import (
    UUID_ENV_PREFIX,
    CdiDevice,
    CommonEdits,
    Mount,
    cdi_device_id,
    claim_spec,
    uuid_env_name,
)
from dra_driver.cdi.validate import ValidSpec
from dra_driver.devices.pci import PassthroughGpu
from dra_driver.devices.types import DeviceNode, Gpu, Inventory, MigDevice, MigProfile, Placement
from dra_driver.names import is_dns_label
from dra_driver.node.api_base import quantity_bytes
from dra_driver.node.claims import (
    AllocatedClaim,
    AllocationResult,
    ClaimRejected,
    ConfigSource,
    OpaqueConfig,
)
from dra_driver.node.config import (
    DEFAULT_GPU_CONFIG,
    DEFAULT_MIG_CONFIG,
    DEFAULT_VFIO_CONFIG,
    AnyConfig,
    ConfigError,
    Decoded,
    DeviceConfig,
    GpuConfig,
    GpuSharing,
    MigDeviceConfig,
    MigSharing,
    VfioDeviceConfig,
    decode_entry,
    winning_configs,
)
from dra_driver.node.shares import Share, pooled, share_config, share_of
from dra_driver.resources.device_names import (
    PASSTHROUGH_PREFIX,
    gpu_device_name,
    maintenance_device_name,
    mig_device_name,
    passthrough_device_name,
)
from dra_driver.resources.devices import (
    PartitionPolicy,
    device_attributes,
    offers_partitions,
    partition_all,
    passthrough_device,
)

ADMIN_ACCESS_ENV_PREFIX = "DRA_GPU_ADMIN_ACCESS_"
MIG_CREATED_ENV_PREFIX = "DRA_GPU_MIG_CREATED_"
PASSTHROUGH_ENV_PREFIX = "DRA_GPU_PASSTHROUGH_"
VFIO_CONTAINER = DeviceNode("/dev/vfio/vfio", 10, 196)  # a misc device: its numbers are fixed
IOMMU_DEVICE = DeviceNode("/dev/iommu", None, None)  # a misc device with a dynamic minor


@dataclass(frozen=True)
class MetadataSource:
    """What a claim's device metadata files (KEP-5304) need beyond the claim itself.

    ``plugin_dir`` is the driver's kubelet plugin directory, under which the files go;
    ``inventory`` gives each device the attributes the pool publishes for it.
    """

    plugin_dir: Path
    inventory: Inventory


@dataclass(frozen=True)
class MigPlacement:
    """A MIG device that prepare creates: a GPU instance of ``profile`` at exactly ``placement``."""

    profile: MigProfile
    placement: Placement


@dataclass(frozen=True)
class Target:
    """The hardware an allocated device name stands for.

    A full GPU (``mig`` and ``create`` unset); an existing MIG device (``mig``); or a MIG
    device the driver creates (``create``; ``mig`` too once it exists).
    """

    gpu: Gpu
    mig: MigDevice | None = None
    create: MigPlacement | None = None
    passthrough: PassthroughGpu | None = None  # the GPU bound to vfio-pci for a virtual machine

    @property
    def is_mig(self) -> bool:
        return self.mig is not None or self.create is not None

    @property
    def uuid(self) -> str:
        if self.create is not None and self.mig is None:
            raise ValueError(f"the MIG device on GPU {self.gpu.uuid} is not created yet; it has no uuid")
        return self.mig.uuid if self.mig else self.gpu.uuid

    @property
    def memory_bytes(self) -> int:
        if self.create is not None:
            return self.create.profile.memory_bytes
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
    share: Share | None = None  # a share of the GPU (consumable capacity)
    vfio: VfioDeviceConfig | None = None  # a passthrough device's effective config
    cdev: str | None = None  # its IOMMUFD cdev (/dev/vfio/devices/vfio<N>), once the GPU is on vfio-pci

    @property
    def iommufd(self) -> bool:
        """Whether the container gets the IOMMUFD cdev: PreferIommuFD, on a kernel that has IOMMUFD."""
        place = self.target.passthrough
        return (
            place is not None
            and place.iommufd
            and self.vfio is not None
            and self.vfio.iommu.backend_policy == "PreferIommuFD"
        )


@dataclass(frozen=True)
class ClaimPlan:
    claim: AllocatedClaim
    devices: tuple[PlannedDevice, ...]  # one per allocation result of ours, in allocation order
    driver_name: str
    common: CommonEdits
    metadata: MetadataSource | None = None  # device metadata on (--device-metadata)

    @property
    def to_create(self) -> dict[str, tuple[Gpu, MigPlacement]]:
        """The MIG devices still to create, by device name (results sharing one device share it)."""
        return {
            d.result.device: (d.target.gpu, d.target.create)
            for d in self.devices
            if d.target.create is not None and d.target.mig is None
        }

    def with_created(self, device: str, mig: MigDevice) -> ClaimPlan:
        """This plan once the MIG device for ``device`` exists."""
        return replace(
            self,
            devices=tuple(
                replace(d, target=replace(d.target, mig=mig)) if d.result.device == device else d
                for d in self.devices
            ),
        )

    @property
    def to_bind(self) -> tuple[str, ...]:
        """Passthrough devices whose IOMMUFD cdev is named only once their GPU is on vfio-pci."""
        return tuple(d.result.device for d in self.devices if d.iommufd and d.cdev is None)

    def with_cdev(self, device: str, cdev: str) -> ClaimPlan:
        """This plan once the GPU of passthrough ``device`` is on vfio-pci with ``cdev``."""
        return replace(
            self,
            devices=tuple(replace(d, cdev=cdev) if d.result.device == device else d for d in self.devices),
        )

    def before_binding(self) -> ClaimPlan:
        """This plan before its GPUs are on vfio-pci, with a spec to name them (prepare writes it
        first): an IOMMUFD device has its group's node until :meth:`with_cdev` names the cdev."""
        return replace(
            self,
            devices=tuple(replace(d, cdev="") if d.iommufd and d.cdev is None else d for d in self.devices),
        )

    @cached_property
    def cdi_spec(self) -> ValidSpec:
        """The claim's CDI spec; ValueError while a MIG device is still to be created or a GPU bound."""
        if self.to_create or self.to_bind:
            raise ValueError(f"devices {', '.join((*self.to_create, *self.to_bind))} are not ready yet")
        # Two results naming one device (shares of one device) need only one CDI device.
        cdi_devices = list(
            dict.fromkeys(_cdi_device(device, self._metadata_mounts(device)) for device in self.devices)
        )
        try:
            return claim_spec(self.driver_name, self.claim.ref.uid, cdi_devices, self._spec_common())
        except ValueError as error:
            raise ClaimRejected(f"cannot build the CDI spec for claim {self.claim.ref}: {error}") from None

    @cached_property
    def metadata_files(self) -> dict[Path, bytes]:
        """The device metadata file of each request, by host path; none with metadata off.

        Each lists the request's devices with their published attributes (a MIG device the
        driver created with its uuid too); ValueError while a MIG device is still to be created.
        """
        if self.metadata is None:
            return {}
        if self.to_create:
            raise ValueError(f"MIG devices {', '.join(self.to_create)} are not created yet")
        by_request: dict[str, list[PlannedDevice]] = {}
        for device in self.devices:
            by_request.setdefault(device.result.request, []).append(device)
        identity = self._identity
        return {
            host_path(self.metadata.plugin_dir, identity, request): metadata_stream(
                identity, request, [self._metadata_device(d, self.metadata.inventory) for d in devices]
            )
            for request, devices in by_request.items()
        }

    @property
    def _identity(self) -> ClaimIdentity:
        ref = self.claim.ref
        return ClaimIdentity(ref.namespace, ref.name, ref.uid, self.claim.pod_claim_name)

    def _metadata_mounts(self, device: PlannedDevice) -> tuple[Mount, ...]:
        if self.metadata is None:
            return ()
        request = device.result.request
        return (
            Mount(
                str(host_path(self.metadata.plugin_dir, self._identity, request)),
                container_path(self.driver_name, self._identity, request),
                MOUNT_OPTIONS,
            ),
        )

    def _metadata_device(self, device: PlannedDevice, inventory: Inventory) -> MetadataDevice:
        target, gpu = device.target, device.target.gpu
        if target.passthrough is not None:  # what KubeVirt reads: the PCI address of the VM's GPU
            attributes = passthrough_device(gpu, target.passthrough)["attributes"]
        elif device.result.device == maintenance_device_name(gpu.minor):
            attributes = device_attributes(inventory, gpu, maintenance=True)
        elif target.is_mig:
            attributes = device_attributes(inventory, gpu, mig=(_profile(target), target.uuid))
        else:
            attributes = device_attributes(inventory, gpu)
        return MetadataDevice(self.driver_name, device.result.pool, device.result.device, attributes)

    @property
    def passthrough(self) -> tuple[PlannedDevice, ...]:
        """The passthrough devices: the GPUs to bind to vfio-pci (a claim holds only these, or none)."""
        return tuple(d for d in self.devices if d.target.passthrough is not None)

    def _spec_common(self) -> CommonEdits:
        """What every container of the claim gets: for a VM's passthrough devices no driver at all."""
        if not self.passthrough:
            return self.common
        api = any(d.vfio is not None and d.vfio.iommu.enable_api_device for d in self.passthrough)
        nodes = (IOMMU_DEVICE if any(d.iommufd for d in self.passthrough) else VFIO_CONTAINER,) if api else ()
        return CommonEdits(device_nodes=nodes, mounts=(), hooks=())


def plan_claim(
    claim: AllocatedClaim,
    inventory: Inventory,
    driver_name: str,
    common: CommonEdits,
    *,
    partition: PartitionPolicy = partition_all,
    mig_holders: Mapping[str, str] | None = None,
    consumable: bool = False,
    metadata: MetadataSource | None = None,
    passthrough: Mapping[str, PassthroughGpu] | None = None,
) -> ClaimPlan:
    """Everything preparing ``claim`` means; :class:`ClaimRejected` if any of it is impossible.

    ``partition`` is the policy that decides which GPUs publish MIG placements; only those
    get MIG devices created. ``mig_holders`` maps the uuid of every MIG device the driver
    created to the uid of the claim it was created for. ``consumable`` says whether full GPUs
    are published as shareable (``--consumable-capacity``); only then are shares prepared.
    ``metadata``, when given, adds each request's device metadata file (``--device-metadata``).
    ``passthrough`` maps the PCI address of each GPU that can be passed through to its details
    (``--passthrough``; None: off, and ``gpu-vfio-*`` names are refused).
    """
    if metadata is not None:
        _check_metadata_names(claim)
    holders = mig_holders or {}
    targets = {
        result: _resolve(result, claim.ref.uid, inventory, partition, holders, passthrough or {})
        for result in claim.results
    }
    vfio_results = [r for r in claim.results if targets[r].passthrough is not None]
    if vfio_results and len(vfio_results) != len(claim.results):
        others = ", ".join(r.device for r in claim.results if targets[r].passthrough is None)
        raise ClaimRejected(
            f"the claim holds passthrough devices ({', '.join(r.device for r in vfio_results)}) beside "
            f"{others}: a GPU passed through to a virtual machine shares no claim with devices for "
            "containers; use two claims"
        )
    try:
        decoded = [(entry, decode_entry(entry)) for entry in claim.configs]
    except ConfigError as error:
        raise ClaimRejected(str(error)) from None
    _check_config_kinds([(entry, d.config) for entry, d in decoded], claim.results, targets)
    gpu_results = [r for r in claim.results if not targets[r].is_mig and targets[r].passthrough is None]
    mig_results = [r for r in claim.results if targets[r].is_mig]
    chosen = winning_configs(
        vfio_results, [(e, d.config) for e, d in decoded if isinstance(d.config, VfioDeviceConfig)]
    )
    vfio_configs = {r: chosen[r][1] if r in chosen else DEFAULT_VFIO_CONFIG for r in vfio_results}
    winners = {
        **winning_configs(gpu_results, [(e, d) for e, d in decoded if isinstance(d.config, GpuConfig)]),
        **winning_configs(mig_results, [(e, d) for e, d in decoded if isinstance(d.config, MigDeviceConfig)]),
    }
    configs = _per_device_limits(claim.results, targets, winners)
    shares = _shares(claim.results, targets, consumable)
    # A share's strategy is the administrator's: what the class configs alone say (see shares.py).
    class_configs = winning_configs(
        gpu_results,
        [
            (e, d)
            for e, d in decoded
            if isinstance(d.config, GpuConfig) and e.source is ConfigSource.FROM_CLASS
        ],
    )
    devices = tuple(
        PlannedDevice(
            result=result,
            target=targets[result],
            config=_limited(
                result,
                targets[result],
                configs.get(result, DEFAULT_MIG_CONFIG if targets[result].is_mig else DEFAULT_GPU_CONFIG),
                shares,
                winners,
                class_configs,
            ),
            cdi_device_id=cdi_device_id(driver_name, claim.ref.uid, result.device, result.share_id),
            share=shares.get(result),
            vfio=vfio_configs.get(result),
        )
        for result in claim.results
    )
    for device in devices:
        _check_fits(device)
    plan = ClaimPlan(claim=claim, devices=devices, driver_name=driver_name, common=common, metadata=metadata)
    if not plan.to_create and not plan.to_bind:
        plan.cdi_spec  # noqa: B018 -- built now, so that a spec no runtime would accept rejects the claim
    return plan


def _profile(target: Target) -> MigProfile:
    """The profile of a MIG target: the one to create, or the existing device's (published, so known)."""
    if target.create is not None:
        return target.create.profile
    assert target.mig is not None  # a MIG target has one or the other
    profile = target.gpu.profile(target.mig.profile)
    if profile is None:
        raise ClaimRejected(
            f"MIG device {target.mig.uuid} has profile {target.mig.profile!r}, unknown to its GPU"
        )
    return profile


def _check_metadata_names(claim: AllocatedClaim) -> None:
    """Refuse names that cannot be a path segment of a metadata file (the API never makes them)."""
    names = {r.request: base_request(r.request) for r in claim.results}
    if claim.pod_claim_name is not None:
        names[claim.pod_claim_name] = claim.pod_claim_name
    if bad := sorted(name for name, segment in names.items() if not is_dns_label(segment)):
        raise ClaimRejected(
            f"claim {claim.ref}: {', '.join(map(repr, bad))} cannot name a device metadata file: request "
            "names and the pod's claim names are DNS labels; was the claim edited by hand?"
        )


def _shares(
    results: Sequence[AllocationResult], targets: Mapping[AllocationResult, Target], consumable: bool
) -> dict[AllocationResult, Share]:
    """Each share's limits: its own, or pooled with the claim's other shares of the same GPU."""
    own: dict[AllocationResult, Share] = {}
    for result in results:
        if result.share_id is None:
            continue
        target = targets[result]
        if target.is_mig or result.device != gpu_device_name(target.gpu.minor):
            raise ClaimRejected(
                f"device {result.device} was allocated as a share (shareID {result.share_id}), but only full "
                "GPUs are published as shareable; the claim was allocated from a stale ResourceSlice"
            )
        own[result] = share_of(result, target.gpu, consumable=consumable)
    by_gpu: dict[str, list[AllocationResult]] = {}
    for result in own:
        by_gpu.setdefault(result.device, []).append(result)
    return {
        result: pooled(own[r] for r in group) if len(group) > 1 else own[result]
        for group in by_gpu.values()
        for result in group
    }


def _limited(
    result: AllocationResult,
    target: Target,
    config: DeviceConfig,
    shares: Mapping[AllocationResult, Share],
    winners: Mapping[AllocationResult, tuple[OpaqueConfig, Decoded]],
    class_configs: Mapping[AllocationResult, tuple[OpaqueConfig, Decoded]],
) -> DeviceConfig:
    """``config``, or for a share that does not take the whole GPU its limited form."""
    share = shares.get(result)
    if share is None or share.whole:
        return config
    assert isinstance(config, GpuConfig)  # shares are of full GPUs only (see _shares)
    entry = winners[result][0] if result in winners else None
    admin = class_configs[result][1].config if result in class_configs else DEFAULT_GPU_CONFIG
    assert isinstance(admin, GpuConfig)  # class configs of full GPUs, chosen by kind above
    return share_config(
        result.device,
        target.gpu,
        share,
        config,
        entry.describe() if entry else None,
        admin=admin.sharing,
        from_claim=entry is not None and entry.source is ConfigSource.FROM_CLAIM,
    )


def _per_device_limits(
    results: Sequence[AllocationResult],
    targets: Mapping[AllocationResult, Target],
    winners: Mapping[AllocationResult, tuple[OpaqueConfig, Decoded]],
) -> dict[AllocationResult, DeviceConfig]:
    """Each result's config, with NVIDIA's ``defaultPerDevicePinnedMemoryLimit`` applied.

    As in NVIDIA's driver, a key is the uuid of one of the devices the config applies to, or
    its index among them (in allocation order), and its limit overrides the default one. A MIG
    device created at prepare has no uuid yet, so only its index can name it.
    """
    configs: dict[AllocationResult, DeviceConfig] = {}
    for result, (entry, decoded) in winners.items():
        assert not isinstance(decoded.config, VfioDeviceConfig)  # winners are of GPUs and MIG devices
        configs[result] = decoded.config
        if not decoded.per_device_pinned_limits:
            continue
        group = [r for r in results if r in winners and winners[r][0] is entry]
        uuids = [_known_uuid(targets[r]) for r in group]
        position = group.index(result)
        limit = None
        for key, value in decoded.per_device_pinned_limits.items():
            if key in uuids:
                index = uuids.index(key)
            elif key.isdigit() and int(key) < len(group):
                index = int(key)
            else:
                raise ClaimRejected(
                    f"{entry.describe()}: sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit: invalid "
                    f"device {key!r}: neither the uuid of one of its {len(group)} devices nor an index "
                    f"0-{len(group) - 1}"
                )
            if index == position:
                limit = value
        if limit is not None:
            configs[result] = _with_pinned_limit(configs[result], limit)
    return configs


def _known_uuid(target: Target) -> str | None:
    return None if target.create is not None and target.mig is None else target.uuid


def _with_pinned_limit(config: DeviceConfig, limit: str) -> DeviceConfig:
    mps = config.sharing.mps
    assert mps is not None  # the translation writes mps whenever per-device limits exist
    sharing = config.sharing.model_copy(
        update={"mps": mps.model_copy(update={"default_pinned_device_memory_limit": limit})}
    )
    return config.model_copy(update={"sharing": sharing})


def _check_config_kinds(
    decoded: Sequence[tuple[OpaqueConfig, AnyConfig]],
    results: Sequence[AllocationResult],
    targets: Mapping[AllocationResult, Target],
) -> None:
    """Refuse a claim config naming a request whose devices are all of the other kind.

    A config applies only to devices of its own kind (:mod:`dra_driver.node.config`), so without
    this check a ``GpuConfig`` naming a request that got MIG devices would be dropped unseen.
    The rule: a ``FromClaim`` config that names requests is an error when one of them got
    devices here under exactly that name and none of them is of the config's kind. Not errors:

    * a config naming no request: it is for all devices of its kind, and the claim may hold both;
    * a class config: the scheduler names for it every request allocated from the class, and a
      class may carry one config per kind side by side;
    * a config naming a ``firstAvailable`` parent ``req``: its results are named ``req/sub``, and
      a config per kind for whichever alternative wins is how such a request is configured (the
      alternatives may differ in kind; the claim's spec, which says so, is not read here). A
      config naming the subrequest ``req/sub`` itself is checked;
    * a named request without results here (another driver's, or an alternative not chosen).
    """
    problems: list[str] = []
    for entry, config in decoded:
        if entry.source is not ConfigSource.FROM_CLAIM:
            continue
        for request in entry.requests:
            served = [r for r in results if r.request == request]
            if not served or any(_kind_of(targets[r]) == config.kind for r in served):
                continue
            wanted = _KIND_SERVES[config.kind]
            kind = _kind_of(targets[served[0]])
            other, fix = _KIND_SERVES[kind].rstrip("s"), kind
            got = f"{other}{'s' if len(served) > 1 else ''} {', '.join(r.device for r in served)}"
            problems.append(
                f"{entry.describe()}: {config.kind} applies to {wanted}, but request {request} was "
                f"allocated {got}; use {fix}"
            )
    if problems:
        raise ClaimRejected("; ".join(problems))


_KIND_SERVES = {
    "GpuConfig": "full GPUs",
    "MigDeviceConfig": "MIG devices",
    "VfioDeviceConfig": "passthrough devices",
}


def _kind_of(target: Target) -> str:
    """The config kind that applies to ``target``."""
    if target.passthrough is not None:
        return "VfioDeviceConfig"
    return "MigDeviceConfig" if target.is_mig else "GpuConfig"


def _resolve(
    result: AllocationResult,
    claim_uid: str,
    inventory: Inventory,
    partition: PartitionPolicy,
    mig_holders: Mapping[str, str],
    passthrough: Mapping[str, PassthroughGpu],
) -> Target:
    device = result.device
    if device.startswith(PASSTHROUGH_PREFIX):
        return _passthrough_target(result, inventory, passthrough)
    for gpu in inventory.gpus:
        if device == gpu_device_name(gpu.minor):
            if gpu.mig_enabled or gpu.mig_devices:
                raise ClaimRejected(
                    f"device {device} is in MIG mode and cannot be used whole; "
                    "the claim was allocated from a stale ResourceSlice and needs a new allocation"
                )
            return Target(gpu)
        if device == maintenance_device_name(gpu.minor):
            if not result.admin_access:
                raise ClaimRejected(
                    f"device {device} is for admin access only (it shares {gpu_device_name(gpu.minor)} "
                    "with its workloads); request it with adminAccess: true, or use the GPU class"
                )
            return Target(gpu)  # the whole GPU as it is, in MIG mode or not: looked at, never changed
    # MIG names only after every GPU's own names: a full GPU is found without building the names
    # of every placement of the GPUs before it (some 20 each).
    for gpu in inventory.gpus:
        for profile in gpu.mig_profiles:
            for placement in profile.placements:
                if device == mig_device_name(gpu.minor, profile.name, profile.profile_id, placement.start):
                    return _mig_target(
                        result, claim_uid, gpu, MigPlacement(profile, placement), partition, mig_holders
                    )
    known = ", ".join(gpu_device_name(gpu.minor) for gpu in inventory.gpus) or "none"
    raise ClaimRejected(
        f"device {device} does not exist on this node (GPUs: {known}); the claim was allocated from a "
        "stale ResourceSlice: delete the pod so the claim is allocated again"
    )


def _passthrough_target(
    result: AllocationResult, inventory: Inventory, passthrough: Mapping[str, PassthroughGpu]
) -> Target:
    """The GPU behind ``gpu-vfio-<index>``: on the nvidia driver, MIG mode off, no admin access."""
    device = result.device
    place = next((p for p in passthrough.values() if passthrough_device_name(p.index) == device), None)
    if place is None:
        reason = (
            "passthrough is off (--passthrough)"
            if not passthrough
            else "no GPU of that index is in an IOMMU group"
        )
        raise ClaimRejected(
            f"device {device} is no passthrough device of this node: {reason}; the claim was allocated from "
            "a stale ResourceSlice: delete the pod so the claim is allocated again"
        )
    if result.admin_access or result.share_id is not None:
        raise ClaimRejected(
            f"device {device} is a GPU passed through to a virtual machine, which cannot be shared: request "
            "it without adminAccess and without capacity"
        )
    gpu = next((g for g in inventory.gpus if g.pci_bus_id == place.address), None)
    if gpu is None:
        raise ClaimRejected(
            f"device {device}: GPU {place.address} is not on the nvidia driver (passed through already, or "
            "taken by an administrator), so it cannot be passed through for this claim"
        )
    if gpu.mig_enabled or gpu.mig_devices:
        raise ClaimRejected(
            f"device {device}: GPU {gpu_device_name(gpu.minor)} is in MIG mode or has MIG devices, and a "
            "virtual machine gets the whole GPU; the claim was allocated from a stale ResourceSlice"
        )
    return Target(gpu, passthrough=place)


def _mig_target(
    result: AllocationResult,
    claim_uid: str,
    gpu: Gpu,
    wanted: MigPlacement,
    partition: PartitionPolicy,
    mig_holders: Mapping[str, str],
) -> Target:
    """The MIG device named by ``result``: the one that exists at its placement, or one to create."""
    device = result.device
    live = next(
        (
            m
            for m in gpu.mig_devices
            if m.profile_id == wanted.profile.profile_id and m.placement == wanted.placement
        ),
        None,
    )
    holder = mig_holders.get(live.uuid) if live else None
    if live is not None and holder is None:
        return Target(gpu, mig=live)  # static MIG: it stays when the claim is unprepared
    if result.admin_access:
        if live is None:
            raise ClaimRejected(
                f"device {device}: admin access to a MIG placement needs its MIG device to exist, and it "
                "does not; the driver creates it only for a claim that is allocated it without admin access"
            )
        return Target(gpu, mig=live)  # someone else's: looked at, never destroyed by this claim
    if live is not None and holder == claim_uid:
        return Target(gpu, mig=live, create=wanted)  # created by an earlier attempt of this claim
    if not (partition(gpu) and offers_partitions(gpu)):
        reason = (
            "MIG partitions are turned off for it (--mig-partitions)"
            if offers_partitions(gpu)
            else f"its MIG mode is off and switching it on needs a GPU reset ({gpu.architecture}), which "
            "the driver never does; an administrator has to enable MIG mode"
        )
        raise ClaimRejected(
            f"device {device} is a MIG placement on {gpu_device_name(gpu.minor)} ({gpu.product_name}), but "
            f"the driver does not create MIG devices there: {reason}. The claim was allocated from a stale "
            "ResourceSlice: delete the pod so the claim is allocated again"
        )
    # Held by another claim (the state refuses the reservation) or not there yet: to be created.
    return Target(gpu, create=wanted)


def _check_fits(device: PlannedDevice) -> None:
    mps = device.config.sharing.mps
    limit = mps.default_pinned_device_memory_limit if mps else None
    if limit is not None and quantity_bytes(limit) > device.target.memory_bytes:
        raise ClaimRejected(
            f"device {device.result.device}: sharing.mps.defaultPinnedDeviceMemoryLimit {limit} exceeds "
            f"the device's memory ({device.target.memory_bytes // 2**20} MiB)"
        )


def _cdi_device(device: PlannedDevice, mounts: tuple[Mount, ...] = ()) -> CdiDevice:
    place = device.target.passthrough
    if place is not None:
        name = device.result.device
        gpu = gpu_device_name(device.target.gpu.minor)
        path = device.cdev if device.iommufd and device.cdev else f"/dev/vfio/{place.iommu_group}"
        return CdiDevice(
            name=name,
            device_nodes=(DeviceNode(path, None, None),),
            env=((passthrough_env_name(name), f"{gpu},{place.address}"),),
            mounts=mounts,
        )
    env = sharing_env(device.result.device, device.config.sharing)
    if device.result.admin_access:
        env += admin_access_env(device.result.device)
    if device.target.create is not None:
        env += mig_created_env(device.result.device)
    return CdiDevice(
        name=device.result.device,
        device_nodes=device.target.device_nodes,
        env=env,
        uuid=device.target.uuid,
        share_id=device.result.share_id,
        mounts=mounts,
    )


def admin_access_env(device: str) -> tuple[tuple[str, str], ...]:
    """The variable telling a maintenance container that it holds ``device`` with admin access."""
    return ((f"{ADMIN_ACCESS_ENV_PREFIX}{_device_suffix(device)}", "true"),)


def passthrough_env_name(device: str) -> str:
    """The variable naming the GPU and PCI address of passthrough ``device`` (see the module doc)."""
    return f"{PASSTHROUGH_ENV_PREFIX}{_device_suffix(device)}"


def mig_created_env(device: str) -> tuple[tuple[str, str], ...]:
    """The variable saying that the driver created ``device``'s MIG device for this claim.

    The spec is the evidence recovery rebuilds a claim from when the store is lost: without
    it, the claim's MIG device would be taken for an administrator's and outlive the claim.
    """
    return ((f"{MIG_CREATED_ENV_PREFIX}{_device_suffix(device)}", "true"),)


def _device_suffix(device: str) -> str:
    """``gpu-0`` -> ``GPU_0``: the <DEVICE> of every per-device variable, as in DRA_GPU_UUID_<DEVICE>."""
    return uuid_env_name(device).removeprefix(UUID_ENV_PREFIX)


def sharing_env(device: str, sharing: GpuSharing | MigSharing) -> tuple[tuple[str, str], ...]:
    """The variables announcing ``device``'s sharing settings (see the module doc)."""
    suffix = _device_suffix(device)
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
