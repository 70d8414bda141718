"""The simulated IMEX daemon's side of the ComputeDomainClique: how daemons of one clique enter,
report and leave, each writing only its own entry (against the in-memory API server)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable
from pathlib import Path

from dra_driver.computedomain.api import DomainStatus, Names
from dra_driver.computedomain.node import daemon_config_text
from dra_driver.simulated.imex_daemon import DaemonIdentity, ImexDaemon
from tests.computedomain.fake_api import FakeApi

NAMES = Names("gpu.nvidia.com")
UID = "0b9a8c1e-0000-4000-8000-000000000001"
CLIQUE = "6f1c2b7e-3d4a-4e5f-8a9b-0c1d2e3f4a5b.1"
PATH = f"/apis/resource.nvidia.com/v1beta1/namespaces/driver/computedomaincliques/{UID}.{CLIQUE}"


def daemon(
    api: FakeApi, tmp_path: Path, node: str, ip: str, *, port: int | None = None, dns_names: bool = True
) -> ImexDaemon:
    config = tmp_path / node
    config.mkdir(exist_ok=True)
    (config / "imexd.cfg").write_text(daemon_config_text(50000))
    identity = DaemonIdentity(
        node_name=node,
        ip_address=ip,
        clique=CLIQUE,
        domain_uid=UID,
        domain_name="cd",
        domain_namespace="ns",
        num_nodes=2,
        pod_namespace="driver",
        pod_name=f"daemon-{node}",
        pod_uid=f"uid-{node}",
    )
    made = ImexDaemon(
        None,  # type: ignore[arg-type]
        NAMES,
        identity,
        config,
        port=port,
        dns_names=dns_names,
        hosts_file=config / "hosts",
    )
    made._kube = api  # type: ignore[assignment]
    return made


def test_daemons_of_a_clique_share_one_object_each_writing_its_own_entry(tmp_path: Path) -> None:
    api = FakeApi()
    a1, a2 = daemon(api, tmp_path, "a1", "10.0.0.1"), daemon(api, tmp_path, "a2", "10.0.0.2")

    async def scenario() -> None:
        # Both enter at once: one creates the object, the other's create or write conflicts and
        # is retried, so neither entry is lost.
        await asyncio.gather(
            a1._update_entry(DomainStatus.NOT_READY), a2._update_entry(DomainStatus.NOT_READY)
        )
        await a2._update_entry(DomainStatus.READY)

    asyncio.run(scenario())
    clique = api.objects[PATH]
    assert clique["metadata"]["labels"] == {
        "resource.nvidia.com/computeDomain": UID,
        "resource.nvidia.com/computeDomain.cliqueID": CLIQUE,
    }
    assert sorted(o["uid"] for o in clique["metadata"]["ownerReferences"]) == ["uid-a1", "uid-a2"]
    entries = sorted((d["nodeName"], d["ipAddress"], d["index"], d["status"]) for d in clique["daemons"])
    assert entries == [("a1", "10.0.0.1", 0, "NotReady"), ("a2", "10.0.0.2", 1, "Ready")]

    asyncio.run(a1._withdraw())  # SIGTERM: a1 leaves, a2's entry and index stay
    assert [(d["nodeName"], d["index"]) for d in api.objects[PATH]["daemons"]] == [("a2", 1)]
    a3 = daemon(api, tmp_path, "a3", "10.0.0.3")
    asyncio.run(a3._update_entry(DomainStatus.NOT_READY))
    assert sorted((d["nodeName"], d["index"]) for d in api.objects[PATH]["daemons"]) == [("a2", 1), ("a3", 0)]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


async def _until(check: Callable[[], bool], what: str, within: float = 20.0) -> None:
    for _ in range(int(within / 0.05)):
        if check():
            return
        await asyncio.sleep(0.05)  # the daemons poll the API server too: nothing to wait on instead
    raise AssertionError(f"gave up after {within:.0f}s waiting for {what}")


def _statuses(api: FakeApi) -> dict[str, str]:
    return {d["nodeName"]: d["status"] for d in (api.objects.get(PATH) or {}).get("daemons", [])}


def test_with_dns_names_peers_are_found_by_name_and_a_new_address_is_followed(tmp_path: Path) -> None:
    """The nodes file holds fixed names; the hosts file maps them to the clique's addresses and
    follows a peer that comes back with another one, under the same name."""
    api = FakeApi()
    port = _free_port()

    async def scenario() -> None:
        stop_a1, stop_a2 = asyncio.Event(), asyncio.Event()
        a1 = asyncio.create_task(daemon(api, tmp_path, "a1", "127.0.0.41", port=port).run(stop_a1))
        await _until(lambda: _statuses(api) == {"a1": "Ready"}, "a1 alone")  # no wait for numNodes 2
        a2 = asyncio.create_task(daemon(api, tmp_path, "a2", "127.0.0.42", port=port).run(stop_a2))
        await _until(lambda: _statuses(api) == {"a1": "Ready", "a2": "Ready"}, "both linked")
        nodes_file = (tmp_path / "a1" / "nodes_config.cfg").read_text().split()
        assert nodes_file == [f"compute-domain-daemon-{i:04d}" for i in range(18)]
        hosts = (tmp_path / "a1" / "hosts").read_text()
        assert "127.0.0.41\tcompute-domain-daemon-0000\n127.0.0.42\tcompute-domain-daemon-0001\n" in hosts

        # a2's pod is replaced and comes back with another IP address: same index, same name.
        stop_a2.set()
        await a2
        stop_a2 = asyncio.Event()
        a2 = asyncio.create_task(daemon(api, tmp_path, "a2", "127.0.0.43", port=port).run(stop_a2))
        await _until(
            lambda: (
                "127.0.0.43\tcompute-domain-daemon-0001" in (tmp_path / "a1" / "hosts").read_text()
                and _statuses(api) == {"a1": "Ready", "a2": "Ready"}
            ),
            "a1 to follow a2's new address",
        )
        assert "127.0.0.42" not in (tmp_path / "a1" / "hosts").read_text()
        assert (tmp_path / "a1" / "nodes_config.cfg").read_text().split() == nodes_file  # unchanged
        stop_a1.set()
        stop_a2.set()
        await asyncio.gather(a1, a2)

    asyncio.run(scenario())


def test_without_dns_names_the_nodes_file_lists_addresses_and_waits_for_num_nodes(tmp_path: Path) -> None:
    api = FakeApi()
    port = _free_port()

    async def scenario() -> None:
        stop = asyncio.Event()
        a1 = asyncio.create_task(
            daemon(api, tmp_path, "a1", "127.0.0.51", port=port, dns_names=False).run(stop)
        )
        await _until(lambda: _statuses(api) == {"a1": "NotReady"}, "a1 entered")
        await asyncio.sleep(1.0)
        assert _statuses(api) == {"a1": "NotReady"}  # one of numNodes 2: it waits for its peer
        a2 = asyncio.create_task(
            daemon(api, tmp_path, "a2", "127.0.0.52", port=port, dns_names=False).run(stop)
        )
        await _until(lambda: _statuses(api) == {"a1": "Ready", "a2": "Ready"}, "both linked")
        assert (tmp_path / "a1" / "nodes_config.cfg").read_text() == "127.0.0.51\n127.0.0.52\n"
        assert not (tmp_path / "a1" / "hosts").exists()
        stop.set()
        await asyncio.gather(a1, a2)

    asyncio.run(scenario())


def test_a_daemon_whose_imex_part_cannot_start_says_why_and_recovers(tmp_path: Path) -> None:
    """Its peer port taken: the entry says NotReady with the error, until the port is free again."""
    api = FakeApi()
    port = _free_port()
    squatter = socket.socket()
    squatter.bind(("127.0.0.61", port))
    squatter.listen()

    async def scenario() -> None:
        stop = asyncio.Event()
        a1 = asyncio.create_task(daemon(api, tmp_path, "a1", "127.0.0.61", port=port).run(stop))

        def entry() -> dict[str, object]:
            daemons: list[dict[str, object]] = (api.objects.get(PATH) or {}).get("daemons", [])
            return daemons[0] if daemons else {}

        await _until(lambda: bool(entry().get("message")), "the failure in the entry")
        assert entry()["status"] == "NotReady"
        assert entry()["message"] == (
            f"IMEX daemon cannot listen on 127.0.0.61:{port}: Address already in use; retrying"
        )
        squatter.close()
        await _until(lambda: entry().get("status") == "Ready", "the restarted IMEX part", within=30)
        assert "message" not in entry()
        stop.set()
        await a1

    try:
        asyncio.run(scenario())
    finally:
        with contextlib.suppress(OSError):
            squatter.close()


def test_a_daemon_that_cannot_write_its_hosts_file_says_so(tmp_path: Path) -> None:
    api = FakeApi()
    a1 = daemon(api, tmp_path, "a1", "10.0.0.1")
    a1._hosts_file = tmp_path / "no-such-directory" / "hosts"
    (tmp_path / "a1" / "nodes_config.cfg").write_text("compute-domain-daemon-0000\n")

    async def scenario() -> None:
        await a1._update_entry(DomainStatus.NOT_READY)
        await a1._tick()

    asyncio.run(scenario())
    (entry,) = api.objects[PATH]["daemons"]
    assert entry["status"] == "NotReady"
    assert entry["message"] == (
        f"IMEX daemon cannot write {tmp_path}/no-such-directory/hosts: No such file or directory"
    )
