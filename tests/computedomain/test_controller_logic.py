"""The controller's decisions, as pure functions: which clique a domain gets, when it is Ready, what it
creates; and its work queue."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest

from dra_driver.computedomain.api import DomainStatus, InvalidComputeDomain, Names, parse_compute_domain
from dra_driver.computedomain.controller.objects import (
    Fabric,
    Placement,
    channel_template,
    choose_clique,
    daemon_set,
    fabric_from_slices,
    free_nodes,
    merge_conditions,
    overall_status,
)
from dra_driver.computedomain.controller.workqueue import WorkQueue
from dra_driver.computedomain.node import compute_domain_slices

NAMES = Names("gpu.nvidia.com")


def domain(num_nodes: int = 2, nodes: list[dict[str, Any]] | None = None):  # type: ignore[no-untyped-def]
    return parse_compute_domain(
        {
            "metadata": {"name": "cd", "namespace": "ns", "uid": str(uuid.uuid4())},
            "spec": {"numNodes": num_nodes, "channel": {"resourceClaimTemplate": {"name": "cd-channel"}}},
            "status": {"nodes": nodes or []},
        }
    )


def slice_of(node: str, clique: str) -> dict[str, Any]:
    (content,) = compute_domain_slices(clique)
    return {"spec": {"driver": NAMES.driver, "nodeName": node, "devices": list(content.devices)}}


FABRIC = fabric_from_slices(
    NAMES,
    [
        slice_of("a1", "c.1"),
        slice_of("a2", "c.1"),
        slice_of("b1", "c.2"),
        slice_of("b2", "c.2"),
        slice_of("b3", "c.2"),
    ],
)


def test_slices_tell_which_nodes_are_on_which_clique() -> None:
    assert FABRIC.cliques == {"c.1": frozenset({"a1", "a2"}), "c.2": frozenset({"b1", "b2", "b3"})}
    other = {
        "spec": {
            "driver": "gpu.nvidia.com",
            "nodeName": "x",
            "devices": [{"name": "gpu-0", "attributes": {}}],
        }
    }
    assert fabric_from_slices(NAMES, [other]).cliques == {}


def test_a_domain_gets_the_clique_with_most_free_nodes() -> None:
    cd = domain(2)
    assert choose_clique(cd, FABRIC, {}, {}).clique == "c.2"
    busy = {"b1": "another", "b2": "another"}
    assert choose_clique(cd, FABRIC, {}, busy).clique == "c.1"
    assert (
        choose_clique(cd, FABRIC, {}, {"b1": cd.metadata.uid, "a1": "another"}).clique == "c.2"
    )  # its own count


def test_a_placed_domain_holds_its_clique_before_its_workload_lands() -> None:
    """Two domains placed back to back, no node labelled yet: the second gets the other clique."""
    first, second, third = domain(2), domain(2), domain(2)
    placed: dict[str, Placement] = {}
    for cd in (first, second):
        choice = choose_clique(cd, FABRIC, placed, {})
        placed[cd.metadata.uid] = Placement.of(cd, choice.clique)
    assert placed[first.metadata.uid].clique == "c.2"
    assert placed[second.metadata.uid].clique == "c.1"
    # Both cliques held (c.2 has one node left): a third waits, and says how many are free.
    choice = choose_clique(third, FABRIC, placed, {})
    assert (choice.clique, choice.reason) == ("", "CliqueBusy")
    assert "(at most 1)" in choice.message
    # A domain's own placement does not count against it, when it is placed again.
    assert choose_clique(second, FABRIC, placed, {}).clique == "c.1"


def test_a_domain_holds_num_nodes_or_the_nodes_serving_it_whichever_is_more() -> None:
    elastic = domain(0)
    placed = {elastic.metadata.uid: Placement.of(elastic, "c.2")}
    assert placed[elastic.metadata.uid].nodes == 1  # any size: one node, before its workload lands
    assert free_nodes("new", FABRIC, placed, {}) == {"c.1": 2, "c.2": 2}
    serving = {"b1": elastic.metadata.uid, "b2": elastic.metadata.uid}
    assert free_nodes("new", FABRIC, placed, serving) == {"c.1": 2, "c.2": 1}
    # A node serving a domain the record does not know is taken all the same.
    assert free_nodes("new", FABRIC, {}, {"a1": "unknown"}) == {"c.1": 1, "c.2": 3}


@pytest.mark.parametrize(
    ("fabric", "busy", "reason", "message"),
    [
        (Fabric(), {}, "NoFabric", "no node reports NVLink fabric info"),
        (
            FABRIC,
            {},
            "DomainLargerThanClique",
            "numNodes 4 is larger than every NVLink clique: the largest has 3",
        ),
        (FABRIC, {"b1": "x", "b2": "x", "a1": "y"}, "CliqueBusy", "no NVLink clique has 4 node(s) free"),
    ],
)
def test_no_clique_fits_says_why(fabric: Fabric, busy: dict[str, str], reason: str, message: str) -> None:
    num_nodes = 3 if reason == "CliqueBusy" else 4
    if reason == "NoFabric":
        num_nodes = 1
    choice = choose_clique(domain(num_nodes), fabric, {}, busy)
    assert choice.clique == ""
    assert choice.reason == reason
    assert message.replace("4 node(s) free", f"{num_nodes} node(s) free") in choice.message


def test_ready_once_num_nodes_daemons_of_the_clique_are_ready() -> None:
    ready = {"cliqueID": "c.1", "status": "Ready"}
    assert overall_status(domain(2, [{"name": "a1", **ready}]), "c.1") is DomainStatus.NOT_READY
    both = [{"name": "a1", **ready}, {"name": "a2", **ready}]
    assert overall_status(domain(2, both), "c.1") is DomainStatus.READY
    assert overall_status(domain(2, both), "c.2") is DomainStatus.NOT_READY  # not the domain's clique
    one_down = [{"name": "a1", **ready}, {"name": "a2", "cliqueID": "c.1", "status": "NotReady"}]
    assert overall_status(domain(0, one_down), "c.1") is DomainStatus.NOT_READY  # numNodes 0: all of them
    assert overall_status(domain(0, both), "c.1") is DomainStatus.READY


def test_the_channel_template_pins_the_clique_and_names_the_domain() -> None:
    cd = domain(2)
    template = channel_template(NAMES, cd, "c.1")
    (request,) = template["spec"]["spec"]["devices"]["requests"]
    assert request["exactly"]["deviceClassName"] == "compute-domain-default-channel.nvidia.com"
    assert request["exactly"]["selectors"][0]["cel"]["expression"] == (
        "device.attributes['compute-domain.nvidia.com'].cliqueID == 'c.1'"
    )
    (config,) = template["spec"]["spec"]["devices"]["config"]
    assert config["opaque"]["parameters"] == {
        "apiVersion": "resource.nvidia.com/v1beta1",
        "kind": "ComputeDomainChannelConfig",
        "domainID": cd.metadata.uid,
        "allocationMode": "Single",
    }
    assert (template["metadata"]["name"], template["metadata"]["namespace"]) == ("cd-channel", "ns")


def test_the_daemon_set_runs_where_the_domains_label_is() -> None:
    cd = domain(2)
    ds = daemon_set(NAMES, cd, "driver-ns", "img:1")
    spec = ds["spec"]["template"]["spec"]
    assert spec["nodeSelector"] == {"resource.nvidia.com/computeDomain": cd.metadata.uid}
    assert spec["resourceClaims"] == [
        {
            "name": "compute-domain-daemon",
            "resourceClaimTemplateName": f"computedomain-daemon-{cd.metadata.uid}",
        }
    ]


@pytest.mark.parametrize("dns_names", [True, False])
def test_the_daemons_get_the_dns_names_mode_through_their_environment(dns_names: bool) -> None:
    ds = daemon_set(NAMES, domain(2), "driver-ns", "img:1", dns_names=dns_names)
    (container,) = ds["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["DRA_IMEX_DAEMONS_WITH_DNS_NAMES"] == str(dns_names).lower()


def test_a_condition_keeps_its_transition_time_while_its_status_holds() -> None:
    old = [{"type": "Ready", "status": "False", "reason": "A", "lastTransitionTime": "t0"}]
    same = merge_conditions(
        old, [{"type": "Ready", "status": "False", "reason": "B", "lastTransitionTime": "t1"}]
    )
    assert same[0]["lastTransitionTime"] == "t0"
    flipped = merge_conditions(
        old, [{"type": "Ready", "status": "True", "reason": "C", "lastTransitionTime": "t1"}]
    )
    assert flipped[0]["lastTransitionTime"] == "t1"


def test_a_bad_domain_is_refused_by_field() -> None:
    with pytest.raises(InvalidComputeDomain, match=r"spec\.channel"):
        parse_compute_domain({"metadata": {"name": "x"}, "spec": {"numNodes": 1}})


def test_the_queue_coalesces_keys_and_never_hands_one_out_twice() -> None:
    async def scenario() -> list[str]:
        queue = WorkQueue()
        queue.add("a")
        queue.add("a")
        queue.add("b")
        first = await queue.get()
        queue.add(first)  # changed while being processed: queued again only when done
        second = await queue.get()
        assert {first, second} == {"a", "b"}
        assert len(queue) == 0
        queue.done(first)
        queue.done(second)
        third = await asyncio.wait_for(queue.get(), 1)
        return [first, second, third]

    first, _, third = asyncio.run(scenario())
    assert third == first


def test_the_queue_backs_off_exponentially_and_forgets() -> None:
    async def scenario() -> list[float]:
        queue = WorkQueue(base_delay=0.01, max_delay=0.04)
        delays = [queue.add_rate_limited("a") for _ in range(4)]
        queue.forget("a")
        delays.append(queue.add_rate_limited("a"))
        assert await asyncio.wait_for(queue.get(), 1) == "a"
        queue.close()
        return delays

    assert asyncio.run(scenario()) == [0.01, 0.02, 0.04, 0.04, 0.01]
