"""The real node's bridge to the host's loopback: the only way in or out of its network namespaces.

`python -m e2e.realnode.api_proxy CONTROL_SOCKET TARGET_PORT`, in the host's network namespace.
Over CONTROL_SOCKET it receives listening sockets made in other namespaces, and joins each
connection accepted on them to a new connection to 127.0.0.1:TARGET_PORT (the API server) made
here:

- `add` (the CNI plugin, cni_plugin.py): a socket on the `kubernetes` Service's ClusterIP inside a
  pod's namespace -- in-cluster clients such as the driver reach the API server unchanged;
- `node` (holder.py): a socket on 127.0.0.1:TARGET_PORT inside the node's namespace, for the
  kubelet, and that namespace itself: the proxy then also listens on the host's
  127.0.0.1:kubeletPort and connects each caller to the kubelet's port inside the node's
  namespace, with sockets made there by a thread that entered it (the node's address as the host
  sees it; the API server itself goes through EGRESS_SOCKET when it has one).

With EGRESS_SOCKET (`... CONTROL_SOCKET TARGET_PORT EGRESS_SOCKET`) it is also the API server's
way into the cluster, as Konnectivity is on a managed control plane: the API server's egress
selector sends its `cluster` traffic (admission webhooks behind a Service, resolved to the pod's
address by --enable-aggregator-routing; logs and exec) as HTTP CONNECT over that Unix socket, and
the proxy connects to the address asked for from inside the node's namespace, where the pods'
bridge is. The chart's webhook then runs as the Deployment and Service it is, with no route from
the host to the pod network.

A socket keeps the namespace it was created in, which is what lets one process serve them all
without any route, address or firewall rule between namespaces: nothing leaves a loopback
interface or the node's own namespaces.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import json
import os
import signal
import socket
import sys
from pathlib import Path

_MAX_FDS = 2
_CLONE_NEWNET = 0x40000000
_CONNECT_SECONDS = 10.0


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()


async def _answer(writer: asyncio.StreamWriter, status: bytes) -> None:
    with contextlib.suppress(ConnectionError, OSError):
        writer.write(b"HTTP/1.1 " + status + b"\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()
    writer.close()


def _enter(netns_fd: int) -> None:
    if ctypes.CDLL(None, use_errno=True).setns(netns_fd, _CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), "setns into the node's network namespace failed")


class ApiProxy:
    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.servers: dict[str, asyncio.Server] = {}
        # One thread lives in the node's network namespace and makes the sockets used there.
        self.node_sockets: concurrent.futures.ThreadPoolExecutor | None = None

    async def _forward(self, pod_reader: asyncio.StreamReader, pod_writer: asyncio.StreamWriter) -> None:
        try:
            api_reader, api_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            pod_writer.close()
            return
        await asyncio.gather(_pipe(pod_reader, api_writer), _pipe(api_reader, pod_writer))

    async def add_node(self, listener: socket.socket, netns_fd: int, kubelet_port: int) -> None:
        await self.add("node", listener)
        if self.node_sockets is not None:
            self.node_sockets.shutdown(wait=False)
        self.node_sockets = concurrent.futures.ThreadPoolExecutor(1, initializer=_enter, initargs=(netns_fd,))
        executor = self.node_sockets

        async def to_kubelet(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            inside = await self._open_in_node(executor, "127.0.0.1", kubelet_port)
            if inside is None:
                writer.close()
                return
            await asyncio.gather(_pipe(reader, inside[1]), _pipe(inside[0], writer))

        await self.remove("kubelet")
        self.servers["kubelet"] = await asyncio.start_server(to_kubelet, "127.0.0.1", kubelet_port)

    async def _open_in_node(
        self, executor: concurrent.futures.ThreadPoolExecutor, host: str, port: int
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        """A connection to host:port made inside the node's network namespace; None if refused."""
        loop = asyncio.get_running_loop()
        inside = await loop.run_in_executor(executor, socket.socket, socket.AF_INET, socket.SOCK_STREAM)
        inside.setblocking(False)
        try:
            await asyncio.wait_for(loop.sock_connect(inside, (host, port)), _CONNECT_SECONDS)
            return await asyncio.open_connection(sock=inside)
        except (OSError, TimeoutError):
            inside.close()
            return None

    async def egress(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One HTTP CONNECT of the API server's egress selector: joined to host:port in the node."""
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), _CONNECT_SECONDS)
            method, target, _ = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ", 2)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ValueError):
            writer.close()
            return
        host, _, port = target.rpartition(":")
        executor = self.node_sockets
        if method != "CONNECT" or not port.isdigit():
            await _answer(writer, b"405 Method Not Allowed" if method != "CONNECT" else b"400 Bad Request")
            return
        if executor is None:
            await _answer(writer, b"503 No Node Yet")
            return
        address = (host.strip("[]"), int(port))
        inside = await self._open_in_node(executor, *address)
        if inside is None:
            await _answer(writer, b"502 Bad Gateway")
            return
        writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
        await asyncio.gather(_pipe(reader, inside[1]), _pipe(inside[0], writer))

    async def add(self, pod: str, listener: socket.socket) -> None:
        await self.remove(pod)
        listener.setblocking(False)
        self.servers[pod] = await asyncio.start_server(self._forward, sock=listener)

    async def remove(self, pod: str) -> None:
        server = self.servers.pop(pod, None)
        if server is not None:
            server.close()

    def control(self, connection: socket.socket, loop: asyncio.AbstractEventLoop) -> None:
        """One request of the CNI plugin: JSON {"op": "add"|"del", "id": ...}, a listener for add.

        Runs in a worker thread (recv_fds blocks); the servers live on `loop`."""
        connection.setblocking(True)
        connection.settimeout(5)
        try:
            message, fds, _, _ = socket.recv_fds(connection, 65536, _MAX_FDS)
            request = json.loads(message)
            if request["op"] == "add":
                if len(fds) != 1:
                    raise ValueError("add without a listening socket")
                listener = socket.socket(fileno=fds[0])
                asyncio.run_coroutine_threadsafe(self.add(request["id"], listener), loop).result(10)
            elif request["op"] == "node":
                if len(fds) != 2:
                    raise ValueError("node without a listening socket and a network namespace")
                listener = socket.socket(fileno=fds[0])
                node = self.add_node(listener, fds[1], int(request["kubeletPort"]))
                asyncio.run_coroutine_threadsafe(node, loop).result(10)
            elif request["op"] == "del":
                for fd in fds:
                    os.close(fd)
                asyncio.run_coroutine_threadsafe(self.remove(request["id"]), loop)
            else:
                raise ValueError(f"unknown op {request['op']!r}")
            connection.sendall(b"ok")
        except (OSError, ValueError, KeyError) as err:
            with contextlib.suppress(OSError):
                connection.sendall(f"error: {err}".encode())
        finally:
            connection.close()


async def serve(control_path: Path, target_port: int, egress_path: Path | None = None) -> None:
    proxy = ApiProxy(target_port)
    # One egress socket per control plane: a second node started on it (one refused at start, in
    # the tests) leaves the running node's proxy serving it, and removes only a socket of its own.
    egress_inode = None
    if egress_path is not None and not _serving(egress_path):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(egress_path)
        proxy.servers["egress"] = await asyncio.start_unix_server(proxy.egress, str(egress_path))
        egress_inode = os.stat(egress_path).st_ino
    with contextlib.suppress(FileNotFoundError):
        os.unlink(control_path)
    control = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    control.bind(str(control_path))
    control.listen(16)
    control.setblocking(False)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    async def accept_loop() -> None:
        while True:
            connection, _ = await loop.sock_accept(control)
            # recv_fds is blocking; a request is tiny and the plugin waits for the answer.
            loop.run_in_executor(None, proxy.control, connection, loop)

    acceptor = asyncio.create_task(accept_loop())
    await stop.wait()
    acceptor.cancel()
    for pod in list(proxy.servers):
        await proxy.remove(pod)
    control.close()
    os.unlink(control_path)
    if egress_path is not None and egress_inode is not None:
        with contextlib.suppress(FileNotFoundError):
            if os.stat(egress_path).st_ino == egress_inode:
                os.unlink(egress_path)


def _serving(path: Path) -> bool:
    """Whether another process accepts connections on the Unix socket ``path``."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(str(path))
        except OSError:
            return False
    return True


def main(argv: list[str]) -> int:
    control_path, target_port = Path(argv[0]), int(argv[1])
    asyncio.run(serve(control_path, target_port, Path(argv[2]) if len(argv) > 2 else None))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
