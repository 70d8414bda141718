"""Every setting of the daemon, with one name in three places.

A field ``driver_name`` is the CLI flag ``--driver-name``, the environment variable
``DRA_DRIVER_NAME`` and (issue: Helm chart) a value in ``values.yaml``. Flags win over the
environment, which wins over the defaults.

The environment is read here rather than through pydantic-settings: every setting is a
scalar, so a variable's text goes to the field's validator as a flag's does. That package
and the sources it imports (dotenv, cloud secret stores, a CLI parser of its own) cost the
daemon memory for nothing it needs (docs/performance.md, "Figures behind the code's comments").
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from dra_driver.devices.driver_root import parse_capabilities
from dra_driver.devices.faults import APPLICATION_XIDS, GPU_LOST_XIDS
from dra_driver.names import DNS_LABEL_RULE, DNS_SUBDOMAIN_RULE, is_dns_label, is_dns_subdomain, is_uid
from dra_driver.resources.quantity import parse_quantity
from dra_driver.resources.taints import TaintEffect
from dra_driver.simulated.nodes import NODE_PROFILES

ENV_PREFIX = "DRA_"
DEFAULT_DRIVER_NAME = "gpu.dra-driver.dev"
_GPU_MINOR = re.compile(r"^[0-9]{1,3}$")
_GPU_UUID = re.compile(r"^GPU-[0-9a-fA-F]{8}(-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12}$")  # as NVML prints them
_PORT = re.compile(r"^[0-9]{1,5}$")
_MAX_PORT = 65535


class LogFormat(StrEnum):
    AUTO = "auto"  # JSON when stderr is not a terminal (a pod), readable text on a terminal
    JSON = "json"
    CONSOLE = "console"


class TaintsOnRecovery(StrEnum):
    REMOVE = "remove"
    KEEP = "keep"


class BindingConditions(StrEnum):
    OFF = "off"
    AUTO = "auto"  # on where the API server's release has them on by default (1.36 and newer)
    ON = "on"


class Settings(BaseModel):
    """Settings of ``dra-driver kubelet-plugin`` (and the offline ``inventory`` command).

    ``Settings(**flags)`` reads the environment too: a keyword wins over ``DRA_<FIELD>``.
    """

    model_config = ConfigDict(extra="forbid", validate_default=True)

    def __init__(self, /, **given: Any) -> None:
        super().__init__(**{**environment_settings(os.environ), **given})

    driver_name: Annotated[
        str,
        Field(
            description="Name of the DRA driver: DeviceClasses select it, and it is the domain of "
            "device attributes. Deploy as gpu.nvidia.com to serve claims written for NVIDIA's driver."
        ),
    ] = DEFAULT_DRIVER_NAME
    node_name: Annotated[
        str, Field(description="Name of the Node this plugin serves (downward API spec.nodeName).")
    ] = ""
    pod_uid: Annotated[
        str,
        Field(
            description="UID of the plugin's own pod (downward API). When set, sockets get per-instance "
            "names so that a rolling update can run two plugins on one node."
        ),
    ] = ""
    pod_namespace: Annotated[
        str,
        Field(
            description="Namespace of the plugin's own pod (downward API), where it runs the MPS "
            "control daemons of MPS claims as Deployments; unset on a real node: MPS claims are refused."
        ),
    ] = ""
    mps_daemon_image: Annotated[
        str,
        Field(
            description="Image of the MPS control daemon pods (it needs only a shell: the daemon runs "
            "from the driver root); unset on a real node: MPS claims are refused."
        ),
    ] = ""
    mps_shm_size: Annotated[
        str,
        Field(
            description="Size of the tmpfs each MPS control daemon and its clients share as /dev/shm, a "
            "quantity (e.g. 4Gi); empty: half the node's memory, NVIDIA's size. A tenant's writes there "
            "count against that tenant's memory limit."
        ),
    ] = ""
    simulate: Annotated[
        str,
        Field(
            description="Use simulated GPUs of this node profile instead of NVML "
            "(see `dra-driver inventory --list-profiles`). Empty: the real NVML backend."
        ),
    ] = ""
    simulate_fabric: Annotated[
        str,
        Field(
            description="NVLink fabric of simulated gb200-tray GPUs: <cluster-uuid>/<clique-id> or "
            "<clique-id>; nodes with the same value form one clique. Empty: the default clique."
        ),
    ] = ""
    compute_domains: Annotated[
        bool,
        Field(
            description="Serve ComputeDomains (multi-node NVLink) as the second driver "
            "compute-domain.<domain> on nodes whose GPUs share one NVLink clique."
        ),
    ] = True
    host_managed_imex: Annotated[
        bool,
        Field(
            description="Host-managed IMEX (NVIDIA's HostManagedIMEXDaemon): the host runs nvidia-imex "
            "as a service; the node publishes no IMEX daemon device and hands out channel 0 once "
            "nvidia-imex-ctl reports the host's daemon READY. The controller's setting must match."
        ),
    ] = False
    imex_host_socket_path: Annotated[
        str,
        Field(
            description="The host nvidia-imex daemon's command socket (its IMEX_CMD_UNIX_DOMAIN_PATH), "
            "under the driver root, that the host-managed IMEX mode's readiness check queries."
        ),
    ] = "/etc/nvidia-imex/imex_ctrl.sock"
    kubeconfig: Annotated[
        Path | None,
        Field(description="Kubeconfig file; unset: the in-cluster service account."),
    ] = None
    plugins_dir: Annotated[
        Path, Field(description="Kubelet plugin directory; the DRA socket lives in <dir>/<driver-name>/.")
    ] = Path("/var/lib/kubelet/plugins")
    registry_dir: Annotated[
        Path, Field(description="Kubelet plugin registration directory, watched by the kubelet.")
    ] = Path("/var/lib/kubelet/plugins_registry")
    data_dir: Annotated[
        Path | None,
        Field(
            description="Where the node's store of prepared claims (state.db) and the simulator's "
            "GPU state are kept; default <plugins-dir>/<driver-name>."
        ),
    ] = None
    cdi_dir: Annotated[Path, Field(description="Directory the container runtime reads CDI specs from.")] = (
        Path("/var/run/cdi")
    )
    driver_root: Annotated[
        Path,
        Field(
            description="Root of the host's NVIDIA driver installation (/ or e.g. /run/nvidia/driver "
            "with the GPU operator); driver libraries found there are mounted into containers."
        ),
    ] = Path("/")
    driver_root_mount: Annotated[
        Path | None,
        Field(
            description="Where this plugin's own container sees the driver root (the chart mounts it "
            "at /driver-root); unset: at the driver root's own path, as when running on the host."
        ),
    ] = None
    procfs_root: Annotated[
        Path,
        Field(
            description="Where the kernel's /proc is: the NVIDIA driver's MIG capability files "
            "(driver/nvidia/capabilities) and its device majors (devices) are read there. The chart "
            "mounts the host directory at the same path when it is not /proc."
        ),
    ] = Path("/proc")
    nvidia_cdi_hook_path: Annotated[
        str,
        Field(
            description="Host path of nvidia-cdi-hook, which CDI specs run to create the libraries' "
            "symlinks, enable CUDA forward compatibility, update the container's linker cache and keep "
            "the container from creating device nodes (the commands the hook has); unset: the hook in "
            "the driver root's usr/bin (or another binary folder) when it is there, else no hooks."
        ),
    ] = ""
    driver_capabilities: Annotated[
        str,
        Field(
            description="NVIDIA_DRIVER_CAPABILITIES classes whose driver libraries containers get: a "
            "comma-separated list of compute, utility, graphics, video, or all (compute and utility "
            "are always included)."
        ),
    ] = "compute,utility"
    boot_id_file: Annotated[
        Path, Field(description="File holding the boot id; prepared state from another boot is cleared.")
    ] = Path("/proc/sys/kernel/random/boot_id")
    http_address: Annotated[
        str,
        Field(description="host:port of the /healthz, /readyz and /metrics endpoint; empty disables it."),
    ] = "0.0.0.0:8080"
    metrics_public: Annotated[
        bool,
        Field(
            description="Serve /metrics to every client that reaches http_address; false: to connections "
            "from localhost only (kubectl port-forward), since it has no authentication and names every "
            "prepared claim. The probes are answered either way."
        ),
    ] = False
    log_format: Annotated[LogFormat, Field(description="auto, json or console.")] = LogFormat.AUTO
    log_level: Annotated[str, Field(description="debug, info, warning or error.")] = "info"
    mig_partitions: Annotated[
        str,
        Field(
            description="Which MIG-capable GPUs offer MIG partitions created on demand: all; none; "
            "mig-mode (the GPUs whose MIG mode is on); a comma-separated list of GPU UUIDs or minor "
            "numbers; or auto: all, but mig-mode under NVIDIA's driver name gpu.nvidia.com, so that a "
            "full GPU consumes no counters and admin-access claims through NVIDIA's DeviceClass run "
            "beside its workload (kubernetes/kubernetes#140729, docs/maintenance.md)."
        ),
    ] = "auto"
    maintenance_devices: Annotated[
        bool,
        Field(
            description="Publish a counter-free gpu-<minor>-maintenance device per GPU that only "
            "admin-access claims may get (kubernetes/kubernetes#140729); false once the scheduler is fixed."
        ),
    ] = True
    binding_conditions: Annotated[
        BindingConditions,
        Field(
            description="Publish MIG placements (created at prepare) with binding conditions (KEP-5007): "
            "the scheduler binds a pod only once the plugin has created its MIG device and reported it "
            "Ready in the claim's status, and schedules it again if that fails (docs/binding-conditions.md). "
            "A ComputeDomain's channel likewise waits until the domain's IMEX daemon on the node is Ready "
            "(not in the host-managed IMEX mode). "
            "auto (default): on where the API server is 1.36 or newer (the gate DRADeviceBindingConditions "
            "is on by default there); on; off: never (the right value where MIG claims with a config are "
            "created by a client other than kubectl, Helm or server-side apply: Kubernetes refuses the "
            "status of such claims, and their pods would wait out the scheduler's bindingTimeout)."
        ),
    ] = BindingConditions.AUTO
    share_binding_conditions: Annotated[
        bool,
        Field(
            description="With binding conditions and consumable capacity on, publish shareable GPUs with "
            "them too: a share's pod is bound only once the GPU's MPS control daemon runs "
            "(docs/binding-conditions.md). Off by default: Kubernetes 1.37's scheduler counts the capacity "
            "of a share that waits for its binding twice, so shares allocated together pack at half "
            "density and a pod refused meanwhile waits minutes for its retry."
        ),
    ] = False
    consumable_capacity: Annotated[
        bool,
        Field(
            description="Publish full GPUs as shareable (allowMultipleAllocations): claims ask "
            "capacity.requests.memory (and multiprocessors), the scheduler packs them onto one GPU and "
            "each share is limited through MPS (docs/consumable-capacity.md)."
        ),
    ] = False
    device_metadata: Annotated[
        bool,
        Field(
            description="Give every container a JSON file per request of its claim naming its devices "
            "and their attributes (PCI address, NUMA node, uuid, ...), as the kubelet plugin helper "
            "writes it (KEP-5304, beta in Kubernetes 1.37; KubeVirt reads it): "
            "/var/run/kubernetes.io/dra-device-attributes/... (docs/device-metadata.md)."
        ),
    ] = False
    passthrough: Annotated[
        bool,
        Field(
            description="Publish a passthrough device gpu-vfio-<index> per GPU in an IOMMU group (MIG mode "
            "off), NVIDIA's type vfio, allocatable instead of the GPU: prepare binds the GPU to vfio-pci and "
            "gives the container /dev/vfio/<group> for a virtual machine (NVIDIA's PassthroughSupport; "
            "docs/passthrough.md)."
        ),
    ] = False
    sysfs_root: Annotated[
        Path | None,
        Field(
            description="Where the kernel's /sys is: the GPUs' PCI details are read there, and passthrough "
            "binds GPUs to vfio-pci there. Unset: /sys; with --simulate, a simulated tree in the data dir."
        ),
    ] = None
    node_labels: Annotated[
        bool,
        Field(
            description="Keep NVIDIA GPU feature discovery's labels (nvidia.com/gpu.product, ...) on the "
            "node, following the GPUs; do not run GFD beside it."
        ),
    ] = False
    inventory_refresh_seconds: Annotated[
        float,
        Field(
            gt=0,
            allow_inf_nan=False,
            description="How often the GPUs are re-read to notice changes (MIG, hot-plug).",
        ),
    ] = 10.0
    ignored_xids: Annotated[
        str,
        Field(
            description="Xids that are errors of the application, not of the GPU, and leave it healthy: "
            "a comma-separated list (empty: none). The default is NVIDIA's list."
        ),
    ] = ",".join(map(str, APPLICATION_XIDS))
    xid_taint_effect: Annotated[
        TaintEffect,
        Field(
            description="Effect of the taint on the devices of a GPU with a critical Xid: NoSchedule "
            "(no new claims), NoExecute (also evicts the pods using it) or None (informs only)."
        ),
    ] = TaintEffect.NO_SCHEDULE
    gpu_lost_xids: Annotated[
        str,
        Field(
            description="Xids that mean the GPU is gone until it is reset (comma-separated); their "
            "taint gets the effect of gpu-lost-taint-effect instead."
        ),
    ] = ",".join(map(str, GPU_LOST_XIDS))
    gpu_lost_taint_effect: Annotated[
        TaintEffect,
        Field(
            description="Effect of the taint on the devices of a GPU that is lost (NVML cannot reach it) "
            "or had one of the gpu-lost-xids: NoExecute, NoSchedule or None."
        ),
    ] = TaintEffect.NO_EXECUTE
    taints_on_recovery: Annotated[
        TaintsOnRecovery,
        Field(
            description="What becomes of a GPU's taints when it recovers: remove them, or keep them "
            "until the plugin restarts, as NVIDIA's driver does."
        ),
    ] = TaintsOnRecovery.REMOVE
    health_poll_seconds: Annotated[
        float,
        Field(
            gt=0,
            le=10,
            allow_inf_nan=False,
            description="How often GPU health is checked: lost GPUs through NVML, injected faults in the "
            "simulator. Xid events from NVML are seen at once.",
        ),
    ] = 0.5

    @field_validator("driver_name")
    @classmethod
    def _driver_name_is_dns_subdomain(cls, value: str) -> str:
        if len(value) > 63 or not is_dns_subdomain(value):
            raise ValueError(
                f"{value!r} is not a DNS subdomain of at most 63 characters (lower-case letters, "
                "digits, '-' and '.'), e.g. gpu.example.com"
            )
        return value

    @field_validator("node_name")
    @classmethod
    def _node_name_is_dns_subdomain(cls, value: str) -> str:
        if value and not is_dns_subdomain(value):
            raise ValueError(
                f"{value!r} is not a Kubernetes node name, {DNS_SUBDOMAIN_RULE}, "
                "as `kubectl get nodes` shows it"
            )
        return value

    @field_validator("pod_uid")
    @classmethod
    def _pod_uid_is_a_file_name_part(cls, value: str) -> str:
        # It becomes part of the socket file names: no '/', no '.', nothing odd.
        if value and not is_uid(value):
            raise ValueError(
                f"{value!r} is not a pod UID (the downward API's metadata.uid, e.g. "
                "3f2b6c1e-8d4a-4e0b-9c1d-2a5e7f8b9c0d); it becomes part of the socket file names"
            )
        return value

    @field_validator("pod_namespace")
    @classmethod
    def _namespace_is_dns_label(cls, value: str) -> str:
        if value and not is_dns_label(value):
            raise ValueError(f"{value!r} is not a namespace name, {DNS_LABEL_RULE}")
        return value

    @field_validator("simulate")
    @classmethod
    def _known_profile(cls, value: str) -> str:
        if value and value not in NODE_PROFILES:
            known = ", ".join(sorted(NODE_PROFILES))
            raise ValueError(
                f"unknown simulated node profile {value!r}; choose one of: {known} "
                "(`dra-driver inventory --list-profiles`), or leave it empty for the real GPUs"
            )
        return value

    @field_validator("kubeconfig", "data_dir", "driver_root_mount", "sysfs_root", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: object) -> object:
        # A Helm template or a shell renders an unset value as "": that means the default, not ".".
        return None if isinstance(value, str) and not value.strip() else value

    @field_validator(
        "plugins_dir", "registry_dir", "cdi_dir", "driver_root", "boot_id_file", "procfs_root", mode="before"
    )
    @classmethod
    def _path_given(cls, value: object) -> object:
        if isinstance(value, str) and not value.strip():
            raise ValueError("must be a path, not empty; leave the setting out for its default")
        return value

    @field_validator("driver_root", "driver_root_mount")
    @classmethod
    def _absolute(cls, value: Path | None, info: ValidationInfo) -> Path | None:
        if value is not None and not value.is_absolute():
            seen_from = "the host" if info.field_name == "driver_root" else "this plugin"
            raise ValueError(
                f"{str(value)!r} is not an absolute path; give the NVIDIA driver's root as {seen_from} "
                "sees it, e.g. / or /run/nvidia/driver"
            )
        return value

    @field_validator("http_address")
    @classmethod
    def _host_and_port(cls, value: str) -> str:
        value = value.strip()
        if value:
            http_host_port(value)
        return value

    @field_validator("imex_host_socket_path")
    @classmethod
    def _absolute_socket(cls, value: str) -> str:
        if not value.startswith("/"):
            raise ValueError(
                f"{value!r} is not an absolute path; give the socket as the host's nvidia-imex config "
                "names it (IMEX_CMD_UNIX_DOMAIN_PATH), e.g. /etc/nvidia-imex/imex_ctrl.sock"
            )
        return value

    @field_validator("procfs_root")
    @classmethod
    def _absolute_procfs(cls, value: Path) -> Path:
        if not value.is_absolute():
            raise ValueError(f"{str(value)!r} is not an absolute path; give where /proc is, e.g. /proc")
        return value

    @field_validator("nvidia_cdi_hook_path")
    @classmethod
    def _absolute_hook(cls, value: str) -> str:
        if value and not value.startswith("/"):
            raise ValueError(f"{value!r} is not an absolute path (the hook's path on the host)")
        return value

    @field_validator("driver_capabilities")
    @classmethod
    def _known_capabilities(cls, value: str) -> str:
        return ",".join(parse_capabilities(value))

    @field_validator("log_level")
    @classmethod
    def _known_level(cls, value: str) -> str:
        value = value.lower()
        if value not in {"debug", "info", "warning", "error"}:
            raise ValueError("must be one of debug, info, warning, error")
        return value

    @field_validator("mig_partitions")
    @classmethod
    def _partition_choice(cls, value: str) -> str:
        keyword = value.strip().lower()
        if keyword in MIG_PARTITION_KEYWORDS:
            return keyword
        return ",".join(partition_gpus(value))

    @field_validator("mps_shm_size")
    @classmethod
    def _shm_size_is_a_quantity(cls, value: str) -> str:
        if value and shm_size_bytes(value) < 2**20:
            raise ValueError(f"{value!r} is less than 1Mi; MPS needs room in /dev/shm")
        return value

    @field_validator("ignored_xids", "gpu_lost_xids")
    @classmethod
    def _xid_list(cls, value: str) -> str:
        return ",".join(str(xid) for xid in xid_numbers(value))

    @property
    def state_dir(self) -> Path:
        return self.data_dir or self.plugins_dir / self.driver_name


def shm_size_bytes(value: str) -> int:
    """``--mps-shm-size`` in bytes; ValueError naming the setting when it is no memory quantity."""
    try:
        size = parse_quantity(value)
    except ValueError:
        raise ValueError(f"{value!r} is not a memory quantity such as 4Gi or 512Mi") from None
    if size.denominator != 1 or size < 0:
        raise ValueError(f"{value!r} is not a whole number of bytes")
    return int(size)


def environment_settings(environ: Mapping[str, str]) -> dict[str, str]:
    """The settings ``DRA_<FIELD>`` variables give, by field name; names match in any case."""
    fields = {ENV_PREFIX + name.upper(): name for name in Settings.model_fields}
    return {fields[key.upper()]: value for key, value in environ.items() if key.upper() in fields}


def http_host_port(address: str) -> tuple[str, int]:
    """``"0.0.0.0:8080"`` -> ``("0.0.0.0", 8080)``; ``"[::]:8080"`` for IPv6; ValueError says the form."""
    host, colon, port = address.rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]")
    # An IPv6 address needs brackets, or its last group could be taken for the port.
    ambiguous = ":" in host and not bracketed
    if not colon or ambiguous or not _PORT.match(port) or int(port) > _MAX_PORT:
        raise ValueError(
            f"{address!r} is not host:port with a port of 0-{_MAX_PORT}, e.g. 0.0.0.0:8080, :8080 or "
            "[::]:8080 (an empty value disables the endpoint)"
        )
    return (host[1:-1] if bracketed else host) or "0.0.0.0", int(port)


# The --mig-partitions values that name no GPU (see Settings.mig_partitions).
MIG_PARTITION_KEYWORDS = frozenset({"all", "none", "mig-mode", "auto"})


def partition_gpus(value: str) -> tuple[str, ...]:
    """The GPUs a ``mig_partitions`` list names, by minor number or UUID; ValueError names a bad one."""
    gpus = tuple(dict.fromkeys(part.strip() for part in value.split(",") if part.strip()))
    if not gpus:
        raise ValueError(
            "must be all, none, mig-mode, auto, or a comma-separated list of GPU UUIDs or minor numbers"
        )
    for gpu in gpus:
        if not (_GPU_MINOR.match(gpu) or _GPU_UUID.match(gpu)):
            raise ValueError(
                f"{gpu!r} is neither all, none, mig-mode, auto, a GPU minor number (0, 1, ...) nor a "
                "GPU UUID (GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx, as `nvidia-smi -L` lists them)"
            )
    return gpus


def xid_numbers(value: str) -> tuple[int, ...]:
    """The Xids of a comma-separated list, ``"13, 31"`` -> ``(13, 31)``; ValueError names a bad one."""
    xids = []
    for part in value.split(","):
        if not part.strip():
            continue
        try:
            xid = int(part)
        except ValueError:
            raise ValueError(f"{part.strip()!r} is not an Xid number; expected e.g. 13,31,43") from None
        if xid <= 0:
            raise ValueError(f"{xid} is not an Xid number; Xids are positive")
        xids.append(xid)
    return tuple(dict.fromkeys(xids))
