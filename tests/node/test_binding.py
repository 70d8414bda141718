"""Binding conditions in the node layer: the watcher prepares a claim ahead of its pod's binding and
answers the scheduler, and undoes what it made when the pod does not come.

The node is the simulated one of the other node tests (real preparer, real store, simulated GPUs
that refuse what hardware refuses); the API server is a recorder of the status writes.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from dra_driver.gpu_plugin import state_command
from dra_driver.node.binding import (
    BindingWatcher,
    WaitingDevice,
    answered,
    condition_entries,
    waiting_devices,
)
from dra_driver.node.claim_status import StatusWriteError
from dra_driver.node.preparer import NodePreparer
from dra_driver.node.types import ClaimError, ClaimRef

from .builders import DRIVER, NODE, Node, claim_json, new_ref, result

PLACEMENT = "gpu-0-mig-1g10gb-19-0"
WAITING = {"bindingConditions": ["Ready"], "bindingFailureConditions": ["PrepareFailed"]}
NOW = datetime(2026, 12, 3, 12, 0, tzinfo=UTC)


class RecordedStatus:
    """The API server's side of the status writes: what was applied, by claim uid and field manager."""

    def __init__(self, fail_first: int = 0) -> None:
        self.applied: dict[str, list[dict[str, Any]]] = {}
        self.managers: set[str] = set()
        self._fail = fail_first

    async def apply_status(self, ref: ClaimRef, devices: list[dict[str, Any]], field_manager: str) -> None:
        if self._fail:
            self._fail -= 1
            raise StatusWriteError(0, "connection refused")
        self.applied[ref.uid] = devices
        self.managers.add(field_manager)

    def conditions(self, uid: str) -> dict[str, dict[str, Any]]:
        return {c["type"]: c for entry in self.applied.get(uid, []) for c in entry["conditions"]}


def waiting_claim(ref: ClaimRef, device: str = PLACEMENT) -> dict[str, Any]:
    """The claim as the scheduler leaves it while it waits: allocated, with the binding conditions."""
    return claim_json(ref, [result(device) | WAITING])


def watcher_of(preparer: NodePreparer, status: RecordedStatus) -> BindingWatcher:
    return BindingWatcher(
        preparer, status, driver_name=DRIVER, pool=NODE, clock=lambda: NOW, retry_initial=0.01
    )


def live_migs(node: Node, gpu: int = 0) -> list[str]:
    return [m.uuid for m in node.backend.inventory().gpus[gpu].mig_devices]


# --- what the claim says -------------------------------------------------------------------------------


def test_only_our_pools_devices_with_binding_conditions_are_waited_on() -> None:
    claim = claim_json(
        new_ref(),
        [
            result(PLACEMENT) | WAITING,
            result("gpu-1"),  # a full GPU: nothing to wait for
            result("gpu-0-mig-1g10gb-19-1", pool="other-node") | WAITING,
            result("nic-0", driver="nic.example.com") | WAITING,
        ],
    )
    assert waiting_devices(claim, DRIVER, NODE) == (
        WaitingDevice(NODE, PLACEMENT, None, ("Ready",), ("PrepareFailed",)),
    )
    assert waiting_devices(claim_json(new_ref()), DRIVER, NODE) == ()  # not allocated


def test_a_device_is_answered_by_all_its_conditions_or_by_one_failure() -> None:
    claim = waiting_claim(new_ref())
    devices = waiting_devices(claim, DRIVER, NODE)
    assert not answered(claim, DRIVER, devices)
    for conditions, done in (
        ([{"type": "Ready", "status": "True"}], True),
        ([{"type": "Ready", "status": "False"}], False),
        ([{"type": "PrepareFailed", "status": "True"}], True),
        ([{"type": "Healthy", "status": "True"}], False),  # the health writer's condition answers nothing
    ):
        entry = {"driver": DRIVER, "pool": NODE, "device": PLACEMENT, "conditions": conditions}
        claim["status"]["devices"] = [entry]
        assert answered(claim, DRIVER, devices) is done, conditions


def test_a_failure_is_reported_with_the_error_as_its_message() -> None:
    device = WaitingDevice(NODE, PLACEMENT, None, ("Ready",), ("PrepareFailed",))
    (entry,) = condition_entries(DRIVER, [device], ClaimError("GPU on fire"), NOW)
    assert entry["conditions"] == [
        {
            "type": "PrepareFailed",
            "status": "True",
            "reason": "PrepareFailed",
            "message": "GPU on fire",
            "lastTransitionTime": "2026-12-03T12:00:00Z",
        }
    ]
    (ready,) = condition_entries(DRIVER, [device], (), NOW)
    assert [(c["type"], c["status"]) for c in ready["conditions"]] == [("Ready", "True")]
    assert (ready["driver"], ready["pool"], ready["device"]) == (DRIVER, NODE, PLACEMENT)


# --- the watcher on a node ------------------------------------------------------------------------------


async def test_the_mig_device_is_made_before_binding_and_the_kubelets_prepare_finds_it_done(
    node: Node,
) -> None:
    preparer = await node.started()
    status = RecordedStatus()
    watcher = watcher_of(preparer, status)
    ref = new_ref()
    claim = waiting_claim(ref)
    node.claims.put(claim)

    await watcher.on_event("ADDED", claim)
    await watcher.idle()

    (made,) = live_migs(node)
    assert status.conditions(ref.uid)["Ready"]["status"] == "True"
    assert status.managers == {
        f"{DRIVER}/binding"
    }  # not the health writer's manager: neither undoes the other
    assert node.on_disk().claims[ref.uid].ahead_of_binding
    shown = state_command.render(state_command.read(node.state_dir), "table")
    assert "PrepareCompleted (ahead of binding)" in shown  # what `dra-driver state` tells an operator

    outcome = await preparer.prepare([ref])  # the pod is bound: the kubelet asks

    assert not isinstance(outcome[ref.uid], ClaimError)
    assert live_migs(node) == [made]  # the same device, not a second one
    assert not node.on_disk().claims[ref.uid].ahead_of_binding  # the kubelet's now
    assert "ahead of binding" not in state_command.render(state_command.read(node.state_dir), "table")
    assert node.observer.prepares == [True, True]


async def test_a_failed_creation_is_reported_and_leaves_nothing(node: Node) -> None:
    preparer = await node.started()
    status = RecordedStatus()
    watcher = watcher_of(preparer, status)
    node.backend.set_mig_creation(0, "failing")
    ref = new_ref()
    claim = waiting_claim(ref)
    node.claims.put(claim)

    await watcher.on_event("ADDED", claim)
    await watcher.idle()

    failed = status.conditions(ref.uid)["PrepareFailed"]
    assert failed["status"] == "True"
    assert "simulated fault" in failed["message"]
    assert "Ready" not in status.conditions(ref.uid)
    assert live_migs(node) == []
    assert ref.uid not in node.on_disk().claims


async def test_a_claim_already_answered_is_not_prepared_again(node: Node) -> None:
    preparer = await node.started()
    watcher = watcher_of(preparer, RecordedStatus())
    claim = waiting_claim(new_ref())
    claim["status"]["devices"] = [
        {
            "driver": DRIVER,
            "pool": NODE,
            "device": PLACEMENT,
            "conditions": [{"type": "Ready", "status": "True"}],
        }
    ]
    await watcher.on_event("SYNC", claim)
    await watcher.idle()
    assert node.observer.prepares == []


async def test_a_write_that_fails_is_retried(node: Node) -> None:
    preparer = await node.started()
    status = RecordedStatus(fail_first=2)
    watcher = watcher_of(preparer, status)
    ref = new_ref()
    node.claims.put(waiting_claim(ref))
    await watcher.on_event("ADDED", waiting_claim(ref))
    await watcher.idle()
    assert status.conditions(ref.uid)["Ready"]["status"] == "True"


async def test_what_was_made_for_a_pod_that_never_came_is_undone(node: Node) -> None:
    """The binding failed or timed out after the device was made: the scheduler takes the allocation
    back (or the claim goes with its pod), and the MIG device must not stay behind."""
    preparer = await node.started()
    watcher = watcher_of(preparer, RecordedStatus())
    taken_back, deleted = new_ref("taken-back"), new_ref("deleted")
    for ref, device in ((taken_back, PLACEMENT), (deleted, "gpu-0-mig-1g10gb-19-1")):
        node.claims.put(waiting_claim(ref, device))
        await watcher.on_event("ADDED", waiting_claim(ref, device))
    await watcher.idle()
    assert len(live_migs(node)) == 2

    await watcher.on_event("MODIFIED", claim_json(taken_back))  # deallocated
    await watcher.on_event("DELETED", waiting_claim(deleted, "gpu-0-mig-1g10gb-19-1"))
    await watcher.idle()

    assert live_migs(node) == []
    assert node.on_disk().claims == {}
    assert node.spec_files() == set()


async def test_a_claim_the_kubelet_took_over_is_left_to_the_kubelets_unprepare(node: Node) -> None:
    preparer = await node.started()
    watcher = watcher_of(preparer, RecordedStatus())
    ref = new_ref()
    node.claims.put(waiting_claim(ref))
    await watcher.on_event("ADDED", waiting_claim(ref))
    await watcher.idle()
    await preparer.prepare([ref])

    # The pod ended and the claim was deallocated before the kubelet unprepared: the device may
    # still be in use by containers being stopped; the kubelet's unprepare is the one to undo it.
    await watcher.on_event("MODIFIED", claim_json(ref))
    await watcher.idle()

    assert len(live_migs(node)) == 1
    assert ref.uid in node.on_disk().claims


async def test_after_a_restart_the_listing_undoes_what_was_made_for_a_claim_gone_meanwhile(
    node: Node,
) -> None:
    first = await node.started()
    watcher = watcher_of(first, RecordedStatus())
    gone, waiting = new_ref("gone"), new_ref("waiting")
    for ref, device in ((gone, PLACEMENT), (waiting, "gpu-0-mig-1g10gb-19-1")):
        node.claims.put(waiting_claim(ref, device))
        await watcher.on_event("ADDED", waiting_claim(ref, device))
    await watcher.idle()
    first.close()  # the plugin stops; meanwhile the claim "gone" is deleted

    second = await node.started()
    restarted = watcher_of(second, RecordedStatus())
    restarted.on_listed([waiting_claim(waiting, "gpu-0-mig-1g10gb-19-1")])
    await restarted.idle()

    assert set(node.on_disk().claims) == {waiting.uid}
    assert len(live_migs(node)) == 1


async def test_claims_without_binding_conditions_are_the_kubelets_alone(node: Node) -> None:
    preparer = await node.started()
    watcher = watcher_of(preparer, RecordedStatus())
    claim = claim_json(new_ref(), [result(PLACEMENT)])  # binding conditions off: published without them
    await watcher.on_event("ADDED", claim)
    await watcher.idle()
    assert node.observer.prepares == []
    assert live_migs(node) == []


async def test_a_claim_with_a_full_gpu_beside_its_mig_device_is_kept_while_it_waits(node: Node) -> None:
    preparer = await node.started()
    watcher = watcher_of(preparer, RecordedStatus())
    ref = new_ref()
    claim = claim_json(ref, [result("gpu-1"), result(PLACEMENT) | WAITING])  # only the placement waits
    node.claims.put(claim)
    await watcher.on_event("ADDED", claim)
    await watcher.idle()
    made = live_migs(node)

    await watcher.on_event("SYNC", claim)  # the next listing, before the pod is bound
    await watcher.idle()

    assert live_migs(node) == made  # neither destroyed nor made again
    assert node.observer.unprepares == []
    assert node.on_disk().claims[ref.uid].ahead_of_binding
