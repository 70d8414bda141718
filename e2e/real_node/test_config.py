"""The real node's configuration files say what docs/real-node.md says they say (no node started)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

from e2e.realnode import cni_plugin, config
from e2e.realnode.config import NodeLayout

LAYOUT = NodeLayout(
    base=Path("/tmp/node"),
    cgroup_root="/dra-real-node-test",
    kubelet_port=10250,
    kubelet_healthz_port=10248,
    runc=Path("/usr/sbin/runc"),
    cni_plugin_dirs=(Path("/tmp/node/cni-bin"), Path("/usr/lib/cni")),
    sandbox_image="localhost/dra-driver-pause:0.1.0",
    feature_gates={"DRAAdminAccess": True},
    service_ip="10.0.0.1",
    service_port=443,
)


def test_containerd_config_is_toml_with_the_settings_this_machine_needs() -> None:
    parsed: dict[str, Any] = tomllib.loads(config.containerd_config(LAYOUT))
    runtime = parsed["plugins"]["io.containerd.cri.v1.runtime"]
    assert parsed["version"] == 3
    assert parsed["imports"] == []
    assert runtime["restrict_oom_score_adj"] is True
    assert runtime["cdi_spec_dirs"] == ["/var/run/cdi"]
    runc = runtime["containerd"]["runtimes"]["runc"]["options"]
    assert runc == {"BinaryName": "/usr/sbin/runc", "SystemdCgroup": False}
    assert (
        parsed["plugins"]["io.containerd.cri.v1.images"]["pinned_images"]["sandbox"] == LAYOUT.sandbox_image
    )
    assert parsed["plugins"]["io.containerd.nri.v1.nri"]["disable"] is True
    assert parsed["plugins"]["io.containerd.grpc.v1.cri"]["stream_server_address"] == "127.0.0.1"


def test_kubelet_config_keeps_to_loopback_cgroupfs_and_the_hosts_tunables() -> None:
    kubelet = config.kubelet_config(LAYOUT, Path("/tmp/ca.crt"))
    assert (kubelet["cgroupDriver"], kubelet["failCgroupV1"], kubelet["cgroupRoot"]) == (
        "cgroupfs",
        False,
        "/dra-real-node-test",
    )
    assert kubelet["protectKernelDefaults"] is True
    assert kubelet["makeIPTablesUtilChains"] is False
    assert (kubelet["address"], kubelet["readOnlyPort"], kubelet["healthzBindAddress"]) == (
        "127.0.0.1",
        0,
        "127.0.0.1",
    )
    assert kubelet["authentication"]["anonymous"] == {"enabled": False}
    assert kubelet["authorization"] == {"mode": "Webhook"}
    assert config.KUBELET_SYSCTLS == {
        "vm/overcommit_memory": "1",
        "kernel/panic": "10",
        "kernel/panic_on_oops": "1",
    }


def test_pod_network_is_a_bridge_without_masquerading_then_the_service_plugin() -> None:
    bridge, service = config.cni_config(LAYOUT)["plugins"]
    assert (bridge["type"], bridge["ipMasq"]) == ("bridge", False)
    assert bridge["ipam"]["ranges"] == [[{"subnet": config.POD_SUBNET}]]
    assert service == {
        "type": config.CNI_PLUGIN,
        "proxySocket": "/tmp/node/api-proxy.sock",
        "serviceIP": "10.0.0.1",
        "servicePort": 443,
    }


def test_namespace_paths_map_to_the_nodes_scratch_directories() -> None:
    assert LAYOUT.host_path("/var/lib/kubelet/plugins") == Path("/tmp/node/root/var-lib/kubelet/plugins")
    assert LAYOUT.host_path("/var/run/cdi") == Path("/tmp/node/root/run/cdi")
    assert LAYOUT.host_path("/run/containerd") == Path("/tmp/node/root/run/containerd")
    assert LAYOUT.host_path("/tmp/node/driver-root") == Path("/tmp/node/driver-root")


def _plugin(command: str, stdin: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, cni_plugin.__file__],
        input=stdin,
        capture_output=True,
        text=True,
        env={**os.environ, "CNI_COMMAND": command, **env},
        check=False,
    )


def test_cni_plugin_answers_version_and_deletes_idempotently() -> None:
    version = _plugin("VERSION", "")
    assert version.returncode == 0
    assert "1.0.0" in json.loads(version.stdout)["supportedVersions"]
    conf = json.dumps(config.cni_config(LAYOUT)["plugins"][1] | {"cniVersion": "1.0.0", "name": "n"})
    # No proxy is listening: DEL still succeeds (CNI requires DEL to be repeatable).
    deleted = _plugin("DEL", conf, CNI_CONTAINERID="abc")
    assert (deleted.returncode, deleted.stdout) == (0, "")
    unknown = _plugin("FROB", conf)
    assert unknown.returncode == 1
    assert json.loads(unknown.stdout)["msg"] == "unknown CNI_COMMAND 'FROB'"
