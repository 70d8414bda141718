"""NodePreparer end to end on a simulated node: real CDI files, a real store, claims as JSON.

The API server is stood in for by :class:`InMemoryClaims` (the ResourceClaim JSON it
would return); everything below it is real.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import structlog

from dra_driver.cdi.spec import common_edits
from dra_driver.node.claim_fetcher import ClaimFetchError
from dra_driver.node.records import ClaimRecord, DeviceRecord
from dra_driver.node.store import Store
from dra_driver.node.types import ClaimError, ClaimRef, PreparedDevice

from .builders import DRIVER, NODE, Node, claim_json, gpu_config, new_ref, opaque, result, spec_devices

KIND = f"k8s.{DRIVER}/claim"


def devices_of(outcome: object) -> tuple[PreparedDevice, ...]:
    assert isinstance(outcome, tuple), outcome
    return outcome


def error_of(outcome: object) -> str:
    assert isinstance(outcome, ClaimError), outcome
    return outcome.message


def assert_nothing_left_for(node: Node, uid: str) -> None:
    assert not node.specs.path_for(uid).exists()
    if node.store_path.exists():
        assert uid not in node.on_disk().claims


async def test_prepare_writes_spec_and_record_and_answers_with_cdi_ids(node: Node) -> None:
    preparer = await node.started()
    ref = new_ref()
    node.allocate(ref, "gpu-0", "gpu-1", request="gpu/big")

    outcome = await preparer.prepare([ref])

    assert devices_of(outcome[ref.uid]) == (
        PreparedDevice(("gpu",), NODE, "gpu-0", (f"{KIND}={ref.uid}-gpu-0",)),
        PreparedDevice(("gpu",), NODE, "gpu-1", (f"{KIND}={ref.uid}-gpu-1",)),
    )
    assert spec_devices(node.specs.path_for(ref.uid)) == [f"{ref.uid}-gpu-0", f"{ref.uid}-gpu-1"]
    recorded = node.on_disk().claims[ref.uid]
    assert (recorded.namespace, recorded.name, recorded.phase) == (
        ref.namespace,
        ref.name,
        "PrepareCompleted",
    )
    assert [(d.request, d.device) for d in recorded.devices] == [("gpu/big", "gpu-0"), ("gpu/big", "gpu-1")]
    assert recorded.devices[0].config == {
        "apiVersion": gpu_config()["apiVersion"],
        "kind": "GpuConfig",
        "sharing": {"strategy": "Exclusive"},
    }
    assert node.observer.prepares == [True]
    assert preparer.prepared_claims == 1


async def test_repeated_prepare_is_answered_from_the_record_even_after_a_restart(node: Node) -> None:
    ref = new_ref()
    node.allocate(ref, "gpu-3", share_id="abc", consumed={"memory": "10Gi"})
    first = await (await node.started(consumable=True)).prepare([ref])
    gets = node.claims.gets

    again = await (await node.started(consumable=True)).prepare([ref])  # a new plugin process, same files

    assert again == first
    assert devices_of(again[ref.uid])[0].share_id == "abc"
    assert node.claims.gets == gets


async def test_repeated_prepare_restores_a_lost_spec(node: Node) -> None:
    preparer = await node.started()
    ref = new_ref()
    mps = gpu_config({"strategy": "MPS", "mps": {"defaultActiveThreadPercentage": 40}})
    node.allocate(ref, "gpu-1", configs=[opaque(mps)])
    first = await preparer.prepare([ref])
    node.specs.path_for(ref.uid).unlink()  # e.g. someone cleaned /var/run/cdi

    again = await preparer.prepare([ref])

    assert again == first
    spec = json.loads(node.specs.path_for(ref.uid).read_text())
    assert "DRA_GPU_MPS_ACTIVE_THREAD_PERCENTAGE_GPU_1=40" in spec["devices"][0]["containerEdits"]["env"]
    assert node.on_disk().claims[ref.uid].devices[0].config == mps


async def test_unprepare_removes_spec_and_record_and_tolerates_unknown_claims(node: Node) -> None:
    preparer = await node.started()
    ref, unknown = new_ref("c1"), new_ref("never")
    node.allocate(ref, "gpu-0")
    await preparer.prepare([ref])

    assert await preparer.unprepare([ref, unknown]) == {ref.uid: None, unknown.uid: None}
    assert await preparer.unprepare([ref]) == {ref.uid: None}

    assert_nothing_left_for(node, ref.uid)
    assert node.on_disk().claims == {}
    assert node.observer.unprepares == [True, True, True]


async def test_unprepared_device_can_be_prepared_for_another_claim(node: Node) -> None:
    preparer = await node.started()
    first, second = new_ref("first"), new_ref("second")
    node.allocate(first, "gpu-0")
    node.allocate(second, "gpu-0")
    await preparer.prepare([first])
    await preparer.unprepare([first])

    devices_of((await preparer.prepare([second]))[second.uid])


# --- bad input: a per-claim error, nothing written for that claim, the other claim unaffected -----------

BAD_INPUTS = [
    "claim not found",
    "not allocated",
    "uid mismatch",
    "another pool only",
    "another driver only",
    "unknown device",
    "invalid opaque config",
    "device of another claim",
]


def bad_claim(node: Node, case: str, ref: ClaimRef) -> str:
    """Set up ``ref`` as ``case``; returns what the error must say."""
    match case:
        case "claim not found":
            return f"claim {ref.namespace}/{ref.name} not found"
        case "not allocated":
            node.claims.put(claim_json(ref, results=None))
            return "is not allocated"
        case "uid mismatch":
            node.claims.put(claim_json(ref, [result("gpu-2")], uid="aaaaaaaa-0000-0000-0000-000000000000"))
            return f"deleted and re-created (replaced): expected uid {ref.uid}, found aaaaaaaa-0000"
        case "another pool only":
            node.allocate(ref, "gpu-2", pool="node-b")
            return "allocated to another node's pool or another driver only"
        case "another driver only":
            node.allocate(ref, "gpu-2", driver="gpu.nvidia.com")
            return "allocated to another node's pool or another driver only"
        case "unknown device":
            node.allocate(ref, "gpu-2", "gpu-42")
            return "device gpu-42 does not exist on this node"
        case "invalid opaque config":
            node.allocate(ref, "gpu-2", configs=[opaque(gpu_config({"strategy": "Sometimes"}))])
            return "config[0] (FromClaim, all requests): sharing.strategy: Input should be"
        case "device of another claim":
            node.allocate(ref, "gpu-2", "gpu-5")  # gpu-5 belongs to the good claim
            return "device gpu-5 is already prepared for claim default/good"
    raise AssertionError(case)


@pytest.mark.parametrize("case", BAD_INPUTS)
async def test_bad_claim_fails_alone_and_leaves_nothing(node: Node, case: str) -> None:
    preparer = await node.started()
    good = new_ref("good")
    node.allocate(good, "gpu-5")
    await preparer.prepare([good])  # the good claim holds gpu-5 before the bad one arrives
    bad = new_ref("bad")
    complaint = bad_claim(node, case, bad)
    other = new_ref("other")
    node.allocate(other, "gpu-4")

    outcomes = await preparer.prepare([bad, other])

    assert complaint in error_of(outcomes[bad.uid])
    devices_of(outcomes[other.uid])
    assert_nothing_left_for(node, bad.uid)
    assert set(node.on_disk().claims) == {good.uid, other.uid}
    assert False in node.observer.prepares


@pytest.mark.parametrize(
    ("ref", "complaint"),
    [
        (ClaimRef("", "c", "0d7f3c52-1b6e-4bb7-9a1e-0c6a3c1e5b11"), "invalid claim namespace ''"),
        (ClaimRef("Bad_NS", "c", "0d7f3c52-1b6e-4bb7-9a1e-0c6a3c1e5b11"), "invalid claim namespace"),
        (ClaimRef("default", "", "0d7f3c52-1b6e-4bb7-9a1e-0c6a3c1e5b11"), "invalid claim name ''"),
        (ClaimRef("default", "a/b", "0d7f3c52-1b6e-4bb7-9a1e-0c6a3c1e5b11"), "invalid claim name"),
        (ClaimRef("default", "c", ""), "invalid claim uid ''"),
        (ClaimRef("default", "c", "../../../etc/cdi/evil"), "invalid claim uid"),
        (ClaimRef("default", "c", "x/y"), "invalid claim uid"),
        (ClaimRef("default", "c", "nul\x00byte"), "invalid claim uid"),
    ],
)
async def test_malformed_identity_fails_before_any_io(node: Node, ref: ClaimRef, complaint: str) -> None:
    preparer = await node.started()
    other = new_ref("other")
    node.allocate(other, "gpu-0")
    files_before = set(node.root.rglob("*"))

    outcomes = await preparer.prepare([ref, other])
    unprepared = await preparer.unprepare([ref])

    assert complaint in error_of(outcomes[ref.uid])
    assert complaint in error_of(unprepared[ref.uid])
    devices_of(outcomes[other.uid])
    assert node.claims.gets == 1  # only the good claim was fetched
    new_files = set(node.root.rglob("*")) - files_before
    assert {p.name for p in new_files if p.is_file()} <= {node.specs.path_for(other.uid).name}


async def test_api_failure_is_a_per_claim_error(node: Node) -> None:
    class Unreachable:
        async def get(self, namespace: str, name: str) -> Mapping[str, Any] | None:
            raise ClaimFetchError("GET resource.k8s.io/v1 ResourceClaim default/c: connection refused")

    preparer = await node.started(Unreachable())
    ref = new_ref("c")

    outcome = await preparer.prepare([ref])

    assert "connection refused" in error_of(outcome[ref.uid])
    assert_nothing_left_for(node, ref.uid)


async def test_failed_spec_write_leaves_neither_spec_nor_record(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    preparer = await node.started()
    ref, other = new_ref("c"), new_ref("other")
    node.allocate(ref, "gpu-0")
    node.allocate(other, "gpu-1")
    real_write = preparer._specs._write_locked  # under write and write_held

    def failing_write(claim_uid: str, spec: Mapping[str, Any]) -> tuple[Path, int]:
        if claim_uid == ref.uid:
            raise OSError(5, "Input/output error")
        return real_write(claim_uid, spec)

    monkeypatch.setattr(preparer._specs, "_write_locked", failing_write)

    outcomes = await preparer.prepare([ref, other])

    assert "Input/output error" in error_of(outcomes[ref.uid])
    assert_nothing_left_for(node, ref.uid)
    devices_of(outcomes[other.uid])
    # gpu-0 is free again for a retry
    monkeypatch.undo()
    devices_of((await preparer.prepare([ref]))[ref.uid])


# --- exclusivity, admin access ------------------------------------------------------------------------


async def test_two_claims_racing_for_one_device_exactly_one_wins(node: Node) -> None:
    preparer = await node.started()
    refs = [new_ref(f"racer-{i}") for i in range(8)]
    for ref in refs:
        node.allocate(ref, "gpu-1")

    outcomes = await preparer.prepare(refs)

    winners = [uid for uid, outcome in outcomes.items() if isinstance(outcome, tuple)]
    assert len(winners) == 1
    assert set(node.on_disk().claims) == set(winners)
    for uid, outcome in outcomes.items():
        if uid not in winners:
            assert "device gpu-1 is already prepared for claim default/racer-" in error_of(outcome)
            assert_nothing_left_for(node, uid)


async def test_admin_access_shares_a_device_in_use(node: Node) -> None:
    preparer = await node.started()
    workload, monitor, late = new_ref("workload"), new_ref("monitor"), new_ref("late")
    node.allocate(monitor, "gpu-2", admin_access=True)
    node.allocate(workload, "gpu-2")
    node.allocate(late, "gpu-2")

    devices_of((await preparer.prepare([monitor]))[monitor.uid])
    devices_of((await preparer.prepare([workload]))[workload.uid])
    assert "already prepared for claim default/workload" in error_of(
        (await preparer.prepare([late]))[late.uid]
    )
    assert node.on_disk().claims[monitor.uid].devices[0].admin_access is True


# --- concurrency ----------------------------------------------------------------------------------------


async def test_200_concurrent_prepares_are_all_recorded(node: Node) -> None:
    preparer = await node.started(consumable=True)
    refs = [new_ref(f"c{i}") for i in range(200)]
    gpus = ["gpu-0", "gpu-1"] * 70 + ["gpu-2", "gpu-3"] * 30  # 1Gi shares: 70 of each H100, 30 of each A100
    for i, (ref, gpu) in enumerate(zip(refs, gpus, strict=True)):
        node.allocate(ref, gpu, share_id=f"share-{i}", consumed={"memory": "1Gi"})

    outcomes = await preparer.prepare(refs)

    assert all(isinstance(o, tuple) for o in outcomes.values())
    on_disk = node.on_disk()
    assert set(on_disk.claims) == {r.uid for r in refs}
    assert {r.phase for r in on_disk.claims.values()} == {"PrepareCompleted"}
    assert node.specs.claim_uids() == {r.uid for r in refs}
    assert node.observer.prepares == [True] * 200


async def test_kubelet_retry_during_a_prepare_waits_for_it(node: Node) -> None:
    gate = asyncio.Event()
    fetching = asyncio.Event()
    claims = node.claims

    class Slow:
        async def get(self, namespace: str, name: str) -> Mapping[str, Any] | None:
            fetching.set()
            await gate.wait()
            return await claims.get(namespace, name)

    preparer = await node.started(Slow())
    ref = new_ref()
    node.allocate(ref, "gpu-0")

    first = asyncio.create_task(preparer.prepare([ref]))
    await fetching.wait()
    first.cancel()  # the kubelet's 45 s timeout
    retry = asyncio.create_task(preparer.prepare([ref]))
    gate.set()

    outcome = await retry
    with pytest.raises(asyncio.CancelledError):
        await first
    assert devices_of(outcome[ref.uid])[0].device == "gpu-0"
    assert claims.gets == 1  # the retry was answered from the first attempt's record
    assert node.on_disk().claims[ref.uid].phase == "PrepareCompleted"


class GatedClaims:
    """The node's claims, each GET held until ``gate`` opens: a slow API server."""

    def __init__(self, node: Node) -> None:
        self._claims = node.claims
        self.gate = asyncio.Event()
        self.fetching = asyncio.Event()

    async def get(self, namespace: str, name: str) -> Mapping[str, Any] | None:
        self.fetching.set()
        await self.gate.wait()
        return await self._claims.get(namespace, name)


async def test_drain_waits_for_a_prepare_the_kubelet_gave_up_on(node: Node) -> None:
    claims = GatedClaims(node)
    preparer = await node.started(claims)
    ref = new_ref()
    node.allocate(ref, "gpu-0")
    rpc = asyncio.create_task(preparer.prepare([ref]))
    await claims.fetching.wait()
    rpc.cancel()  # the plugin's server stops, cancelling the RPC

    draining = asyncio.create_task(preparer.drain(grace=60))
    claims.gate.set()
    await draining

    with pytest.raises(asyncio.CancelledError):
        await rpc
    assert node.on_disk().claims[ref.uid].phase == "PrepareCompleted"
    assert spec_devices(node.specs.path_for(ref.uid)) == [f"{ref.uid}-gpu-0"]


async def test_drain_gives_up_after_the_timeout_and_names_what_still_runs(node: Node) -> None:
    claims = GatedClaims(node)
    preparer = await node.started(claims)
    ref = new_ref("stuck")
    node.allocate(ref, "gpu-0")
    rpc = asyncio.create_task(preparer.prepare([ref]))
    await claims.fetching.wait()

    with structlog.testing.capture_logs() as logs:
        await preparer.drain(grace=0.01)  # the GET never answers

    warnings = [entry for entry in logs if entry["log_level"] == "warning"]
    assert [entry["operations"] for entry in warnings] == [[f"prepare default/stuck ({ref.uid})"]]
    assert not rpc.done()
    claims.gate.set()  # let it finish, so that the test leaves nothing running
    assert devices_of((await rpc)[ref.uid])[0].device == "gpu-0"


async def test_drain_without_claim_operations_returns_at_once(node: Node) -> None:
    preparer = await node.started()
    ref = new_ref()
    node.allocate(ref, "gpu-0")
    await preparer.prepare([ref])

    with structlog.testing.capture_logs() as logs:
        await preparer.drain(grace=60)

    assert logs == []


async def test_two_plugin_instances_keep_each_others_claims(node: Node) -> None:
    old, new = await node.started(), await node.started()  # a rolling update
    a, b, c, clash = new_ref("a"), new_ref("b"), new_ref("c"), new_ref("clash")
    node.allocate(a, "gpu-0")
    node.allocate(b, "gpu-1")
    node.allocate(c, "gpu-2")
    node.allocate(clash, "gpu-0")

    devices_of((await old.prepare([a]))[a.uid])
    devices_of((await new.prepare([b]))[b.uid])
    devices_of((await old.prepare([c]))[c.uid])
    refused = await new.prepare([clash])

    assert set(node.on_disk().claims) == {a.uid, b.uid, c.uid}
    assert "device gpu-0 is already prepared for claim default/a" in error_of(refused[clash.uid])
    assert await new.unprepare([a]) == {a.uid: None}
    assert set(node.on_disk().claims) == {b.uid, c.uid}


async def test_an_instance_starting_during_a_prepare_leaves_that_prepare_alone(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A rolling update: the new instance repairs the store while the old one has written
    # a claim's spec and not yet its record. That spec is a live prepare's, not a crash's.
    old = await node.started()
    ref = new_ref("in-flight")
    node.allocate(ref, "gpu-2")
    new = node.preparer()
    real_commit = Store.commit

    def commit_after_the_other_instance_started(store: Store, mutation: Any) -> None:
        if store is old._state() and new._store is None:
            assert node.specs.path_for(ref.uid).exists()
            new._store = new._open()  # what the other process does meanwhile
        real_commit(store, mutation)

    monkeypatch.setattr(Store, "commit", commit_after_the_other_instance_started)
    with structlog.testing.capture_logs() as logs:
        outcome = await old.prepare([ref])
    assert new._store is not None

    assert devices_of(outcome[ref.uid])
    assert node.on_disk().claims[ref.uid].phase == "PrepareCompleted"
    assert spec_devices(node.specs.path_for(ref.uid)) == [f"{ref.uid}-gpu-2"]
    assert [e["event"] for e in logs if e.get("claim_uid") == ref.uid] == [
        "left the CDI spec of a live prepare to its plugin instance"
    ]
    assert await new.unprepare([ref]) == {ref.uid: None}
    assert_nothing_left_for(node, ref.uid)


async def test_a_claim_the_other_instance_prepared_since_we_started_is_answered_from_its_record(
    node: Node,
) -> None:
    # The old instance of a rolling update prepared the claim but stopped before it answered; the
    # kubelet asks the new instance, whose state predates that prepare.
    old, new = await node.started(), await node.started()
    ref = new_ref("answered-late")
    node.allocate(ref, "gpu-4")
    first = devices_of((await old.prepare([ref]))[ref.uid])
    spec = node.specs.path_for(ref.uid).read_text()

    again = devices_of((await new.prepare([ref]))[ref.uid])

    assert again == first
    assert node.on_disk().claims[ref.uid].attempt == old._state().claim(ref.uid).attempt  # type: ignore[union-attr]
    assert node.specs.path_for(ref.uid).read_text() == spec
    assert await new.unprepare([ref]) == {ref.uid: None}
    assert_nothing_left_for(node, ref.uid)


# --- restarts: leftovers, reboots, damaged stores ---------------------------------------------------------


def write_leftover(node: Node, ref: ClaimRef, device: str) -> None:
    """What a crash between writing the spec and recording PrepareCompleted leaves behind."""
    spec_path = node.specs.path_for(ref.uid)
    spec_path.parent.mkdir(parents=True, exist_ok=True)
    spec_path.write_text(json.dumps({"cdiVersion": "0.5.0", "kind": KIND, "devices": []}))
    record = ClaimRecord(
        namespace=ref.namespace,
        name=ref.name,
        phase="PrepareStarted",
        attempt="crashed",
        devices=(
            DeviceRecord(
                request="gpu", pool=NODE, device=device, cdi_device_ids=(f"{KIND}={ref.uid}-{device}",)
            ),
        ),
    )
    node.write_records({ref.uid: record})


async def test_leftover_of_a_crash_is_taken_over_by_the_next_prepare(node: Node) -> None:
    ref, other = new_ref("c"), new_ref("other")
    write_leftover(node, ref, "gpu-0")
    preparer = await node.started()
    node.allocate(ref, "gpu-0")
    node.allocate(other, "gpu-0")

    assert "already prepared for claim default/c" in error_of((await preparer.prepare([other]))[other.uid])
    outcome = await preparer.prepare([ref])

    assert devices_of(outcome[ref.uid])[0].cdi_device_ids == (f"{KIND}={ref.uid}-gpu-0",)
    assert node.on_disk().claims[ref.uid].phase == "PrepareCompleted"
    assert spec_devices(node.specs.path_for(ref.uid)) == [f"{ref.uid}-gpu-0"]


async def test_leftover_of_a_crash_is_cleaned_by_unprepare(node: Node) -> None:
    ref = new_ref("c")
    write_leftover(node, ref, "gpu-0")
    preparer = await node.started()

    assert await preparer.unprepare([ref]) == {ref.uid: None}

    assert_nothing_left_for(node, ref.uid)


async def test_reboot_clears_every_claim_and_spec(node: Node) -> None:
    ref = new_ref()
    node.allocate(ref, "gpu-0")
    await (await node.started()).prepare([ref])
    stray = node.specs.path_for("0d7f3c52-1b6e-4bb7-9a1e-0c6a3c1e5b11")
    stray.write_text(node.specs.path_for(ref.uid).read_text())

    node.reboot()
    preparer = await node.started()

    assert node.on_disk().claims == {}
    assert node.on_disk().boot_id == node.boot_id_path.read_text().strip()
    assert node.specs.claim_uids() == set()
    assert preparer.prepared_claims == 0
    devices_of((await preparer.prepare([ref]))[ref.uid])  # the kubelet prepares it again


async def test_reboot_removes_the_torn_specs_an_os_crash_leaves(node: Node) -> None:
    # Specs are not fsynced: after a power loss one may be empty or cut short. The reboot's
    # clean-up removes it like any other spec of the earlier boot, before anything is served.
    refs = [new_ref("empty"), new_ref("cut-short")]
    node.allocate(refs[0], "gpu-0")
    node.allocate(refs[1], "gpu-1")
    await (await node.started()).prepare(refs)
    whole = node.specs.path_for(refs[0].uid).read_text()
    node.specs.path_for(refs[0].uid).write_text("")
    node.specs.path_for(refs[1].uid).write_text(whole[: len(whole) // 2])

    node.reboot()
    preparer = await node.started()

    assert node.specs.claim_uids() == set()
    assert preparer.prepared_claims == 0
    assert all(devices_of(outcome) for outcome in (await preparer.prepare(refs)).values())


async def test_a_full_gpu_prepare_writes_the_store_once(node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    preparer = await node.started()
    appends: list[object] = []
    real_commit = Store.commit

    def counting_commit(store: Store, mutation: Any) -> None:
        appends.append(mutation)
        real_commit(store, mutation)

    monkeypatch.setattr(Store, "commit", counting_commit)
    ref = new_ref()
    node.allocate(ref, "gpu-3")

    devices_of((await preparer.prepare([ref]))[ref.uid])

    assert len(appends) == 1
    assert node.on_disk().claims[ref.uid].phase == "PrepareCompleted"


async def test_a_crash_between_the_spec_and_its_record_keeps_the_devices_reserved(node: Node) -> None:
    crashed, rival = new_ref("crashed"), new_ref("rival")
    node.allocate(crashed, "gpu-2")
    await (await node.started()).prepare([crashed])
    # What a crash right after the spec write leaves: the spec, and no record of it.
    node.drop_records(crashed.uid)

    preparer = await node.started()

    assert node.on_disk().claims[crashed.uid].phase == "Recovered"
    node.allocate(rival, "gpu-2")
    assert "device gpu-2 is already prepared" in error_of((await preparer.prepare([rival]))[rival.uid])
    devices_of((await preparer.prepare([crashed]))[crashed.uid])  # the kubelet's retry
    assert node.on_disk().claims[crashed.uid].phase == "PrepareCompleted"


@pytest.mark.parametrize("damage", ["zeros", "header", "deleted"])
async def test_damaged_store_is_rebuilt_from_the_cdi_specs(node: Node, damage: str) -> None:
    kept, other = new_ref("kept"), new_ref("other")
    node.allocate(kept, "gpu-0", "gpu-1")
    first = await node.started()
    await first.prepare([kept])
    first.close()  # the plugin stopped; its store's log is folded into the file
    path = node.store_path
    data = path.read_bytes()
    match damage:
        case "zeros":
            data = b"\x00" * len(data)
        case "header":
            data = b"\xff" * 100 + data[100:]
        case "deleted":
            data = b""
    for leftover in path.parent.glob(f"{path.name}*"):
        leftover.unlink()
    if data:
        path.write_bytes(data)

    preparer = await node.started()  # must not crash

    aside = list(path.parent.glob(f"{path.name}.corrupt-*"))
    assert [a.read_bytes() for a in aside if not a.name.endswith(("-wal", "-shm"))] == (
        [data] if data else []
    )
    recovered = node.on_disk().claims[kept.uid]
    assert recovered.phase == "Recovered"
    assert [d.device for d in recovered.devices] == ["gpu-0", "gpu-1"]
    # The recovered claim still holds its devices ...
    node.allocate(other, "gpu-1")
    complaint = error_of((await preparer.prepare([other]))[other.uid])
    assert f"device gpu-1 is already prepared for claim {kept.uid} (recovered from its CDI spec)" in complaint
    # ... its repeated prepare learns the rest again, and its unprepare releases them.
    again = devices_of((await preparer.prepare([kept]))[kept.uid])
    assert [d.device for d in again] == ["gpu-0", "gpu-1"]
    assert node.on_disk().claims[kept.uid].phase == "PrepareCompleted"
    assert await preparer.unprepare([kept]) == {kept.uid: None}
    devices_of((await preparer.prepare([other]))[other.uid])


@pytest.mark.parametrize(
    "content",
    [
        "{torn",
        "[1, 2]",
        json.dumps({"kind": KIND, "devices": 5}),
        json.dumps({"kind": KIND, "devices": [{"name": "someone-else-gpu-0"}, 7]}),
        json.dumps({"devices": [{"name": "0d7f3c52-1b6e-4bb7-9a1e-0c6a3c1e5b11-gpu-0"}]}),
    ],
)
async def test_unusable_spec_found_during_rebuild_is_removed(node: Node, content: str) -> None:
    uid = "0d7f3c52-1b6e-4bb7-9a1e-0c6a3c1e5b11"
    node.cdi_dir.mkdir(parents=True)
    node.specs.path_for(uid).write_text(content)
    node.store_path.parent.mkdir(parents=True)
    node.store_path.write_text("{torn")

    await node.started()

    assert node.on_disk().claims == {}
    assert node.specs.claim_uids() == set()


# --- logs -------------------------------------------------------------------------------------------------


async def test_every_prepare_log_line_names_the_claim(node: Node) -> None:
    capture = structlog.testing.LogCapture()
    saved = structlog.get_config()
    structlog.configure(processors=[structlog.contextvars.merge_contextvars, capture])
    try:
        preparer = await node.started()
        good, bad = new_ref("good"), new_ref("bad")
        node.allocate(good, "gpu-0")
        capture.entries.clear()

        await preparer.prepare([good, bad])
    finally:
        structlog.configure(**saved)

    by_claim = {ref.uid: [e for e in capture.entries if e.get("claim_uid") == ref.uid] for ref in (good, bad)}
    assert [e["event"] for e in by_claim[good.uid]] == ["claim prepared"]
    assert [e["event"] for e in by_claim[bad.uid]] == ["prepare failed"]
    assert all(e.get("claim_uid") for e in capture.entries)
    assert by_claim[bad.uid][0]["claim_namespace"] == "default"
    assert by_claim[bad.uid][0]["claim_name"] == "bad"


async def test_start_removes_temp_files_of_spec_writes_a_crash_interrupted(node: Node) -> None:
    """What a kill -9 between a spec's write and its rename leaves (found by e2e/reliability)."""
    prepared = new_ref("kept")
    node.allocate(prepared, "gpu-0")
    first = await node.started()
    devices_of((await first.prepare([prepared]))[prepared.uid])
    leftover = node.cdi_dir / f".{node.specs.path_for(new_ref().uid).stem}.x1y2z3.tmp"
    leftover.write_text('{"half": ')

    await node.started()

    assert not leftover.exists()
    assert node.spec_files() == {node.specs.path_for(prepared.uid).name}


async def test_a_control_node_that_appears_after_start_reaches_new_specs(node: Node) -> None:
    inventory = node.backend.inventory()
    uvm = next(n for n in inventory.control_nodes if n.path == "/dev/nvidia-uvm")
    # At start nvidia-uvm is not loaded yet (it loads lazily); the inventory sees it later.
    current = {
        "inventory": dataclasses.replace(
            inventory, control_nodes=tuple(n for n in inventory.control_nodes if n is not uvm)
        )
    }
    preparer = await node.started(
        inventory=lambda: current["inventory"],
        common_edits=common_edits(current["inventory"], None),
    )
    first, second = new_ref(), new_ref()
    node.allocate(first, "gpu-0")
    await preparer.prepare([first])
    current["inventory"] = inventory  # nvidia-uvm has loaded
    node.allocate(second, "gpu-1")
    await preparer.prepare([second])

    def control_paths(ref: ClaimRef) -> list[str]:
        spec = json.loads(node.specs.path_for(ref.uid).read_text())
        return [n["path"] for n in spec["containerEdits"]["deviceNodes"]]

    assert "/dev/nvidia-uvm" not in control_paths(first)
    assert "/dev/nvidia-uvm" in control_paths(second)


async def test_idle_is_heard_only_when_no_claim_operation_runs(node: Node) -> None:
    fast, slow = new_ref("fast"), new_ref("slow")
    node.allocate(fast, "gpu-0")
    node.allocate(slow, "gpu-1")
    release = asyncio.Event()

    class SlowFetcher:
        async def get(self, namespace: str, name: str) -> Mapping[str, Any] | None:
            if name == "slow":
                await release.wait()
            return await node.claims.get(namespace, name)

    seen: list[bool] = []
    preparer = await node.started(SlowFetcher(), on_idle=lambda: seen.append(preparer.busy))
    slow_pod = asyncio.create_task(preparer.prepare([slow]))
    await preparer.prepare([fast])
    assert seen == []  # the slow pod's claim still runs
    release.set()
    await slow_pod
    assert seen == [False]
    await preparer.unprepare([fast, slow])
    assert seen == [False, False]
