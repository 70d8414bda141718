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
   connection to each, it reports Ready;
4. losing a peer (its connection ends) makes it NotReady until the peer is back;
5. on SIGTERM it removes its own entry and exits 0.

How it names its peers is NVIDIA's ``IMEXDaemonsWithDNSNames`` (on by default, see
:mod:`dra_driver.computedomain.dnsnames`): the nodes file lists 18 fixed DNS names, the daemon keeps
its pod's ``/etc/hosts`` mapping them to the clique's current addresses, resolves its peers through
that file, and reports Ready without waiting for ``numNodes`` peers (only the domain's status waits
for them). With it off, the nodes file holds the peers' IP addresses and the daemon is Ready only once
``numNodes`` of them are there.

A daemon whose IMEX part cannot start (its peer port taken, say) does not exit: like NVIDIA's
wrapper restarting a crashed ``nvidia-imex``, it tries again every few seconds, and until then its
entry says NotReady with the error in ``message``, which the controller puts into the domain's
``Ready`` condition (reason ``DaemonFailed``).

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
from pydantic import ValidationError

from dra_driver.apiserver.kube import ApiClient
from dra_driver.apiserver.rest import ApiError, Json, JsonApi
from dra_driver.computedomain.api import (
    CLIQUE_KIND,
    CLIQUE_PLURAL,
    ComputeDomainDaemonInfo,
    DomainStatus,
    Names,
    clique_object_name,
)
from dra_driver.computedomain.dnsnames import (
    dns_name,
    hosts_file_text,
    name_to_address,
    resolve,
    static_nodes_config,
)
from dra_driver.computedomain.node import DAEMON_CONFIG, DAEMON_CONFIG_DIR, IMEX_SERVER_PORT, NODES_CONFIG

log = structlog.get_logger(__name__)

_POLL_S = 0.5
_RECONNECT_S = 0.5
_RESTART_S = 2.0  # a failed IMEX part is started again this often, as NVIDIA's watchdog does


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
        dns_names: bool = True,
        hosts_file: Path = Path("/etc/hosts"),
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
        self._dns_names = dns_names
        self._hosts_file = hosts_file
        self._links: dict[str, asyncio.Task[None]] = {}
        self._connected: set[str] = set()
        self._reported: tuple[DomainStatus, str] | None = None
        self._failure = ""  # why the IMEX part is not running; "" while it runs
        self._files_failure = ""  # why the nodes or hosts file cannot be written; "" while they can

    async def run(self, stop: asyncio.Event) -> None:
        if self._dns_names:
            _write_atomically(self._nodes_file, static_nodes_config())
            log.info("nodes config written: fixed DNS names", file=str(self._nodes_file))
        server: asyncio.Server | None = None
        next_start = 0.0
        try:
            await self._report(DomainStatus.NOT_READY)
            while not stop.is_set():
                now = asyncio.get_running_loop().time()
                if server is None and now >= next_start:
                    server = await self._listen()
                    next_start = now + _RESTART_S
                try:
                    await self._tick()
                except ApiError as error:
                    log.warning("ComputeDomain status not readable or writable", error=str(error))
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(_POLL_S):
                        await stop.wait()
        finally:
            if server is not None:
                server.close()
            for task in self._links.values():
                task.cancel()
            with contextlib.suppress(Exception):
                await self._withdraw()
            log.info("IMEX daemon stopped", node=self._me.node_name)

    async def _listen(self) -> asyncio.Server | None:
        """Start the IMEX part (the peer listener); None, with the reason kept, if it cannot."""
        address = f"{self._me.ip_address}:{self._port}"
        try:
            server = await asyncio.start_server(self._accept, self._me.ip_address, self._port)
        except OSError as error:
            why = os.strerror(error.errno) if error.errno else str(error)
            failure = f"IMEX daemon cannot listen on {address}: {why}; retrying"
            if failure != self._failure:
                log.warning("IMEX daemon failed", error=failure)
            self._failure = failure
            return None
        self._failure = ""
        log.info(
            "IMEX daemon (simulated) listening",
            address=address,
            domain=self._me.domain_uid,
            clique=self._me.clique,
        )
        return server

    async def _tick(self) -> None:
        clique = await self._kube.get(self._path)
        if clique is None:
            self._reported = None  # not created yet (or removed): create it and enter again
            entries: list[ComputeDomainDaemonInfo] = []
        else:
            entries = _entries(clique, self._me.clique)
        mine = next((n for n in entries if n.node_name == self._me.node_name), None)
        if mine is None or mine.ip_address != self._me.ip_address:
            self._reported = None  # our entry was pruned or is stale: enter again
        try:
            peers, quorum = self._peers(entries, mine)
            self._files_failure = ""
        except OSError as error:  # e.g. a read-only /etc/hosts: not ready, and the entry says why
            peers, quorum = [], False
            self._files_failure = (
                f"IMEX daemon cannot write {error.filename}: {os.strerror(error.errno or 0)}"
            )
        for address in peers:
            if address not in self._links:
                self._links[address] = asyncio.create_task(self._link(address))
        for address in [a for a in self._links if a not in peers]:
            self._links.pop(address).cancel()
            self._connected.discard(address)
        ready = not self._why_not and quorum and all(a in self._connected for a in peers)
        await self._report(DomainStatus.READY if ready else DomainStatus.NOT_READY)

    @property
    def _why_not(self) -> str:
        """Why this daemon cannot be ready whatever its peers do ("" when nothing stands in the way)."""
        return self._failure or self._files_failure

    def _peers(
        self, entries: list[ComputeDomainDaemonInfo], mine: ComputeDomainDaemonInfo | None
    ) -> tuple[list[str], bool]:
        """The peers' addresses, with the files that name them brought up to date, and whether there
        are enough of them (with DNS names always: NVIDIA's daemons do not wait for numNodes)."""
        if self._dns_names:
            return self._peers_by_name(entries, mine), True
        peers = [
            n.ip_address
            for n in sorted(entries, key=lambda n: (n.index, n.node_name))
            if n.node_name != self._me.node_name and n.ip_address
        ]
        _write_if_changed(self._nodes_file, sorted({self._me.ip_address, *peers}), "nodes config")
        return peers, len(peers) + 1 >= max(self._me.num_nodes, 1)

    def _peers_by_name(
        self, entries: list[ComputeDomainDaemonInfo], mine: ComputeDomainDaemonInfo | None
    ) -> list[str]:
        """The peers' addresses, found as ``nvidia-imex`` finds them: the names of the nodes file,
        looked up in the hosts file, which is first brought in line with the clique's entries."""
        names = name_to_address(entries, self._me.clique)
        try:
            current = self._hosts_file.read_text()
        except FileNotFoundError:
            current = ""
        wanted = hosts_file_text(current, names)
        if wanted != current:
            # In place, not by rename: a container's /etc/hosts is a file bind-mounted by the kubelet.
            self._hosts_file.write_text(wanted)
            log.info("DNS names updated", hosts=str(self._hosts_file), names=dict(sorted(names.items())))
        own = dns_name(mine.index) if mine is not None else None
        addresses = []
        for name in self._nodes_file.read_text().split():
            address = resolve(wanted, name) if name != own else None
            if address and address != self._me.ip_address:
                addresses.append(address)
        return addresses

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
        if (status, self._why_not) == self._reported:
            return
        await self._update_entry(status, self._why_not)
        self._reported = (status, self._why_not)
        log.info("reported to the ComputeDomain", status=status.value, node=self._me.node_name)

    async def _update_entry(self, status: DomainStatus | None, message: str = "") -> None:
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
                entry: Json = {
                    "nodeName": self._me.node_name,
                    "ipAddress": self._me.ip_address,
                    "cliqueID": self._me.clique,
                    "index": index,
                    "status": status.value,
                }
                if message:
                    entry["message"] = message
                others.append(entry)
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


def _entries(clique: Json, clique_id: str) -> list[ComputeDomainDaemonInfo]:
    """The daemons of ``clique_id`` in a ComputeDomainClique (a hand-edited bad entry is skipped)."""
    entries = []
    for item in clique.get("daemons") or []:
        with contextlib.suppress(ValidationError):
            entry = ComputeDomainDaemonInfo.model_validate(item)
            if entry.clique_id == clique_id:
                entries.append(entry)
    return entries


def _write_if_changed(path: Path, lines: list[str], what: str) -> None:
    text = "".join(f"{line}\n" for line in lines)
    with contextlib.suppress(FileNotFoundError):
        if path.read_text() == text:
            return
    _write_atomically(path, text)
    log.info(f"{what} updated", lines=lines)


def _write_atomically(path: Path, text: str) -> None:
    temp = path.with_name(f".{path.name}.tmp")
    temp.write_text(text)
    temp.replace(path)


async def run_daemon(
    api: ApiClient,
    names: Names,
    config_dir: Path,
    port: int | None = None,
    *,
    dns_names: bool = True,
    hosts_file: Path = Path("/etc/hosts"),
) -> None:
    identity = DaemonIdentity.from_environment()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    daemon = ImexDaemon(
        api, names, identity, config_dir, port=port, dns_names=dns_names, hosts_file=hosts_file
    )
    await daemon.run(stop)
