"""One reconcile of the controller against an in-memory API server: what a user sees of a domain
that cannot be placed (condition, event, nothing created) and of one whose daemons met in their
ComputeDomainClique (status.nodes mirrored, departed nodes pruned, cliques deleted with the domain).

The end-to-end tests run the same against a real API server; these cover the cases a four-tray
rack cannot show, such as a cluster where no node has fabric info at all.
"""

from __future__ import annotations

import asyncio
from typing import Any

from dra_driver.computedomain.controller import ComputeDomainController
from dra_driver.computedomain.node import compute_domain_slices
from tests.computedomain.fake_api import FakeApi

GROUP = "resource.nvidia.com"
CD = f"/apis/{GROUP}/v1beta1/namespaces/ns/computedomains/cd"
CLIQUES = f"/apis/{GROUP}/v1beta1/namespaces/driver/computedomaincliques"
LABEL = f"{GROUP}/computeDomain"
UID = "0b9a8c1e-0000-4000-8000-000000000001"
CLIQUE = "6f1c2b7e-3d4a-4e5f-8a9b-0c1d2e3f4a5b.1"


def controller(api: FakeApi) -> ComputeDomainController:
    made = ComputeDomainController(None, gpu_driver="gpu.nvidia.com", namespace="driver", daemon_image="img")  # type: ignore[arg-type]
    made._kube = api  # type: ignore[assignment]
    return made


def with_domain(api: FakeApi, num_nodes: int) -> None:
    api.put(
        CD,
        {
            "apiVersion": f"{GROUP}/v1beta1",
            "kind": "ComputeDomain",
            "metadata": {"name": "cd", "namespace": "ns", "uid": UID, "generation": 1},
            "spec": {"numNodes": num_nodes, "channel": {"resourceClaimTemplate": {"name": "cd-channel"}}},
        },
    )


def with_tray(api: FakeApi, node: str, clique: str = CLIQUE, domain: str = "") -> None:
    (content,) = compute_domain_slices(clique)
    api.put(
        f"/apis/resource.k8s.io/v1/resourceslices/{node}-cd",
        {
            "metadata": {"name": f"{node}-cd"},
            "spec": {
                "driver": "compute-domain.nvidia.com",
                "nodeName": node,
                "devices": list(content.devices),
            },
        },
    )
    api.put(
        f"/api/v1/nodes/{node}", {"metadata": {"name": node, "labels": {LABEL: domain} if domain else {}}}
    )


def reconcile_until_settled(api: FakeApi) -> None:
    ctl = controller(api)

    async def run() -> None:
        for _ in range(10):  # a reconcile asking to look again at once (0.0) is followed by another
            again = await ctl.reconcile("ns/cd")
            if again != 0.0:
                return

    asyncio.run(run())


def ready_condition(api: FakeApi) -> dict[str, Any]:
    conditions = api.objects[CD].get("status", {}).get("conditions", [])
    return next(c for c in conditions if c["type"] == "Ready")


def events(api: FakeApi) -> list[tuple[str, str, str]]:
    return [(e["type"], e["reason"], e["message"]) for e in api.under("/api/v1/namespaces/ns/events")]


def created(api: FakeApi) -> list[str]:
    """What the controller made beside the domain: templates, DaemonSets, cliques."""
    return sorted(
        p for p in api.objects if "resourceclaimtemplates" in p or "daemonsets" in p or CLIQUES in p
    )


def test_no_node_with_fabric_info_gives_a_condition_an_event_and_nothing_else() -> None:
    api = FakeApi()
    with_domain(api, num_nodes=2)
    api.put("/api/v1/nodes/h100", {"metadata": {"name": "h100"}})  # GPUs, but no compute-domain slice
    reconcile_until_settled(api)
    condition = ready_condition(api)
    assert (condition["status"], condition["reason"]) == ("False", "NoFabric")
    assert "no node reports NVLink fabric info" in condition["message"]
    assert api.objects[CD]["status"]["status"] == "NotReady"
    assert events(api) == [("Warning", "NoFabric", condition["message"])]
    assert created(api) == []
    reconcile_until_settled(api)  # judged again: the same condition, no second event
    assert len(events(api)) == 1


def test_a_domain_larger_than_every_clique_creates_nothing() -> None:
    api = FakeApi()
    with_domain(api, num_nodes=3)
    with_tray(api, "a1")
    with_tray(api, "a2")
    reconcile_until_settled(api)
    assert ready_condition(api)["reason"] == "DomainLargerThanClique"
    assert [e[1] for e in events(api)] == ["DomainLargerThanClique"]
    assert created(api) == []


def test_the_daemons_clique_entries_become_the_status_and_departed_nodes_are_pruned() -> None:
    api = FakeApi()
    with_domain(api, num_nodes=2)
    with_tray(api, "a1", domain=UID)
    with_tray(api, "a2", domain=UID)
    with_tray(api, "a3")  # left the domain: its entry is stale
    name = f"{UID}.{CLIQUE}"

    def entry(node: str, index: int) -> dict[str, Any]:
        return {
            "nodeName": node,
            "ipAddress": f"10.0.0.{index}",
            "cliqueID": CLIQUE,
            "index": index,
            "status": "Ready",
        }

    api.put(
        f"{CLIQUES}/{name}",
        {
            "metadata": {"name": name, "namespace": "driver", "labels": {LABEL: UID}},
            "daemons": [entry("a2", 1), entry("a3", 2), entry("a1", 0)],
        },
    )
    reconcile_until_settled(api)
    assert [d["nodeName"] for d in api.objects[f"{CLIQUES}/{name}"]["daemons"]] == ["a2", "a1"]
    status = api.objects[CD]["status"]
    assert status["nodes"] == [
        {"name": "a1", "ipAddress": "10.0.0.0", "cliqueID": CLIQUE, "index": 0, "status": "Ready"},
        {"name": "a2", "ipAddress": "10.0.0.1", "cliqueID": CLIQUE, "index": 1, "status": "Ready"},
    ]
    assert status["status"] == "Ready"
    assert ready_condition(api)["reason"] == "DaemonsReady"

    # Deleted, with no node serving it any more: everything it created goes, the clique too.
    for node in ("a1", "a2"):
        api.objects[f"/api/v1/nodes/{node}"]["metadata"]["labels"] = {}
    api.objects[CD]["metadata"]["deletionTimestamp"] = "2026-12-01T00:00:00Z"
    reconcile_until_settled(api)
    assert created(api) == []
    assert api.objects[CD]["metadata"]["finalizers"] == []
