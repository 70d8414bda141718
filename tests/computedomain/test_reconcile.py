"""One reconcile of the controller against an in-memory API server: what a user sees of a domain
that cannot be placed (condition, event, nothing created) and of one whose daemons met in their
ComputeDomainClique (status.nodes mirrored, departed nodes pruned, cliques deleted with the domain).

The end-to-end tests run the same against a real API server; these cover the cases a four-tray
rack cannot show, such as a cluster where no node has fabric info at all.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from dra_driver.apiserver.rest import ApiError
from dra_driver.computedomain.controller.reconciler import ComputeDomainController
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


def test_a_daemon_that_says_why_it_failed_is_named_at_once_a_silent_one_after_the_timeout() -> None:
    """DaemonFailed as soon as a daemon reports its error (NVIDIA #289: never Ready meanwhile);
    a daemon that is just not ready yet is waited for, then DaemonNotReady after the timeout."""
    api = FakeApi()
    with_domain(api, num_nodes=2)
    with_tray(api, "a1", domain=UID)
    with_tray(api, "a2", domain=UID)
    name = f"{UID}.{CLIQUE}"
    daemons = [
        {"nodeName": "a1", "ipAddress": "10.0.0.1", "cliqueID": CLIQUE, "index": 0, "status": "Ready"},
        {"nodeName": "a2", "ipAddress": "10.0.0.2", "cliqueID": CLIQUE, "index": 1, "status": "NotReady"},
    ]
    api.put(
        f"{CLIQUES}/{name}",
        {"metadata": {"name": name, "namespace": "driver", "labels": {LABEL: UID}}, "daemons": daemons},
    )
    ctl = ComputeDomainController(
        None, gpu_driver="gpu.nvidia.com", namespace="driver", daemon_image="img", daemon_ready_timeout=0.3
    )  # type: ignore[arg-type]
    ctl._kube = api  # type: ignore[assignment]

    async def settle() -> float | None:
        for _ in range(10):
            again = await ctl.reconcile("ns/cd")
            if again != 0.0:
                return again
        return None

    again = asyncio.run(settle())
    assert ready_condition(api)["reason"] == "WaitingForDaemons"
    assert again is not None
    assert 0 < again <= 0.3  # looked at again when the timeout runs out
    time.sleep(0.35)
    asyncio.run(settle())
    condition = ready_condition(api)
    assert (condition["reason"], api.objects[CD]["status"]["status"]) == ("DaemonNotReady", "NotReady")
    assert "the IMEX daemon on node(s) a2 is not ready after 0s" in condition["message"]

    failed = "IMEX daemon cannot listen on 10.0.0.2:50000: Address already in use; retrying"
    api.objects[f"{CLIQUES}/{name}"]["daemons"][1]["message"] = failed
    asyncio.run(settle())
    condition = ready_condition(api)
    assert (condition["reason"], api.objects[CD]["status"]["status"]) == ("DaemonFailed", "NotReady")
    assert condition["message"] == f"the IMEX daemon on node a2 failed: {failed}"
    assert [e[:2] for e in events(api)] == [
        ("Normal", "WaitingForDaemons"),
        ("Warning", "DaemonNotReady"),
        ("Warning", "DaemonFailed"),
    ]

    api.objects[f"{CLIQUES}/{name}"]["daemons"][1] = {**daemons[1], "status": "Ready"}  # recovered
    asyncio.run(settle())
    assert ready_condition(api)["reason"] == "DaemonsReady"
    assert api.objects[CD]["status"]["status"] == "Ready"


def with_named_domain(api: FakeApi, name: str, uid: str, num_nodes: int = 2, mode: str = "Single") -> str:
    path = f"/apis/{GROUP}/v1beta1/namespaces/ns/computedomains/{name}"
    api.put(
        path,
        {
            "apiVersion": f"{GROUP}/v1beta1",
            "kind": "ComputeDomain",
            "metadata": {"name": name, "namespace": "ns", "uid": uid, "generation": 1},
            "spec": {
                "numNodes": num_nodes,
                "channel": {"resourceClaimTemplate": {"name": f"{name}-channel"}, "allocationMode": mode},
            },
        },
    )
    return path


def pinned_clique(api: FakeApi, name: str) -> str:
    template = api.objects[f"/apis/resource.k8s.io/v1/namespaces/ns/resourceclaimtemplates/{name}-channel"]
    return str(template["metadata"]["annotations"][f"{GROUP}/clique"])


OTHER_CLIQUE = "6f1c2b7e-3d4a-4e5f-8a9b-0c1d2e3f4a5b.2"


def test_two_domains_reconciled_at_once_get_a_clique_each() -> None:
    """NVIDIA's Single and All examples created together, two workers reconciling them side by
    side, before any workload has labelled a node."""
    api = FakeApi()
    for node in ("a1", "a2"):
        with_tray(api, node)
    for node in ("b1", "b2"):
        with_tray(api, node, OTHER_CLIQUE)
    with_named_domain(api, "single", "0b9a8c1e-0000-4000-8000-00000000000a")
    with_named_domain(api, "all", "0b9a8c1e-0000-4000-8000-00000000000b", mode="All")
    ctl = controller(api)

    async def settle(key: str) -> None:
        for _ in range(10):
            if await ctl.reconcile(key) != 0.0:
                return

    async def both() -> None:
        await asyncio.gather(settle("ns/single"), settle("ns/all"))

    asyncio.run(both())
    assert {pinned_clique(api, "single"), pinned_clique(api, "all")} == {CLIQUE, OTHER_CLIQUE}


def test_a_new_leader_recalls_the_cliques_given_before_placing_another_domain() -> None:
    api = FakeApi()
    for node in ("a1", "a2"):
        with_tray(api, node)
    for node in ("b1", "b2"):
        with_tray(api, node, OTHER_CLIQUE)
    first = controller(api)
    with_named_domain(api, "single", "0b9a8c1e-0000-4000-8000-00000000000a")
    asyncio.run(first.reconcile("ns/single"))  # the finalizer
    asyncio.run(first.reconcile("ns/single"))  # placed; its workload has not landed
    taken = pinned_clique(api, "single")

    # The leader goes; the next one recalls the placement from the channel template, then places.
    second = controller(api)
    asyncio.run(second.recall_placements())
    assert {uid: p.clique for uid, p in second.placed.items()} == {
        "0b9a8c1e-0000-4000-8000-00000000000a": taken
    }
    with_named_domain(api, "all", "0b9a8c1e-0000-4000-8000-00000000000b", mode="All")
    asyncio.run(second.reconcile("ns/all"))
    asyncio.run(second.reconcile("ns/all"))
    assert pinned_clique(api, "all") == ({CLIQUE, OTHER_CLIQUE} - {taken}).pop()

    # A third finds both cliques held and waits, saying so; deleting the first frees its clique.
    path = with_named_domain(api, "third", "0b9a8c1e-0000-4000-8000-00000000000c")
    asyncio.run(second.reconcile("ns/third"))
    asyncio.run(second.reconcile("ns/third"))
    conditions = api.objects[path]["status"]["conditions"]
    assert [(c["reason"], c["status"]) for c in conditions] == [("CliqueBusy", "False")]
    single = f"/apis/{GROUP}/v1beta1/namespaces/ns/computedomains/single"
    api.objects[single]["metadata"]["deletionTimestamp"] = "2026-12-01T00:00:00Z"

    async def cleaned_up_then_next_key() -> str:
        for name in ("single", "all", "third"):  # what the watch reports; each key queued once
            second._on_domain(
                "ADDED", api.objects[f"/apis/{GROUP}/v1beta1/namespaces/ns/computedomains/{name}"]
            )
        for _ in range(3):
            second.queue.done(await second.queue.get())
        await second.reconcile("ns/single")
        return await asyncio.wait_for(second.queue.get(), timeout=1)

    assert asyncio.run(cleaned_up_then_next_key()) == "ns/third"  # the waiting domain looks at once
    asyncio.run(second.reconcile("ns/third"))
    assert pinned_clique(api, "third") == taken


def test_placements_are_recalled_once_the_api_server_answers() -> None:
    """A leader elected while the API server's storage is still initializing asks again, not exits."""

    class Starting(FakeApi):
        refusals = 2

        async def list(self, path: str, **query: str) -> dict[str, Any]:
            if self.refusals:
                self.refusals -= 1
                raise ApiError(429, "TooManyRequests", "storage is (re)initializing")
            return await super().list(path, **query)

    api = Starting()
    with_tray(api, "a1")
    with_named_domain(api, "single", UID)
    api.put(
        "/apis/resource.k8s.io/v1/namespaces/ns/resourceclaimtemplates/single-channel",
        {"metadata": {"labels": {LABEL: UID}, "annotations": {f"{GROUP}/clique": CLIQUE}}},
    )
    ctl = controller(api)
    asyncio.run(ctl.recall_placements())
    assert api.refusals == 0
    assert {uid: (p.clique, p.nodes) for uid, p in ctl.placed.items()} == {UID: (CLIQUE, 2)}


def test_the_controller_creates_the_channel_template_as_kubectl_sends_it() -> None:
    """Else the API server refuses every status write of its claims: the binding conditions'
    (docs/binding-conditions.md)."""
    api = FakeApi()
    with_domain(api, num_nodes=1)
    with_tray(api, "a1")
    reconcile_until_settled(api)
    assert api.as_kubectl == {"/apis/resource.k8s.io/v1/namespaces/ns/resourceclaimtemplates/cd-channel"}
