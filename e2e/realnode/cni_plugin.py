"""The real node's CNI plugin: the `kubernetes` Service inside each pod, over the pod's loopback.

It runs after Debian's `bridge` plugin (which gives the pod an address on a bridge inside the
node's own network namespace) in the chain of config.cni_config. On ADD it adds the Service's
ClusterIP to the pod's `lo` and listens on it, inside the pod's network namespace, handing the
listening socket to the node's API proxy (api_proxy.py), which forwards each connection to the API
server on the host's 127.0.0.1. In-cluster clients (the driver with its ServiceAccount token) work
unchanged, with no kube-proxy, no route and no firewall rule. The bridge's result passes through.

On DEL it asks the proxy to close that socket. Standard library only: containerd runs it as a
program, with the CNI_* environment variables and the network configuration on stdin.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import socket
import subprocess
import sys
from typing import Any

_CLONE_NEWNET = 0x40000000
CNI_VERSION = "1.0.0"
SUPPORTED = ["0.4.0", "1.0.0"]


class PluginError(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def _enter_netns(path: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            raise PluginError(11, f"cannot enter network namespace {path}: {os.strerror(ctypes.get_errno())}")
    finally:
        os.close(fd)


def _proxy_request(socket_path: str, message: dict[str, Any], fds: list[int] | None = None) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as control:
        control.settimeout(10)
        control.connect(socket_path)
        payload = json.dumps(message).encode()
        if fds:
            socket.send_fds(control, [payload], fds)
        else:
            control.sendall(payload)
        control.shutdown(socket.SHUT_WR)
        answer = control.recv(4096).decode()
    if answer.strip() != "ok":
        raise PluginError(11, f"the node's API proxy refused {message['op']}: {answer.strip()}")


def add(config: dict[str, Any], container_id: str, netns: str) -> dict[str, Any]:
    _enter_netns(netns)
    service_ip = config["serviceIP"]
    # `lo` is up (the loopback plugin); the Service's address joins 127.0.0.1 there.
    result = subprocess.run(
        ["ip", "address", "replace", f"{service_ip}/32", "dev", "lo"], capture_output=True, text=True
    )
    if result.returncode != 0:
        raise PluginError(11, f"ip address replace {service_ip}/32 dev lo: {result.stderr.strip()}")
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((service_ip, int(config["servicePort"])))
    listener.listen(64)
    try:
        _proxy_request(config["proxySocket"], {"op": "add", "id": container_id}, [listener.fileno()])
    finally:
        listener.close()
    previous: dict[str, Any] = config.get("prevResult") or {}
    if not previous.get("ips"):
        raise PluginError(11, "no address from the plugin before this one (the bridge) in the chain")
    return previous


def delete(config: dict[str, Any], container_id: str) -> None:
    # DEL must succeed when there is nothing to delete, also after the proxy is gone.
    with contextlib.suppress(OSError):
        _proxy_request(config["proxySocket"], {"op": "del", "id": container_id})


def main() -> int:
    command = os.environ.get("CNI_COMMAND", "")
    try:
        if command == "VERSION":
            print(json.dumps({"cniVersion": CNI_VERSION, "supportedVersions": SUPPORTED}))
            return 0
        config = json.loads(sys.stdin.read() or "{}")
        container_id = os.environ.get("CNI_CONTAINERID", "")
        if command == "ADD":
            print(json.dumps(add(config, container_id, os.environ["CNI_NETNS"])))
        elif command == "DEL":
            delete(config, container_id)
        elif command in ("CHECK", "GC", "STATUS"):
            pass
        else:
            raise PluginError(4, f"unknown CNI_COMMAND {command!r}")
        return 0
    except PluginError as err:
        print(json.dumps({"cniVersion": CNI_VERSION, "code": err.code, "msg": str(err)}))
        return 1
    except (OSError, KeyError, ValueError) as err:
        print(json.dumps({"cniVersion": CNI_VERSION, "code": 999, "msg": f"{type(err).__name__}: {err}"}))
        return 1


if __name__ == "__main__":
    sys.exit(main())
