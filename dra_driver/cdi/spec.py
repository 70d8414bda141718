"""The CDI spec of one prepared claim: what the container runtime adds to a container.

Each prepared claim gets one transient spec of kind ``k8s.<driver>/claim`` whose
devices are named ``<claimUID>-<device>``, so a CDI device id is never reused by a
later claim. A share of a device (consumable capacity) is named
``<claimUID>-<device>-share-<shareID>``: two shares of one GPU in one claim are two
CDI devices, and a name tells which share it is (recovery reads it back). The
kubelet hands every container the ids of exactly the devices it may use: all of the
claim's devices, or only those of the requests the container names in
``resources.claims[].request``.

How the runtime combines the edits decides what goes where:

* The spec-level ``containerEdits`` are applied once to any container that gets at
  least one device of the spec. They carry what every GPU container needs and
  what does not depend on which GPUs it got: the control nodes (``nvidiactl``,
  ``nvidia-uvm``, ...), the driver's libraries, binaries and firmware as read-only
  bind mounts, and the ``nvidia-cdi-hook`` hooks that make the libraries loadable.
* A device's ``containerEdits`` are applied only where that device is injected:
  its ``/dev/nvidia<minor>`` node (for a MIG device the parent's node plus the two
  ``nvidia-caps`` nodes), the variable that names its UUID and, with device metadata
  on, the read-only mount of its request's metadata file (:mod:`dra_driver.cdi.metadata`).

Telling the container which GPUs it got. The runtime merges the env of every
injected device and a later entry with the same NAME replaces an earlier one, so a
shared variable cannot be built from per-device pieces: ``NVIDIA_VISIBLE_DEVICES``
set per device would name only the last GPU of a two-GPU container, and a
claim-wide list at spec level would name GPUs that a container given only some of
the claim's requests does not have. Each device therefore sets its own variable,
``DRA_GPU_UUID_<DEVICE>=<uuid>`` (``<DEVICE>`` is the device name in upper case
with ``-`` as ``_``, e.g. ``DRA_GPU_UUID_GPU_0``); a container's environment then
lists exactly its devices, whichever subset it got, and ``env | grep
^DRA_GPU_UUID_`` shows them. Device names are DNS labels, so the mapping to
variable names is one-to-one.

``NVIDIA_VISIBLE_DEVICES`` itself is set to ``void`` at spec level, as NVIDIA's
own CDI mode does: CUDA images set ``NVIDIA_VISIBLE_DEVICES=all`` in their image
config, and where the NVIDIA container runtime or its hook is still installed it
would act on that value and inject every GPU of the node on top of the devices
CDI gave the container. ``void`` tells it to add nothing. This is why the UUIDs
cannot travel in ``NVIDIA_VISIBLE_DEVICES``: the variable already has this job.
The applications inside need no list either: CUDA and NVML see exactly the GPUs
whose device nodes the container has.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import PurePosixPath
from typing import Any

from dra_driver.cdi.validate import (
    CheckedEdits,
    ValidSpec,
    check_device_name,
    check_kind,
    checked_edits,
    with_minimum_version,
)
from dra_driver.devices.driver_root import DriverFiles, HostFile
from dra_driver.devices.types import DeviceNode, Inventory
from dra_driver.names import UID_RULE, is_dns_label, is_uid

CLAIM_CLASS = "claim"
# The nvidia-cdi-hook commands a spec runs (see _hooks), in their order. NVIDIA's toolkit has had
# create-symlinks and update-ldcache since v1.14, the other two since v1.18.0.
HOOK_COMMANDS = (
    "create-symlinks",
    "enable-cuda-compat",
    "update-ldcache",
    "disable-device-node-modification",
)
# Driver files are shared with the host: the container must not write or execute
# set-uid through them, and must not see later mount changes under them.
READ_ONLY_BIND = ("ro", "nosuid", "nodev", "rbind", "rprivate")
UUID_ENV_PREFIX = "DRA_GPU_UUID_"
# Claim-level env: stop the NVIDIA container runtime from injecting GPUs itself.
CLAIM_ENV = (("NVIDIA_VISIBLE_DEVICES", "void"),)

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# The CUDA driver library; programs that link with -lcuda need the unversioned name.
_LIBCUDA = re.compile(r"libcuda\.so\.\d[\d.]*")


@dataclass(frozen=True)
class Mount:
    """A bind mount of a host file or directory into the container."""

    host_path: str
    container_path: str
    options: tuple[str, ...] = READ_ONLY_BIND


@dataclass(frozen=True)
class Hook:
    """An OCI hook the runtime runs while it creates the container."""

    hook_name: str  # the OCI lifecycle stage, e.g. "createContainer"
    path: str  # the executable, as a host path
    args: tuple[str, ...]  # argv, starting with the program name


@dataclass(frozen=True)
class CdiDevice:
    """One prepared device of a claim, as the container runtime sees it."""

    name: str  # our device name, e.g. "gpu-0" -> CDI name "<claimUID>-gpu-0"
    device_nodes: tuple[DeviceNode, ...]  # the GPU node; for MIG the parent node + the two nvidia-caps nodes
    env: tuple[tuple[str, str], ...] = ()  # extra env for this device
    uuid: str = ""  # GPU or MIG uuid, announced as DRA_GPU_UUID_<DEVICE>
    share_id: str | None = None  # a share of the device (consumable capacity): part of the CDI name
    mounts: tuple[Mount, ...] = ()  # its request's device metadata file (dra_driver.cdi.metadata)


@dataclass(frozen=True)
class CommonEdits:
    """What every container holding one of our GPUs needs, whichever GPUs it holds."""

    # Control nodes: nvidiactl, nvidia-uvm, nvidia-uvm-tools, nvidia-modeset.
    device_nodes: tuple[DeviceNode, ...]
    mounts: tuple[Mount, ...]  # driver libraries/binaries/firmware, read-only bind mounts
    hooks: tuple[Hook, ...]  # nvidia-cdi-hook's commands (HOOK_COMMANDS) when available
    # Claim-wide variables beside NVIDIA_VISIBLE_DEVICES=void: an MPS claim's CUDA_MPS_* settings.
    env: tuple[tuple[str, str], ...] = ()

    @cached_property
    def spec_edits(self) -> CheckedEdits:
        """A claim spec's own ``containerEdits``: built and checked once per node, not per claim."""
        return checked_edits(
            _without_empty(
                {
                    "env": [f"{name}={value}" for name, value in (*CLAIM_ENV, *self.env)],
                    "deviceNodes": [_device_node(node) for node in self.device_nodes],
                    "mounts": [_mount(mount) for mount in self.mounts],
                    "hooks": [_hook(hook) for hook in self.hooks],
                }
            )
        )


def common_edits(
    inventory: Inventory,
    driver_files: DriverFiles | None,
    hook_path: str | None = None,
    hook_commands: Collection[str] = HOOK_COMMANDS,
) -> CommonEdits:
    """The claim-independent edits for this node.

    ``hook_path`` is the host path of ``nvidia-cdi-hook``. Without it no hooks are
    added, and the container finds the libraries only under the names they are
    mounted with: nothing creates the soname links (``libcuda.so.1``) or
    refreshes the linker cache. ``hook_commands`` are the commands that hook
    binary has (an older toolkit's lacks the newer ones, and a container whose
    hook fails does not start).
    """
    files: list[HostFile] = []
    libraries: tuple[HostFile, ...] = ()
    if driver_files is not None:
        libraries = driver_files.libraries
        files = [*driver_files.libraries, *driver_files.binaries]
        if driver_files.firmware is not None:
            files.append(driver_files.firmware)
    return CommonEdits(
        device_nodes=inventory.control_nodes,
        mounts=_mounts(files),
        hooks=(
            _hooks(
                hook_path,
                [library.container_path for library in libraries],
                inventory.driver_version,
                frozenset(hook_commands),
            )
            if hook_path
            else ()
        ),
    )


def cdi_kind(driver_name: str) -> str:
    """``k8s.<driver>/claim``; raises ValueError when the driver name cannot form a CDI vendor."""
    kind = f"k8s.{driver_name}/{CLAIM_CLASS}"
    check_kind(kind, field=f"kind for driver {driver_name!r}")
    return kind


SHARE_SEPARATOR = "-share-"  # never part of a published device name


def cdi_device_id(driver_name: str, claim_uid: str, device: str, share_id: str | None = None) -> str:
    """The fully qualified CDI device id the kubelet passes to the runtime for one device of a claim."""
    return f"{cdi_kind(driver_name)}={_cdi_device_name(claim_uid, device, share_id)}"


def device_of_cdi_name(claim_uid: str, name: str) -> tuple[str, str | None] | None:
    """``<claimUID>-<device>[-share-<shareID>]`` -> (device, share id); None if not of this claim."""
    prefix = f"{claim_uid}-"
    if not name.startswith(prefix):
        return None
    device, separator, share_id = name[len(prefix) :].partition(SHARE_SEPARATOR)
    return device, share_id if separator else None


def check_claim_uid(claim_uid: str) -> None:
    """Raise ValueError unless ``claim_uid`` can name CDI devices and a spec file safely."""
    # It becomes part of a CDI device name and of a file name: one rule for both, and for the node.
    if not is_uid(claim_uid):
        raise ValueError(f"claim UID {claim_uid!r} cannot name a CDI spec: it must be {UID_RULE}")


def uuid_env_name(device: str) -> str:
    """The variable that tells a container the UUID of ``device``: ``gpu-0`` -> ``DRA_GPU_UUID_GPU_0``."""
    return UUID_ENV_PREFIX + device.upper().replace("-", "_")


def claim_spec(
    driver_name: str, claim_uid: str, devices: Sequence[CdiDevice], common: CommonEdits
) -> ValidSpec:
    """The transient CDI spec for one claim, with the lowest ``cdiVersion`` its content allows.

    Raises ValueError (InvalidSpecError for CDI rules) rather than return a spec a
    runtime would refuse.
    """
    check_claim_uid(claim_uid)
    if not devices:
        raise ValueError(f"claim {claim_uid}: a CDI spec needs at least one device")
    seen: set[str] = set()
    for device in devices:
        name = _cdi_device_name(claim_uid, device.name, device.share_id)
        if name in seen:
            share = f" (share {device.share_id})" if device.share_id else ""
            raise ValueError(f"claim {claim_uid}: device {device.name!r}{share} is listed twice")
        seen.add(name)
    _check_env_is_unambiguous(claim_uid, devices, common.env)

    spec: dict[str, Any] = {
        "kind": cdi_kind(driver_name),
        "devices": [
            {
                "name": _cdi_device_name(claim_uid, device.name, device.share_id),
                "containerEdits": _device_edits(device),
            }
            for device in devices
        ],
        "containerEdits": common.spec_edits,
    }
    return with_minimum_version(spec)


def _cdi_device_name(claim_uid: str, device: str, share_id: str | None = None) -> str:
    check_claim_uid(claim_uid)
    if not is_dns_label(device) or SHARE_SEPARATOR in device:
        raise ValueError(
            f"device name {device!r} is not a DNS label (lower-case letters, digits and '-', at most 63)"
        )
    if share_id is not None and not is_dns_label(share_id):
        raise ValueError(f"share id {share_id!r} of device {device!r} is not a lower-case UUID")
    name = f"{claim_uid}-{device}" + (f"{SHARE_SEPARATOR}{share_id}" if share_id is not None else "")
    check_device_name(name, field=f"CDI name of device {device!r}")
    return name


def _device_env(device: CdiDevice) -> tuple[tuple[str, str], ...]:
    own = ((uuid_env_name(device.name), device.uuid),) if device.uuid else ()
    return (*own, *device.env)


def _check_env_is_unambiguous(
    claim_uid: str, devices: Sequence[CdiDevice], claim_env: Sequence[tuple[str, str]] = ()
) -> None:
    """Refuse env that would depend on which devices a container got, or on their order.

    The runtime lets a later duplicate NAME win, so two devices of one claim may
    share a variable only with the same value, and no device may override the
    claim-level variables.
    """
    values: dict[str, tuple[str, str]] = {
        name: (value, "the claim") for name, value in (*CLAIM_ENV, *claim_env)
    }
    for device in devices:
        for name, value in _device_env(device):
            if not _ENV_NAME.fullmatch(name):
                raise ValueError(
                    f"claim {claim_uid}: device {device.name!r}: {name!r} is not a variable name"
                )
            earlier = values.setdefault(name, (value, f"device {device.name!r}"))
            if earlier[0] != value:
                raise ValueError(
                    f"claim {claim_uid}: device {device.name!r} sets {name}={value!r} but {earlier[1]} "
                    f"sets {name}={earlier[0]!r}; a container holding both would see only one of them"
                )


def _device_edits(device: CdiDevice) -> dict[str, Any]:
    return _without_empty(
        {
            "env": [f"{name}={value}" for name, value in _device_env(device)],
            "deviceNodes": [_device_node(node) for node in device.device_nodes],
            "mounts": [_mount(mount) for mount in device.mounts],
        }
    )


def _device_node(node: DeviceNode) -> dict[str, Any]:
    # With type and numbers the runtime creates the node in the container without
    # stat-ing a host file: the nvidia-caps nodes of a MIG device need not exist
    # on the host at all.
    entry: dict[str, Any] = {"path": node.path}
    if node.host_path and node.host_path != node.path:
        entry["hostPath"] = node.host_path
    if node.major is not None and node.minor is not None:
        entry.update(type="c", major=node.major, minor=node.minor)
    return entry


def _mount(mount: Mount) -> dict[str, Any]:
    return {
        "hostPath": mount.host_path,
        "containerPath": mount.container_path,
        "options": list(mount.options),
    }


def _hook(hook: Hook) -> dict[str, Any]:
    return {"hookName": hook.hook_name, "path": hook.path, "args": list(hook.args)}


def _without_empty(edits: dict[str, list[Any]]) -> dict[str, Any]:
    return {field: items for field, items in edits.items() if items}


def _mounts(files: Iterable[HostFile]) -> tuple[Mount, ...]:
    """One read-only mount per container path; a path claimed by two host files is a bug upstream."""
    by_target: dict[str, Mount] = {}
    for file in files:
        mount = Mount(str(file.host_path), str(file.container_path))
        earlier = by_target.setdefault(mount.container_path, mount)
        if earlier.host_path != mount.host_path:
            raise ValueError(
                f"driver files {earlier.host_path} and {mount.host_path} would both be mounted at "
                f"{mount.container_path}"
            )
    return tuple(by_target.values())


def _hooks(
    hook_path: str, libraries: Sequence[PurePosixPath], driver_version: str, commands: frozenset[str]
) -> tuple[Hook, ...]:
    """nvidia-cdi-hook calls that prepare the container, in the order NVIDIA's toolkit runs them.

    * ``create-symlinks`` adds ``libcuda.so`` next to a mounted ``libcuda.so.<version>``
      (pointing at the ``libcuda.so.1`` soname) for programs that link with ``-lcuda``;
    * ``enable-cuda-compat --host-driver-version=<version>``: where the image ships CUDA's
      forward-compatibility libraries (``/usr/local/cuda/compat/libcuda.so.<version>``) newer
      than the host's driver, it adds their folder to the linker's configuration ahead of the
      driver's, so a CUDA newer than the driver runs; otherwise it does nothing;
    * ``update-ldcache`` then runs ldconfig over the library folders (and the compat folder),
      which also creates the soname links, so the dynamic linker finds them;
    * ``disable-device-node-modification`` gives the container a ``/proc/driver/nvidia/params``
      that says ``ModifyDeviceFiles: 0``, so the driver's libraries in the container never try
      to create device nodes (nvidia-modprobe) for GPUs the container was not given.
    """
    if not libraries:
        return ()  # no driver in the container: nothing to link, cache or keep from making nodes
    program = PurePosixPath(hook_path).name
    names = {library.name for library in libraries}
    links = [
        f"libcuda.so.1::{library.parent / 'libcuda.so'}"
        for library in libraries
        if _LIBCUDA.fullmatch(library.name) and "libcuda.so" not in names
    ]
    # The two further links NVIDIA's toolkit creates: GLVND's indirect GLX, and the optical-flow
    # library's development name, which its package does not ship.
    links += [
        f"{library.name}::{library.parent / 'libGLX_indirect.so.0'}"
        for library in libraries
        if library.name.startswith("libGLX_nvidia.so.")
    ]
    links += [
        f"libnvidia-opticalflow.so.1::{library.parent / 'libnvidia-opticalflow.so'}"
        for library in libraries
        if library.name.startswith("libnvidia-opticalflow.so.")
        and library.name != "libnvidia-opticalflow.so.1"
    ]
    folders = list(dict.fromkeys(str(library.parent) for library in libraries))
    calls: list[tuple[str, ...]] = []
    if links:
        calls.append(("create-symlinks", *(arg for link in dict.fromkeys(links) for arg in ("--link", link))))
    if any(_LIBCUDA.fullmatch(library.name) for library in libraries):
        calls.append(("enable-cuda-compat", f"--host-driver-version={driver_version}"))
    if folders:
        calls.append(("update-ldcache", *(arg for folder in folders for arg in ("--folder", folder))))
    calls.append(("disable-device-node-modification",))
    return tuple(
        Hook("createContainer", hook_path, (program, *call)) for call in calls if call[0] in commands
    )
