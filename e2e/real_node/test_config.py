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


def test_api_proxy_tunnels_the_api_servers_egress_into_the_node(tmp_path: Path) -> None:
    """HTTP CONNECT over the egress socket reaches host:port inside the node's network namespace (here
    this process's own, standing in for the node's); before a node joined, and for anything but
    CONNECT, the proxy answers with an HTTP error the API server reports."""
    import asyncio
    import concurrent.futures

    from e2e.realnode import api_proxy

    async def exchange(path: Path, request: bytes, payload: bytes = b"") -> bytes:
        reader, writer = await asyncio.open_unix_connection(str(path))
        writer.write(request + payload)
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(4096), 10)
        if payload and answer.endswith(b"\r\n\r\n"):
            answer += await asyncio.wait_for(reader.read(4096), 10)
        writer.close()
        return answer

    async def scenario() -> list[bytes]:
        async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(b"echo:" + await reader.read(100))
            await writer.drain()
            writer.close()

        target = await asyncio.start_server(echo, "127.0.0.1", 0)
        port = target.sockets[0].getsockname()[1]
        proxy = api_proxy.ApiProxy(target_port=1)
        egress = tmp_path / "egress.sock"
        server = await asyncio.start_unix_server(proxy.egress, str(egress))
        connect = f"CONNECT 127.0.0.1:{port} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode()
        answers = [await exchange(egress, connect)]  # no node yet
        answers.append(await exchange(egress, b"GET / HTTP/1.1\r\n\r\n"))
        netns = os.open("/proc/self/ns/net", os.O_RDONLY)
        node = concurrent.futures.ThreadPoolExecutor(1, initializer=api_proxy._enter, initargs=(netns,))
        proxy.node_sockets = node
        try:
            answers.append(await exchange(egress, connect, b"hello"))
        finally:
            node.shutdown()
            os.close(netns)
            server.close()
            target.close()
        return answers

    no_node, not_connect, tunnelled = asyncio.run(scenario())
    assert no_node.startswith(b"HTTP/1.1 503 ")
    assert not_connect.startswith(b"HTTP/1.1 405 ")
    assert tunnelled == b"HTTP/1.1 200 Connection established\r\n\r\necho:hello"


def test_api_proxy_leaves_an_egress_socket_another_proxy_serves(tmp_path: Path) -> None:
    """A second node on one control plane (one refused at start) must not take over, nor remove,
    the running node's egress socket: the API server would lose its way to the pods."""
    import socket

    from e2e.realnode import api_proxy

    path = tmp_path / "egress.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as served:
        served.bind(str(path))
        served.listen()
        assert api_proxy._serving(path)
    assert path.exists()  # what a proxy killed outright leaves: a file nobody serves
    assert not api_proxy._serving(path)
