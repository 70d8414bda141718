"""``dra-driver compute-domain-daemon``: a simulated IMEX daemon with the real one's lifecycle.

What runs in each IMEX daemon pod of a ComputeDomain. On a real rack that is NVIDIA's
``nvidia-imex`` (wrapped by NVIDIA's compute-domain-daemon); no such binary or NVLink exists here,
so this process plays its part in the protocol the rest of the system sees, and says so:

1. it reads its configuration where prepare mounted it (``/imexd/imexd.cfg``: the peer port and the
   nodes file) and the domain's identity from the environment prepare injected;
2. it enters itself (node, IP address, clique, index, NotReady) into the domain's
   ComputeDomainClique of its clique -- ``<domainUID>.<cliqueID>`` in its own namespace, created by
   the first daemon there and owned by the daemon pods -- as NVIDIA's daemon does, and keeps the
   nodes file current with the peers listed there (the controller copies the entries into the
   domain's ``status.nodes``);
3. it listens on its peer port and connects to every peer in the nodes file; once it holds a
   connection to each and the domain has ``numNodes`` members on its clique, it reports Ready;
4. losing a peer (its connection ends) makes it NotReady until the peer is back;
5. on SIGTERM it removes its own entry and exits 0.

Each daemon writes only its own entry, with the object's resourceVersion, so concurrent writers
retry instead of losing each other's entries.

What is simulated: the "IMEX" links are plain TCP connections that carry nothing, and no GPU memory
is shared. Everything else -- the status protocol, the nodes file, readiness -- is what the
controller and the kubelet plugin see of a real daemon.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from dataclasses import dataclass
from pathlib import Path

import structlog

from dra_driver.computedomain.api import (
    CLIQUE_KIND,
    CLIQUE_PLURAL,
    DomainStatus,
    Names,
    clique_object_name,
)
from dra_driver.computedomain.node import DAEMON_CONFIG, DAEMON_CONFIG_DIR, IMEX_SERVER_PORT, NODES_CONFIG
from dra_driver.kube import ApiClient
from dra_driver.rest import ApiError, Json, JsonApi

log = structlog.get_logger(__name__)

_POLL_S = 0.5
_RECONNECT_S = 0.5


@dataclass(frozen=True)
class DaemonIdentity:
    """Who this daemon is: from the downward API and the CDI environment of its claim."""

    node_name: str
    ip_address: str
    clique: str
    domain_uid: str
    domain_name: str
    domain_namespace: str
    num_nodes: int
    pod_namespace: str
    pod_name: str = ""
    pod_uid: str = ""  # the clique's owner reference: it goes with the last daemon pod

    @classmethod
    def from_environment(cls) -> DaemonIdentity:
        missing = [
            name
            for name in (
                "NODE_NAME",
                "POD_IP",
                "POD_NAMESPACE",
                "CLIQUE_ID",
                "COMPUTE_DOMAIN_UUID",
                "COMPUTE_DOMAIN_NAME",
            )
            if not os.environ.get(name)
        ]
        if missing:
            raise ValueError(
                f"missing environment {', '.join(missing)}: the downward API sets NODE_NAME, POD_IP and "
                "POD_NAMESPACE, the "
                "prepared daemon claim (CDI) sets the rest; run this only in a ComputeDomain's daemon pod"
            )
        return cls(
            node_name=os.environ["NODE_NAME"],
            ip_address=os.environ["POD_IP"],
            clique=os.environ["CLIQUE_ID"],
            domain_uid=os.environ["COMPUTE_DOMAIN_UUID"],
            domain_name=os.environ["COMPUTE_DOMAIN_NAME"],
            domain_namespace=os.environ.get("COMPUTE_DOMAIN_NAMESPACE", ""),
            num_nodes=int(os.environ.get("COMPUTE_DOMAIN_NUM_NODES") or 0),
            pod_namespace=os.environ["POD_NAMESPACE"],
            pod_name=os.environ.get("POD_NAME", ""),
            pod_uid=os.environ.get("POD_UID", ""),
        )


def read_config(config_dir: Path) -> dict[str, str]:
    """``KEY=VALUE`` lines of ``imexd.cfg`` (comments and blanks skipped)."""
    values: dict[str, str] = {}
    for line in (config_dir / DAEMON_CONFIG).read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            key, _, value = line.partition("=")
            values[key.strip()] = value.strip()
    return values


class ImexDaemon:
    def __init__(
        self,
        api: ApiClient,
        names: Names,
        identity: DaemonIdentity,
        config_dir: Path,
        *,
        port: int | None = None,
    ) -> None:
        self._kube = JsonApi(api)
        self._names = names
        self._me = identity
        self._dir = config_dir
        config = read_config(config_dir)
        self._port = port or int(config.get("SERVER_PORT") or IMEX_SERVER_PORT)
        nodes_file = config.get("IMEX_NODE_CONFIG_FILE") or f"{DAEMON_CONFIG_DIR}/{NODES_CONFIG}"
        # The path is as the container sees it; a daemon run outside one finds it in its config dir.
        self._nodes_file = config_dir / Path(nodes_file).name
        self._collection = f"/apis/{names.api_version}/namespaces/{identity.pod_namespace}/{CLIQUE_PLURAL}"
        self._name = clique_object_name(identity.domain_uid, identity.clique)
        self._path = f"{self._collection}/{self._name}"
        self._links: dict[str, asyncio.Task[None]] = {}
        self._connected: set[str] = set()
        self._reported: DomainStatus | None = None

    async def run(self, stop: asyncio.Event) -> None:
        server = await asyncio.start_server(self._accept, self._me.ip_address, self._port)
        log.info(
            "IMEX daemon (simulated) listening",
            address=f"{self._me.ip_address}:{self._port}",
            domain=self._me.domain_uid,
            clique=self._me.clique,
        )
        try:
            await self._report(DomainStatus.NOT_READY)
            while not stop.is_set():
                try:
                    await self._tick()
                except ApiError as error:
                    log.warning("ComputeDomain status not readable or writable", error=str(error))
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(_POLL_S):
                        await stop.wait()
        finally:
            server.close()
            for task in self._links.values():
                task.cancel()
            with contextlib.suppress(Exception):
                await self._withdraw()
            log.info("IMEX daemon stopped", node=self._me.node_name)

    async def _tick(self) -> None:
        clique = await self._kube.get(self._path)
        if clique is None:
            self._reported = None  # not created yet (or removed): create it and enter again
            entries: list[Json] = []
        else:
            entries = [n for n in clique.get("daemons") or [] if n.get("cliqueID") == self._me.clique]
        mine = next((n for n in entries if n.get("nodeName") == self._me.node_name), None)
        if mine is None or mine.get("ipAddress") != self._me.ip_address:
            self._reported = None  # our entry was pruned or is stale: enter again
        peers = sorted(
            (n for n in entries if n.get("nodeName") != self._me.node_name and n.get("ipAddress")),
            key=lambda n: (int(n.get("index") or 0), str(n.get("nodeName"))),
        )
        addresses = [self._me.ip_address, *(str(n["ipAddress"]) for n in peers)]
        self._write_nodes_file(sorted(set(addresses)))
        for address in addresses[1:]:
            if address not in self._links:
                self._links[address] = asyncio.create_task(self._link(address))
        for address in [a for a in self._links if a not in addresses]:
            self._links.pop(address).cancel()
            self._connected.discard(address)
        quorum = len(addresses) >= max(self._me.num_nodes, 1)
        ready = quorum and all(a in self._connected for a in addresses[1:])
        await self._report(DomainStatus.READY if ready else DomainStatus.NOT_READY)

    def _write_nodes_file(self, addresses: list[str]) -> None:
        text = "".join(f"{address}\n" for address in addresses)
        with contextlib.suppress(FileNotFoundError):
            if self._nodes_file.read_text() == text:
                return
        temp = self._nodes_file.with_name(f".{self._nodes_file.name}.tmp")
        temp.write_text(text)
        temp.replace(self._nodes_file)
        log.info("nodes config updated", nodes=addresses)

    async def _link(self, address: str) -> None:
        """Hold a connection to one peer; its end means the peer is lost."""
        while True:
            try:
                reader, writer = await asyncio.open_connection(address, self._port)
            except OSError:
                await asyncio.sleep(_RECONNECT_S)
                continue
            self._connected.add(address)
            log.info("peer connected", peer=address)
            try:
                writer.write(f"{self._me.node_name}\n".encode())
                await writer.drain()
                while await reader.read(4096):
                    pass
            except OSError:
                pass
            finally:
                self._connected.discard(address)
                writer.close()
            log.warning("peer lost", peer=address)
            await asyncio.sleep(_RECONNECT_S)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A peer's link: held open until either side goes."""
        try:
            while await reader.read(4096):
                pass
        except (OSError, asyncio.CancelledError):
            pass  # shutting down (the server cancels its handlers) or the peer reset the link
        finally:
            writer.close()

    async def _report(self, status: DomainStatus) -> None:
        if status is self._reported:
            return
        await self._update_entry(status)
        self._reported = status
        log.info("reported to the ComputeDomain", status=status.value, node=self._me.node_name)

    async def _update_entry(self, status: DomainStatus | None) -> None:
        """Upsert (or, for None, remove) our entry in the clique's daemons; retried on conflicts."""
        for _ in range(20):
            obj = await self._kube.get(self._path)
            if obj is None:
                if status is None:
                    return
                obj = await self._create_clique()
                if obj is None:
                    continue  # another daemon created it first: read theirs
            daemons: list[Json] = list(obj.get("daemons") or [])
            others = [n for n in daemons if n.get("nodeName") != self._me.node_name]
            if status is not None:
                mine = next((n for n in daemons if n.get("nodeName") == self._me.node_name), None)
                taken = {int(n.get("index") or 0) for n in others if n.get("cliqueID") == self._me.clique}
                index = next(i for i in range(len(taken) + 1) if i not in taken)
                if mine is not None and int(mine.get("index") or 0) not in taken:
                    index = int(mine.get("index") or 0)  # (clique, index) stays one node's for good
                others.append(
                    {
                        "nodeName": self._me.node_name,
                        "ipAddress": self._me.ip_address,
                        "cliqueID": self._me.clique,
                        "index": index,
                        "status": status.value,
                    }
                )
            body = {**obj, "daemons": others}
            if status is not None:
                body["metadata"] = self._owned(body["metadata"])
            try:
                await self._kube.replace(self._path, body)
                return
            except ApiError as error:
                if error.status not in (404, 409):  # 404: deleted meanwhile, create it again
                    raise
        raise RuntimeError("the ComputeDomainClique kept changing; giving up this update")

    async def _create_clique(self) -> Json | None:
        """The clique object, as the first daemon of the clique creates it; None if one exists."""
        body = {
            "apiVersion": self._names.api_version,
            "kind": CLIQUE_KIND,
            "metadata": self._owned(
                {
                    "name": self._name,
                    "namespace": self._me.pod_namespace,
                    "labels": {
                        self._names.label: self._me.domain_uid,
                        self._names.clique_label: self._me.clique,
                    },
                }
            ),
            "daemons": [],
        }
        try:
            return await self._kube.create(self._collection, body)
        except ApiError as error:
            if error.status == 409:
                return None
            raise

    def _owned(self, metadata: Json) -> Json:
        """``metadata`` with this daemon's pod among the owners: the clique goes with the last one."""
        if not (self._me.pod_uid and self._me.pod_name):
            return metadata
        owners: list[Json] = list(metadata.get("ownerReferences") or [])
        if any(o.get("uid") == self._me.pod_uid for o in owners):
            return metadata
        mine = {"apiVersion": "v1", "kind": "Pod", "name": self._me.pod_name, "uid": self._me.pod_uid}
        return {**metadata, "ownerReferences": [*owners, mine]}

    async def _withdraw(self) -> None:
        await self._update_entry(None)


async def run_daemon(api: ApiClient, names: Names, config_dir: Path, port: int | None = None) -> None:
    identity = DaemonIdentity.from_environment()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await ImexDaemon(api, names, identity, config_dir, port=port).run(stop)
