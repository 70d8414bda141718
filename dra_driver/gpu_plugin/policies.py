"""What the settings and the GPUs make of the node: the decisions, apart from the doing.

The partition policy, the slices the pool should hold, the taints and labels, and the CDI edits
every container gets. Each is a function of the settings and what was read (the inventory, the
faults, the API server's release), so the daemon and ``dra-driver inventory`` share them and a
test checks them without a node.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path

import structlog

from dra_driver.cdi.spec import HOOK_COMMANDS, CommonEdits, common_edits
from dra_driver.devices.backend import DeviceError
from dra_driver.devices.driver_root import (
    cdi_hook_commands,
    find_cdi_hook,
    find_driver_files,
    parse_capabilities,
)
from dra_driver.devices.faults import FaultKind, NodeFaults
from dra_driver.devices.pci import PassthroughGpu
from dra_driver.devices.types import Inventory
from dra_driver.errors import StartupError
from dra_driver.labels.gfd import gfd_labels
from dra_driver.node.nvidia_config import NVIDIA_DRIVER_NAME
from dra_driver.resources.devices import (
    PartitionPolicy,
    build_devices,
    partition_all,
    partition_mig_mode,
    partition_none,
    partition_selected,
)
from dra_driver.resources.server_rules import NEWEST, ServerRules
from dra_driver.resources.slices import SliceContent, split_pool
from dra_driver.resources.taints import TaintEffect, TaintPolicy
from dra_driver.resources.wire import DeviceTaint
from dra_driver.settings import BindingConditions, Settings, TaintsOnRecovery, partition_gpus, xid_numbers

log = structlog.get_logger(__name__)


def partition_policy(setting: str, driver_name: str) -> PartitionPolicy:
    """The ``--mig-partitions`` value as a policy: all, none, mig-mode, auto, or GPU UUIDs / minors.

    ``auto`` is all under the driver's own name and mig-mode under NVIDIA's, whose driver offers no
    dynamic MIG by default: claims written for it, admin access included, find full GPUs without
    counters there (docs/maintenance.md says what each choice costs).
    """
    if setting == "auto":
        setting = "mig-mode" if driver_name == NVIDIA_DRIVER_NAME else "all"
    if setting == "all":
        return partition_all
    if setting == "none":
        return partition_none
    if setting == "mig-mode":
        return partition_mig_mode
    return partition_selected(partition_gpus(setting))


def desired_slices(
    settings: Settings,
    inventory: Inventory,
    owned_mig_uuids: Collection[str] = frozenset(),
    taints: Mapping[str, Sequence[DeviceTaint]] | None = None,
    rules: ServerRules = NEWEST,
    passthrough: Mapping[str, PassthroughGpu] | None = None,
) -> list[SliceContent]:
    """What the pool should contain for ``inventory``: the one rule shared by daemon and CLI.

    ``owned_mig_uuids`` are the MIG devices the driver created for claims; they stay published
    as the placements they were created from. ``taints`` are those of faulty GPUs' devices.
    ``rules`` are the API server's release's (the slice layout differs on 1.34). ``passthrough``
    (read from sysfs when ``--passthrough`` is on) gives the GPUs that can be passed through.
    """
    policy = partition_policy(settings.mig_partitions, settings.driver_name)
    return split_pool(
        build_devices(
            inventory,
            partition=policy,
            owned_mig_uuids=owned_mig_uuids,
            taints=taints,
            maintenance=settings.maintenance_devices,
            consumable=settings.consumable_capacity,
            passthrough=passthrough,
            binding_conditions=binding_conditions_on(settings, rules),
            share_binding_conditions=binding_conditions_on(settings, rules)
            and settings.share_binding_conditions,
        ),
        counters_beside_devices=rules.counters_beside_devices,
    )


def binding_conditions_on(settings: Settings, rules: ServerRules) -> bool:
    """Whether placements carry binding conditions: ``auto`` follows the release's default gate."""
    if settings.binding_conditions is BindingConditions.AUTO:
        return rules.binding_conditions
    return settings.binding_conditions is BindingConditions.ON


def check_taint_effects(settings: Settings, rules: ServerRules) -> None:
    """Taint effect None needs 1.35: 1.34 would refuse every slice with such a taint in it."""
    if rules.taint_effect_none:
        return
    for flag, env, effect in (
        ("--xid-taint-effect", "DRA_XID_TAINT_EFFECT", settings.xid_taint_effect),
        ("--gpu-lost-taint-effect", "DRA_GPU_LOST_TAINT_EFFECT", settings.gpu_lost_taint_effect),
    ):
        if effect is TaintEffect.NONE:
            raise StartupError(
                f"{flag} / {env}: the taint effect None needs Kubernetes 1.35 or newer, and this API "
                "server is older; use NoSchedule or NoExecute"
            )


DMI_PRODUCT_NAME = Path("/sys/class/dmi/id/product_name")


def node_labels(settings: Settings, inventory: Inventory, faults: NodeFaults) -> dict[str, str]:
    """GFD's labels for the node: lost GPUs (unreachable, or a gpu-lost Xid) left out; the
    machine from DMI, unless simulated."""
    lost_xids = frozenset(xid_numbers(settings.gpu_lost_xids))
    lost = {
        uuid
        for uuid, found in faults.items()
        if any(f.kind is FaultKind.GPU_LOST or f.xid in lost_xids for f in found)
    }
    machine = None
    if not settings.simulate:
        with contextlib.suppress(OSError):
            machine = DMI_PRODUCT_NAME.read_text().strip()
    return gfd_labels(inventory, lost=lost, machine=machine)


def taint_policy(settings: Settings) -> TaintPolicy:
    return TaintPolicy(
        driver_name=settings.driver_name,
        xid_effect=settings.xid_taint_effect,
        gpu_lost_effect=settings.gpu_lost_taint_effect,
        gpu_lost_xids=frozenset(xid_numbers(settings.gpu_lost_xids)),
        remove_on_recovery=settings.taints_on_recovery is TaintsOnRecovery.REMOVE,
    )


def edits_for(settings: Settings, inventory: Inventory) -> CommonEdits:
    """What every container with one of our GPUs needs from the host."""
    try:
        files = find_driver_files(
            settings.driver_root,
            inventory.driver_version,
            seen_at=settings.driver_root_mount,
            capabilities=parse_capabilities(settings.driver_capabilities),
        )
    except DeviceError as err:
        if not settings.simulate:
            raise
        # Simulated GPUs on a machine without the NVIDIA driver: nothing to mount, and that is fine.
        log.info("no NVIDIA driver files for the simulated GPUs; specs mount none", reason=str(err))
        files = None
    hook_path = settings.nvidia_cdi_hook_path or find_cdi_hook(
        settings.driver_root, seen_at=settings.driver_root_mount
    )
    if files is not None and hook_path is None:
        log.info(
            "no nvidia-cdi-hook: specs create no library symlinks and leave the linker cache alone",
            hint="set nvidia-cdi-hook-path, or install the NVIDIA container toolkit in the driver root",
        )
    if files is None or hook_path is None:
        return common_edits(inventory, files)
    return common_edits(
        inventory, files, hook_path=hook_path, hook_commands=hook_commands(settings, hook_path)
    )


# What every nvidia-cdi-hook has had (toolkit v1.14 on): all a spec runs when the hook is unreadable.
_OLDEST_HOOK_COMMANDS = ("create-symlinks", "update-ldcache")


def hook_commands(settings: Settings, hook_path: str) -> tuple[str, ...]:
    """The commands of HOOK_COMMANDS that the host's nvidia-cdi-hook at ``hook_path`` has."""
    seen = Path(hook_path)
    if settings.driver_root_mount is not None and seen.is_relative_to(settings.driver_root):
        seen = settings.driver_root_mount / seen.relative_to(settings.driver_root)
    try:
        found = cdi_hook_commands(seen, HOOK_COMMANDS)
    except DeviceError as err:
        log.warning(
            "nvidia-cdi-hook unreadable: specs run only the hook commands every version has",
            error=str(err),
            commands=list(_OLDEST_HOOK_COMMANDS),
        )
        return _OLDEST_HOOK_COMMANDS
    missing = [command for command in HOOK_COMMANDS if command not in found]
    if missing:
        log.info(
            "nvidia-cdi-hook lacks commands; specs leave them out",
            missing=missing,
            hint="NVIDIA container toolkit v1.18.0 or newer has them",
        )
    return tuple(command for command in HOOK_COMMANDS if command in found)
