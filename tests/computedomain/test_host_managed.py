"""The host-managed IMEX mode (NVIDIA's HostManagedIMEXDaemon): the hosts run nvidia-imex, the driver
runs no IMEX daemons. What a node publishes and prepares, what the controller makes of a domain, and
the check of the host's daemon, real and simulated."""

from __future__ import annotations

import asyncio
import copy
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from dra_driver.cdi.store import SpecStore
from dra_driver.computedomain.api import ChannelAllocationMode, daemon_config
from dra_driver.computedomain.controller.reconciler import ComputeDomainController
from dra_driver.computedomain.node import ComputeDomainPreparer, compute_domain_slices
from dra_driver.devices.host_imex import IMEX_CTL, NvidiaImexCtl, judge
from dra_driver.node.store import STORE_FILE, open_store
from dra_driver.node.types import ClaimError, PreparedDevice
from dra_driver.simulated.gpus import STATE_FILE_NAME, SimulatedBackend, SimulatedHostImex
from tests.computedomain.fake_api import FakeApi
from tests.computedomain.test_node import (
    BOOT,
    CLIQUE,
    NAMES,
    NODE,
    FakeDomains,
    channel_claim,
    domain,
    spec_of,
)
from tests.node.builders import InMemoryClaims, claim_json, new_ref, opaque, result


class HostDaemon:
    """The host's nvidia-imex as the preparer sees it: ready, or not with a reason; counts the checks."""

    def __init__(self) -> None:
        self.reason: str | None = None
        self.checks = 0

    def not_ready(self) -> str | None:
        self.checks += 1
        return self.reason


def host_managed_preparer(
    tmp_path: Path, domains: FakeDomains, claims: InMemoryClaims, host: HostDaemon
) -> ComputeDomainPreparer:
    node = ComputeDomainPreparer(
        names=NAMES,
        node_name=NODE,
        clique=CLIQUE,
        claims=claims,
        domains=domains,
        specs=SpecStore(tmp_path / "cdi", NAMES.driver),
        store=open_store(tmp_path / STORE_FILE, BOOT).store,
        state_dir=tmp_path / "compute-domains",
        channel_major=234,
        host_imex=host,
    )
    node.start(BOOT)
    return node


# --- the node ------------------------------------------------------------------------------------


def test_a_host_managed_node_publishes_its_channel_and_no_daemon_device() -> None:
    (content,) = compute_domain_slices(CLIQUE, daemon=False)
    assert [(d["name"], d["attributes"]["type"]) for d in content.devices] == [
        ("channel-0", {"string": "channel"})
    ]


def test_a_channel_gets_channel_0_at_once_when_the_hosts_daemon_is_ready_and_labels_nothing(
    tmp_path: Path,
) -> None:
    cd = domain(num_nodes=2)  # no daemon in its status: none of ours will ever report
    domains, claims, host = FakeDomains(cd), InMemoryClaims(), HostDaemon()
    node = host_managed_preparer(tmp_path, domains, claims, host)
    ref = channel_claim(claims, cd, ChannelAllocationMode.ALL)  # All: still channel 0 alone

    (prepared,) = asyncio.run(node.prepare([ref]))[ref.uid]  # type: ignore[misc]
    assert isinstance(prepared, PreparedDevice)
    assert prepared.cdi_device_ids == (f"k8s.{NAMES.driver}/claim={ref.uid}-channel-0",)
    (device,) = spec_of(tmp_path, ref.uid)["devices"]
    assert device["containerEdits"]["deviceNodes"] == [
        {"path": "/dev/nvidia-caps-imex-channels/channel0", "type": "c", "major": 234, "minor": 0}
    ]
    assert host.checks == 1
    assert domains.labels == {}  # no IMEX DaemonSet to bring to this node
    assert node.prepared_claim_uids() == {ref.uid}

    assert asyncio.run(node.unprepare([ref])) == {ref.uid: None}
    assert SpecStore(tmp_path / "cdi", NAMES.driver).read(ref.uid) is None
    assert node.prepared_claim_uids() == set()


def test_a_channel_fails_with_the_hosts_reason_while_its_daemon_is_not_ready_and_leaves_nothing(
    tmp_path: Path,
) -> None:
    cd = domain()
    domains, claims, host = FakeDomains(cd), InMemoryClaims(), HostDaemon()
    node = host_managed_preparer(tmp_path, domains, claims, host)
    ref = channel_claim(claims, cd)
    host.reason = "host nvidia-imex daemon not ready: UNAVAILABLE"

    failed = asyncio.run(node.prepare([ref]))[ref.uid]
    assert isinstance(failed, ClaimError)
    assert failed.message == (
        "host nvidia-imex daemon readiness check failed on node tray-1: "
        "host nvidia-imex daemon not ready: UNAVAILABLE"
    )
    assert node.prepared_claim_uids() == set()  # the node's one channel is not held meanwhile
    assert SpecStore(tmp_path / "cdi", NAMES.driver).read(ref.uid) is None

    host.reason = None  # the service is back: the kubelet's retry gets the channel
    (prepared,) = asyncio.run(node.prepare([ref]))[ref.uid]  # type: ignore[misc]
    assert isinstance(prepared, PreparedDevice)


def test_a_daemon_claim_is_refused_in_the_host_managed_mode(tmp_path: Path) -> None:
    cd = domain()
    domains, claims = FakeDomains(cd), InMemoryClaims()
    node = host_managed_preparer(tmp_path, domains, claims, HostDaemon())
    ref = new_ref("daemon", "driver")
    config = opaque(daemon_config(NAMES, cd.metadata.uid), driver=NAMES.driver)
    claims.put(claim_json(ref, [result("daemon-0", "daemon", driver=NAMES.driver, pool=NODE)], [config]))

    refused = asyncio.run(node.prepare([ref]))[ref.uid]
    assert isinstance(refused, ClaimError)
    assert "daemon claims are not supported in the host-managed IMEX mode" in refused.message
    assert not (tmp_path / "compute-domains" / "domains").exists()


def test_a_channel_of_another_namespaces_domain_is_refused_before_the_host_is_asked(tmp_path: Path) -> None:
    cd = domain(namespace="team-a")
    domains, claims, host = FakeDomains(cd), InMemoryClaims(), HostDaemon()
    node = host_managed_preparer(tmp_path, domains, claims, host)
    ref = new_ref("channel", "team-b")
    config = opaque(
        {"apiVersion": NAMES.api_version, "kind": "ComputeDomainChannelConfig", "domainID": cd.metadata.uid},
        driver=NAMES.driver,
    )
    claims.put(claim_json(ref, [result("channel-0", "channel", driver=NAMES.driver, pool=NODE)], [config]))

    refused = asyncio.run(node.prepare([ref]))[ref.uid]
    assert isinstance(refused, ClaimError)
    assert "is in namespace team-b, but ComputeDomain team-a/cd is not" in refused.message
    assert host.checks == 0


# --- the host's daemon -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("returncode", "output", "reason"),
    [
        (0, "Connectivity Table Legend ...\nREADY\n", None),
        (0, "UNAVAILABLE\n", "host nvidia-imex daemon not ready: UNAVAILABLE"),
        (
            1,
            "Connection to /etc/nvidia-imex/imex_ctrl.sock failed\n",
            "error running nvidia-imex-ctl (socket '/s.sock'): exit status 1, output: "
            "Connection to /etc/nvidia-imex/imex_ctrl.sock failed",
        ),
    ],
)
def test_the_status_query_is_judged_as_nvidias_plugin_judges_it(
    returncode: int, output: str, reason: str | None
) -> None:
    assert judge(returncode, output, "/s.sock") == reason


def test_the_real_check_runs_the_hosts_tool_inside_the_driver_root(tmp_path: Path) -> None:
    check = NvidiaImexCtl(tmp_path, "/etc/nvidia-imex/imex_ctrl.sock")
    assert check.not_ready() == (
        f"{IMEX_CTL} not found under driver root {tmp_path} (is nvidia-imex installed on this node?)"
    )
    assert check.command("usr/bin/nvidia-imex-ctl") == [
        "chroot",
        str(tmp_path),
        "/usr/bin/nvidia-imex-ctl",
        "-q",
        "--u=/etc/nvidia-imex/imex_ctrl.sock",
    ]
    on_host = NvidiaImexCtl(Path("/"), "/run/imex.sock")
    assert on_host.command("opt/bin/nvidia-imex-ctl") == [
        "/opt/bin/nvidia-imex-ctl",
        "-q",
        "--u=/run/imex.sock",
    ]


BUSYBOX = shutil.which("busybox")


@pytest.mark.skipif(
    os.geteuid() != 0 or BUSYBOX is None, reason="chroot needs root; the fake tool needs a static busybox"
)
@pytest.mark.parametrize(
    ("answer", "status", "reason"),
    [
        ("READY", 0, None),
        ("UNAVAILABLE", 0, "host nvidia-imex daemon not ready: UNAVAILABLE --u=/run/imex.sock"),
        (
            "connect failed",
            3,
            "error running nvidia-imex-ctl (socket '/run/imex.sock'): exit status 3, output: "
            "connect failed --u=/run/imex.sock",
        ),
    ],
)
def test_the_real_check_asks_the_tool_in_the_driver_root_over_the_socket(
    tmp_path: Path, answer: str, status: int, reason: str | None
) -> None:
    # A driver root with a shell and an nvidia-imex-ctl that answers as told and echoes its socket flag.
    assert BUSYBOX is not None
    (tmp_path / "bin").mkdir()
    shutil.copy(BUSYBOX, tmp_path / "bin" / "sh")
    tool = tmp_path / "usr" / "bin" / IMEX_CTL
    tool.parent.mkdir(parents=True)
    tool.write_text(f'#!/bin/sh\necho "{answer} $2"\nexit {status}\n')
    tool.chmod(0o755)

    assert NvidiaImexCtl(tmp_path, "/run/imex.sock").not_ready() == reason


def test_a_simulated_nodes_host_daemon_is_ready_until_stopped(tmp_path: Path) -> None:
    backend = SimulatedBackend("gb200-tray", "tray-1", tmp_path)
    check = SimulatedHostImex(tmp_path / STATE_FILE_NAME)
    assert check.not_ready() is None  # a node's service runs from power-on

    backend.set_host_imex("stopped")  # what `dra-driver simulate host-imex --state stopped` does
    reason = check.not_ready()
    assert reason is not None
    assert "the host's nvidia-imex service is not running" in reason
    assert "`dra-driver simulate host-imex --state ready` starts it" in reason

    backend.set_host_imex("ready")
    assert check.not_ready() is None


def test_the_simulate_command_stops_and_starts_a_nodes_host_daemon(tmp_path: Path) -> None:
    check = SimulatedHostImex(tmp_path / STATE_FILE_NAME)
    common = ["--simulate", "gb200-tray", "--node-name", "tray-1", "--data-dir", str(tmp_path)]
    for state, ready in (("stopped", False), ("ready", True)):
        run = subprocess.run(
            [sys.executable, "-m", "dra_driver", "simulate", "host-imex", "--state", state, *common],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert run.returncode == 0, run.stderr
        assert (check.not_ready() is None) is ready


# --- the controller ----------------------------------------------------------------------------------

GROUP = "resource.nvidia.com"
CD = f"/apis/{GROUP}/v1beta1/namespaces/ns/computedomains/cd"
TEMPLATE = "/apis/resource.k8s.io/v1/namespaces/ns/resourceclaimtemplates/cd-channel"
UID = "0b9a8c1e-0000-4000-8000-000000000002"


class RecordingApi(FakeApi):
    """The in-memory API server, keeping every path the controller asked for."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[str] = []

    async def get(self, path: str) -> dict[str, Any] | None:
        self.asked.append(path)
        return await super().get(path)

    async def list(self, path: str, **query: str) -> dict[str, Any]:
        self.asked.append(path)
        return await super().list(path, **query)

    async def create(self, collection: str, body: dict[str, Any]) -> dict[str, Any]:
        self.asked.append(collection)
        return await super().create(collection, body)

    async def delete(self, path: str) -> None:
        self.asked.append(path)
        self.objects.pop(path, None)


def host_managed_controller(api: FakeApi) -> ComputeDomainController:
    made = ComputeDomainController(
        None,  # type: ignore[arg-type]
        gpu_driver="gpu.nvidia.com",
        namespace="driver",
        daemon_image="img",
        host_managed_imex=True,
    )
    made._kube = api  # type: ignore[assignment]
    return made


def settle(ctl: ComputeDomainController) -> None:
    async def run() -> None:
        for _ in range(10):
            if await ctl.reconcile("ns/cd") != 0.0:
                return

    asyncio.run(run())


def with_trays(api: FakeApi, *nodes: str) -> None:
    (content,) = compute_domain_slices(CLIQUE, daemon=False)
    for node in nodes:
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
        api.put(f"/api/v1/nodes/{node}", {"metadata": {"name": node}})


def test_the_controller_makes_the_channel_template_alone_and_reports_the_domain_ready() -> None:
    api = RecordingApi()
    with_trays(api, "a1", "a2")
    api.put(
        CD,
        {
            "apiVersion": f"{GROUP}/v1beta1",
            "kind": "ComputeDomain",
            "metadata": {"name": "cd", "namespace": "ns", "uid": UID, "generation": 1},
            "spec": {
                "numNodes": 2,
                "channel": {"resourceClaimTemplate": {"name": "cd-channel"}, "allocationMode": "All"},
            },
        },
    )
    settle(host_managed_controller(api))

    made = sorted(p for p in api.objects if "resourceclaimtemplates" in p or "daemonsets" in p)
    assert made == [TEMPLATE]  # no daemon template, no DaemonSet
    (config,) = api.objects[TEMPLATE]["spec"]["spec"]["devices"]["config"]
    assert config["opaque"]["parameters"]["allocationMode"] == "Single"  # NVIDIA's: channel 0 only
    status = api.objects[CD]["status"]
    (ready,) = status["conditions"]
    assert (status["status"], ready["status"], ready["reason"]) == ("Ready", "True", "HostManagedIMEX")
    assert f"placed on clique {CLIQUE}" in ready["message"]
    assert not [p for p in api.asked if "daemonsets" in p or "computedomaincliques" in p]

    # Deleted: the template goes and the finalizer with it; no DaemonSet or clique is asked about.
    before = copy.deepcopy(api.objects[CD])
    before["metadata"]["deletionTimestamp"] = "2026-12-01T00:00:00Z"
    api.put(CD, before)
    settle(host_managed_controller(api))
    assert TEMPLATE not in api.objects
    assert api.objects[CD]["metadata"]["finalizers"] == []
    assert not [p for p in api.asked if "daemonsets" in p or "computedomaincliques" in p]
