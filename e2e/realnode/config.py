"""The configuration files of a real node: containerd's, the kubelet's and the pod network's.

Pure functions of a `NodeLayout`, so that each setting that matters on this kind of machine is in
one place with the reason it is there (see docs/real-node.md). Paths under /var/lib, /var/log and
/run are seen inside the node's private mount namespace, where they are the node's scratch
directories (holder.py binds them); every other path is the same inside and out.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

NODE_NAME = "127.0.0.1"
CONTAINERD_SOCKET = "/run/containerd/containerd.sock"
# What the driver and the kubelet use by default: the chart's values need no change on this node.
KUBELET_ROOT = "/var/lib/kubelet"
CDI_DIR = "/var/run/cdi"
CNI_NETWORK = "dra-node"
CNI_PLUGIN = "dra-service"
# Pod addresses, on the node namespace's bridge only (nothing routes to them from the host).
POD_SUBNET = "10.88.0.0/24"
# The kernel tunables the kubelet insists on (protectKernelDefaults); holder.py shows it these
# values inside the namespace only, over the host's own.
KUBELET_SYSCTLS: Mapping[str, str] = {
    "vm/overcommit_memory": "1",
    "kernel/panic": "10",
    "kernel/panic_on_oops": "1",
}


@dataclass(frozen=True)
class NodeLayout:
    """Where one real node keeps its files, and what it connects to."""

    base: Path  # everything of this node, on the host
    cgroup_root: str  # e.g. /dra-real-node-1a2b3c: the kubelet's cgroupRoot, parent of kubepods
    kubelet_port: int
    kubelet_healthz_port: int
    runc: Path
    cni_plugin_dirs: tuple[Path, ...]  # the project's plugin first, then Debian's loopback
    sandbox_image: str
    feature_gates: Mapping[str, bool]
    service_ip: str  # the `kubernetes` Service's ClusterIP, served inside every pod's netns
    service_port: int

    @property
    def scratch(self) -> Path:
        """Bound over /var/lib, /var/log and /run inside the namespace (its subdirectories)."""
        return self.base / "root"

    @property
    def logs(self) -> Path:
        return self.base / "logs"

    @property
    def etc(self) -> Path:
        return self.base / "etc"

    @property
    def driver_root(self) -> Path:
        return self.base / "driver-root"

    @property
    def api_proxy_socket(self) -> Path:
        return self.base / "api-proxy.sock"

    def host_path(self, inside: str) -> Path:
        """Where a path under /var/lib, /var/log or /run of the namespace is on the host."""
        for top in ("/var/lib", "/var/log", "/run"):
            if inside == top or inside.startswith(top + "/"):
                return self.scratch / top.strip("/").replace("/", "-") / inside[len(top) :].lstrip("/")
        if inside.startswith("/var/run/"):
            return self.host_path("/run/" + inside.removeprefix("/var/run/"))
        return Path(inside)


def containerd_config(layout: NodeLayout) -> str:
    """containerd's config (version 3) as TOML. Only what differs from its defaults, and why."""
    cni = {
        "bin_dirs": [str(d) for d in layout.cni_plugin_dirs],
        "conf_dir": str(layout.etc / "cni"),
        "max_conf_num": 1,
    }
    runtime = {
        # The machine's capability bounding set lacks CAP_SYS_RESOURCE; without this every sandbox
        # fails with "can't get final child's PID from pipe: EOF".
        "restrict_oom_score_adj": True,
        # CDI is on by default in containerd 2; only the driver's directory, never the host's /etc/cdi.
        "cdi_spec_dirs": [CDI_DIR],
        "enable_criu": False,
        "disable_apparmor": True,
        "containerd": {
            "default_runtime_name": "runc",
            "runtimes": {
                "runc": {
                    "runtime_type": "io.containerd.runc.v2",
                    "options": {"BinaryName": str(layout.runc), "SystemdCgroup": False},
                }
            },
        },
        "cni": cni,
    }
    config: dict[str, Any] = {
        "version": 3,
        "root": "/var/lib/containerd",
        "state": "/run/containerd",
        "imports": [],  # nothing from the host's /etc/containerd
        "grpc": {"address": CONTAINERD_SOCKET},
        "ttrpc": {"address": CONTAINERD_SOCKET + ".ttrpc"},
        "debug": {"address": ""},
        "metrics": {"address": ""},
        "plugins": {
            "io.containerd.cri.v1.images": {
                "snapshotter": "overlayfs",
                # Images are imported (hack/build-image.sh), never pulled.
                "pinned_images": {"sandbox": layout.sandbox_image},
            },
            "io.containerd.cri.v1.runtime": runtime,
            # exec and attach streams: loopback only, on a port the kernel picks.
            "io.containerd.grpc.v1.cri": {"stream_server_address": "127.0.0.1", "stream_server_port": "0"},
            "io.containerd.internal.v1.opt": {"path": "/var/lib/containerd-opt"},
            "io.containerd.nri.v1.nri": {"disable": True},
        },
    }
    return _toml(config)


def kubelet_config(layout: NodeLayout, client_ca_file: Path) -> dict[str, Any]:
    """The KubeletConfiguration. Loopback only, cgroupfs, and no change to the host's settings."""
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "address": "127.0.0.1",
        "port": layout.kubelet_port,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": layout.kubelet_healthz_port,
        "containerRuntimeEndpoint": f"unix://{CONTAINERD_SOCKET}",
        # This machine has cgroup v1 and no systemd managing it: kubelet 1.37 refuses cgroup v1
        # unless told otherwise.
        "cgroupDriver": "cgroupfs",
        "failCgroupV1": False,
        "cgroupRoot": layout.cgroup_root,
        "cgroupsPerQOS": True,
        "failSwapOn": False,
        # No iptables rules on the host.
        "makeIPTablesUtilChains": False,
        # Left false, the kubelet writes vm.overcommit_memory, kernel.panic and kernel.panic_on_oops
        # to the host. True makes it only check them; holder.py shows it the values it wants.
        "protectKernelDefaults": True,
        "featureGates": dict(layout.feature_gates),
        # The API server presents a client certificate signed by this CA; what it may do, the
        # kubelet asks the API server (webhook authorization). No anonymous access.
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": True},
            "x509": {"clientCAFile": str(client_ca_file)},
        },
        "authorization": {"mode": "Webhook"},
        # No host DNS servers in pods: nothing in a pod may reach the machine's network.
        "resolvConf": "",
        # A shared build machine's disk or memory is no reason to evict test pods or delete images.
        "evictionHard": {"memory.available": "50Mi", "nodefs.available": "1%", "imagefs.available": "1%"},
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "serializeImagePulls": False,
        "podPidsLimit": -1,
        "maxPods": 110,
        "shutdownGracePeriod": "0s",
        "containerLogMaxSize": "10Mi",
        "nodeStatusUpdateFrequency": "2s",
        "syncFrequency": "10s",
    }


def kubelet_args(layout: NodeLayout, config: Path, kubeconfig: Path, labels: Mapping[str, str]) -> list[str]:
    return [
        f"--config={config}",
        f"--kubeconfig={kubeconfig}",
        f"--root-dir={KUBELET_ROOT}",
        f"--cert-dir={KUBELET_ROOT}/pki",
        # The Node is named 127.0.0.1 and gets that InternalIP (a loopback --node-ip is refused).
        f"--hostname-override={NODE_NAME}",
        f"--node-labels={','.join(f'{k}={v}' for k, v in sorted(labels.items()))}",
        "--v=2",
    ]


def cni_config(layout: NodeLayout) -> dict[str, Any]:
    """The pod network: a bridge inside the node's own network namespace (holder.py), which has no
    other interface than its `lo`, so a pod reaches only the node and the other pods; the kubelet's
    probes reach pods as on any node. Debian's bridge and host-local plugins make it (no IP
    masquerading: no iptables); the project's plugin then serves the `kubernetes` Service inside the
    pod's namespace (cni_plugin.py). containerd brings each pod's `lo` up itself."""
    return {
        "cniVersion": "1.0.0",
        "name": CNI_NETWORK,
        "plugins": [
            {
                "type": "bridge",
                "bridge": "cni0",
                "isGateway": True,
                "ipMasq": False,
                "hairpinMode": False,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": POD_SUBNET}]],
                    "dataDir": "/var/lib/cni/networks",
                },
            },
            {
                "type": CNI_PLUGIN,
                "proxySocket": str(layout.api_proxy_socket),
                "serviceIP": layout.service_ip,
                "servicePort": layout.service_port,
            },
        ],
    }


def cni_config_json(layout: NodeLayout) -> str:
    return json.dumps(cni_config(layout), indent=2) + "\n"


# --- a TOML writer for the plain tables, strings, numbers, booleans and lists above ---------------


def _toml(config: Mapping[str, Any]) -> str:
    lines: list[str] = []
    _table(lines, (), config)
    return "\n".join(lines) + "\n"


def _table(lines: list[str], path: tuple[str, ...], table: Mapping[str, Any]) -> None:
    scalars = {k: v for k, v in table.items() if not isinstance(v, Mapping)}
    tables = {k: v for k, v in table.items() if isinstance(v, Mapping)}
    if path:
        lines.append("")
        lines.append("[" + ".".join(_key(p) for p in path) + "]")
    for key, value in scalars.items():
        lines.append(f"{_key(key)} = {_value(value)}")
    for key, value in tables.items():
        _table(lines, (*path, key), value)


def _key(key: str) -> str:
    return key if key.replace("_", "").replace("-", "").isalnum() else json.dumps(key)


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    raise TypeError(f"no TOML for {value!r}")
