"""The compute-domain driver on one node: its devices, and prepare/unprepare of channel and daemon claims."""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path
from typing import Any

import pytest

from dra_driver.cdi.store import SpecStore
from dra_driver.computedomain.api import (
    ChannelAllocationMode,
    ComputeDomain,
    Names,
    channel_config,
    daemon_config,
    parse_compute_domain,
)
from dra_driver.computedomain.node import ComputeDomainPreparer, compute_domain_slices
from dra_driver.node.store import STORE_FILE, open_store
from dra_driver.node.types import ClaimError
from tests.node.builders import InMemoryClaims, claim_json, new_ref, opaque, result

NAMES = Names("gpu.nvidia.com")
NODE = "tray-1"
CLIQUE = "8a2d6e1c-1b1e-4a3e-9f0a-2b6c1d7e5f40.1"


def domain(
    num_nodes: int = 2, nodes: list[dict[str, Any]] | None = None, namespace: str = "default"
) -> ComputeDomain:
    return parse_compute_domain(
        {
            "apiVersion": NAMES.api_version,
            "kind": "ComputeDomain",
            "metadata": {"name": "cd", "namespace": namespace, "uid": str(uuid.uuid4())},
            "spec": {"numNodes": num_nodes, "channel": {"resourceClaimTemplate": {"name": "cd-channel"}}},
            "status": {"status": "NotReady", "nodes": nodes or []},
        }
    )


class FakeDomains:
    def __init__(self, *domains: ComputeDomain) -> None:
        self.domains = {d.metadata.uid: d for d in domains}
        self.labels: dict[str, str] = {}  # node -> domain uid

    async def by_uid(self, uid: str) -> ComputeDomain | None:
        return self.domains.get(uid)

    async def member_nodes(self, uid: str) -> set[str]:
        return {node for node, owner in self.labels.items() if owner == uid}

    async def label_node(self, uid: str) -> str | None:
        current = self.labels.get(NODE)
        if current and current != uid:
            return current
        self.labels[NODE] = uid
        return None

    async def unlabel_node(self, uid: str | None) -> None:
        if NODE in self.labels and self.labels[NODE] == (uid or self.labels[NODE]):
            del self.labels[NODE]


BOOT = "boot-1"


def preparer(
    tmp_path: Path, domains: FakeDomains, claims: InMemoryClaims, boot_id: str = BOOT
) -> ComputeDomainPreparer:
    """A started preparer on the node's store (``tmp_path/state.db``), as a new plugin process starts it."""
    node = ComputeDomainPreparer(
        names=NAMES,
        node_name=NODE,
        clique=CLIQUE,
        claims=claims,
        domains=domains,
        specs=SpecStore(tmp_path / "cdi", NAMES.driver),
        store=open_store(tmp_path / STORE_FILE, boot_id).store,
        state_dir=tmp_path / "compute-domains",
        channel_major=234,
    )
    node.start(boot_id)
    return node


def channel_claim(
    claims: InMemoryClaims, cd: ComputeDomain, mode: ChannelAllocationMode = ChannelAllocationMode.SINGLE
):
    ref = new_ref("channel", cd.metadata.namespace)
    config = opaque(channel_config(NAMES, cd.metadata.uid, mode), driver=NAMES.driver)
    claims.put(claim_json(ref, [result("channel-0", "channel", driver=NAMES.driver, pool=NODE)], [config]))
    return ref


def spec_of(tmp_path: Path, claim_uid: str) -> dict[str, Any]:
    spec = SpecStore(tmp_path / "cdi", NAMES.driver).read(claim_uid)
    assert spec is not None
    return spec


def test_a_node_publishes_one_channel_and_one_daemon_device_with_its_clique() -> None:
    (content,) = compute_domain_slices(CLIQUE)
    devices = {d["name"]: d["attributes"] for d in content.devices}
    assert devices == {
        "channel-0": {"type": {"string": "channel"}, "id": {"int": 0}, "cliqueID": {"string": CLIQUE}},
        "daemon-0": {"type": {"string": "daemon"}, "id": {"int": 0}, "cliqueID": {"string": CLIQUE}},
    }


def test_names_follow_nvidia_when_deployed_as_nvidia() -> None:
    assert (NAMES.api_version, NAMES.driver, NAMES.label) == (
        "resource.nvidia.com/v1beta1",
        "compute-domain.nvidia.com",
        "resource.nvidia.com/computeDomain",
    )
    ours = Names("gpu.dra-driver.dev")
    assert (ours.api_version, ours.driver, ours.channel_class) == (
        "resource.dra-driver.dev/v1beta1",
        "compute-domain.dra-driver.dev",
        "compute-domain-default-channel.dra-driver.dev",
    )


def test_a_channel_waits_for_the_nodes_daemon_then_gets_the_channel_device(tmp_path: Path) -> None:
    cd = domain()
    domains, claims = FakeDomains(cd), InMemoryClaims()
    node = preparer(tmp_path, domains, claims)
    ref = channel_claim(claims, cd)

    waiting = asyncio.run(node.prepare([ref]))[ref.uid]
    assert isinstance(waiting, ClaimError)
    assert "waiting for the IMEX daemon of ComputeDomain default/cd on node tray-1" in waiting.message
    assert domains.labels == {NODE: cd.metadata.uid}  # the label brings the daemon to this node

    cd.status.nodes = parse_compute_domain(
        {
            **cd.model_dump(by_alias=True),
            "status": {"nodes": [{"name": NODE, "cliqueID": CLIQUE, "status": "Ready"}]},
        }
    ).status.nodes
    (device,) = asyncio.run(node.prepare([ref]))[ref.uid]  # type: ignore[misc]
    assert device.cdi_device_ids == (f"k8s.compute-domain.nvidia.com/claim={ref.uid}-channel-0",)
    (cdi,) = spec_of(tmp_path, ref.uid)["devices"]
    assert cdi["containerEdits"]["deviceNodes"] == [
        {"path": "/dev/nvidia-caps-imex-channels/channel0", "type": "c", "major": 234, "minor": 0}
    ]

    assert asyncio.run(node.unprepare([ref])) == {ref.uid: None}
    assert domains.labels == {}
    assert node.prepared_claim_uids() == set()
    assert SpecStore(tmp_path / "cdi", NAMES.driver).claim_uids() == set()


def test_allocation_mode_all_gives_every_channel(tmp_path: Path) -> None:
    cd = domain(nodes=[{"name": NODE, "cliqueID": CLIQUE, "status": "Ready"}])
    claims = InMemoryClaims()
    node = preparer(tmp_path, FakeDomains(cd), claims)
    ref = channel_claim(claims, cd, ChannelAllocationMode.ALL)
    asyncio.run(node.prepare([ref]))
    (cdi,) = spec_of(tmp_path, ref.uid)["devices"]
    assert len(cdi["containerEdits"]["deviceNodes"]) == 2048


def test_a_full_domain_keeps_an_extra_node_waiting(tmp_path: Path) -> None:
    cd = domain(num_nodes=2)
    domains, claims = FakeDomains(cd), InMemoryClaims()
    domains.labels = {"tray-2": cd.metadata.uid, "tray-3": cd.metadata.uid}
    ref = channel_claim(claims, cd)
    outcome = asyncio.run(preparer(tmp_path, domains, claims).prepare([ref]))[ref.uid]
    assert isinstance(outcome, ClaimError)
    assert "already has its 2 node(s) (tray-2, tray-3)" in outcome.message
    assert NODE not in domains.labels


def test_a_channel_outside_a_domain_is_refused_with_what_to_do(tmp_path: Path) -> None:
    claims = InMemoryClaims()
    ref = new_ref("loose")
    claims.put(claim_json(ref, [result("channel-0", "channel", driver=NAMES.driver, pool=NODE)]))
    outcome = asyncio.run(preparer(tmp_path, FakeDomains(), claims).prepare([ref]))[ref.uid]
    assert isinstance(outcome, ClaimError)
    assert "outside a ComputeDomain" in outcome.message
    assert "spec.channel.resourceClaimTemplate.name" in outcome.message


def test_a_channel_of_another_namespaces_domain_is_refused(tmp_path: Path) -> None:
    cd = domain(namespace="team-a")
    claims = InMemoryClaims()
    ref = new_ref("channel", "team-b")
    config = opaque(channel_config(NAMES, cd.metadata.uid, ChannelAllocationMode.SINGLE), driver=NAMES.driver)
    claims.put(claim_json(ref, [result("channel-0", "channel", driver=NAMES.driver, pool=NODE)], [config]))
    outcome = asyncio.run(preparer(tmp_path, FakeDomains(cd), claims).prepare([ref]))[ref.uid]
    assert isinstance(outcome, ClaimError)
    assert "namespace team-b" in outcome.message


def test_the_daemon_gets_its_config_directory_with_the_peers_addresses(tmp_path: Path) -> None:
    cd = domain(
        nodes=[
            {"name": "tray-2", "ipAddress": "10.0.0.2", "cliqueID": CLIQUE, "index": 1},
            {"name": NODE, "ipAddress": "10.0.0.1", "cliqueID": CLIQUE, "index": 0},
            {"name": "elsewhere", "ipAddress": "10.9.9.9", "cliqueID": "other.2", "index": 0},
        ]
    )
    claims = InMemoryClaims()
    ref = new_ref("daemon", "dra-driver")
    config = opaque(daemon_config(NAMES, cd.metadata.uid), driver=NAMES.driver)
    claims.put(claim_json(ref, [result("daemon-0", "daemon", driver=NAMES.driver, pool=NODE)], [config]))
    (device,) = asyncio.run(preparer(tmp_path, FakeDomains(cd), claims).prepare([ref]))[ref.uid]  # type: ignore[misc]
    assert device.device == "daemon-0"
    spec = spec_of(tmp_path, ref.uid)
    (mount,) = spec["containerEdits"]["mounts"]
    assert mount["containerPath"] == "/imexd"
    directory = Path(mount["hostPath"])
    assert (directory / "nodes_config.cfg").read_text() == "10.0.0.1\n10.0.0.2\n"
    assert "IMEX_NODE_CONFIG_FILE=/imexd/nodes_config.cfg" in (directory / "imexd.cfg").read_text()
    env = spec["devices"][0]["containerEdits"]["env"]
    assert f"COMPUTE_DOMAIN_UUID={cd.metadata.uid}" in env
    assert f"CLIQUE_ID={CLIQUE}" in env


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        (
            {"apiVersion": "resource.dra-driver.dev/v1beta1", "kind": "ComputeDomainChannelConfig"},
            "apiVersion",
        ),
        ({"apiVersion": NAMES.api_version, "kind": "GpuConfig"}, "kind 'GpuConfig'"),
        ({"apiVersion": NAMES.api_version, "kind": "ComputeDomainChannelConfig"}, "domainID"),
    ],
)
def test_bad_configs_are_refused_by_name(tmp_path: Path, parameters: dict[str, Any], message: str) -> None:
    claims = InMemoryClaims()
    ref = new_ref("channel")
    entry = opaque(parameters, driver=NAMES.driver)
    claims.put(claim_json(ref, [result("channel-0", "channel", driver=NAMES.driver, pool=NODE)], [entry]))
    outcome = asyncio.run(preparer(tmp_path, FakeDomains(), claims).prepare([ref]))[ref.uid]
    assert isinstance(outcome, ClaimError)
    assert message in outcome.message, json.dumps(outcome.message)
