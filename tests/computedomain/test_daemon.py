"""The simulated IMEX daemon's side of the ComputeDomainClique: how daemons of one clique enter,
report and leave, each writing only its own entry (against the in-memory API server)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from dra_driver.computedomain.api import DomainStatus, Names
from dra_driver.computedomain.daemon import DaemonIdentity, ImexDaemon
from dra_driver.computedomain.node import daemon_config_text
from tests.computedomain.fake_api import FakeApi

NAMES = Names("gpu.nvidia.com")
UID = "0b9a8c1e-0000-4000-8000-000000000001"
CLIQUE = "6f1c2b7e-3d4a-4e5f-8a9b-0c1d2e3f4a5b.1"
PATH = f"/apis/resource.nvidia.com/v1beta1/namespaces/driver/computedomaincliques/{UID}.{CLIQUE}"


def daemon(api: FakeApi, tmp_path: Path, node: str, ip: str) -> ImexDaemon:
    config = tmp_path / node
    config.mkdir()
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
    made = ImexDaemon(None, NAMES, identity, config)  # type: ignore[arg-type]
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
