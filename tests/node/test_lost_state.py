"""The node's state lost (a wiped data directory): what the CDI specs say is prepared stays exclusive.

The review's reproduction of issue 20: a workload holds gpu-2, a maintenance claim has admin access
to it, and the state directory is deleted. The new instance must answer the kubelet's repeated
prepare of the workload, and must not hand gpu-2 to a third claim once the maintenance claim is
gone: the workload's container still runs on it.
"""

from __future__ import annotations

import os
import shutil

import structlog.testing

from dra_driver.node.types import ClaimError

from .builders import Node, new_ref


def wipe_state(node: Node) -> None:
    shutil.rmtree(node.state_dir)


async def test_a_lost_state_keeps_an_exclusive_gpu_from_a_second_tenant(node: Node) -> None:
    first = await node.started()
    work, admin, third = new_ref("work"), new_ref("admin"), new_ref("third")
    node.allocate(work, "gpu-2")
    node.allocate(admin, "gpu-2", admin_access=True)
    assert not any(isinstance(o, ClaimError) for o in (await first.prepare([work, admin])).values())

    wipe_state(node)
    second = await node.started()

    again = (await second.prepare([work]))[work.uid]
    assert not isinstance(again, ClaimError), again
    assert (await second.unprepare([admin]))[admin.uid] is None
    node.allocate(third, "gpu-2")
    refused = (await second.prepare([third]))[third.uid]
    assert isinstance(refused, ClaimError), "gpu-2 went to a second tenant"
    assert work.uid in refused.message or "work" in refused.message
    assert third.uid not in node.spec_files()


async def test_after_a_lost_state_the_workload_keeps_its_gpu_until_its_own_unprepare(node: Node) -> None:
    first = await node.started()
    work, admin, third = new_ref("work"), new_ref("admin"), new_ref("third")
    node.allocate(work, "gpu-2")
    node.allocate(admin, "gpu-2", admin_access=True)
    await first.prepare([work, admin])
    wipe_state(node)
    second = await node.started()

    assert (await second.unprepare([admin]))[admin.uid] is None
    node.allocate(third, "gpu-2")
    assert isinstance((await second.prepare([third]))[third.uid], ClaimError)
    assert (await second.unprepare([work]))[work.uid] is None
    outcome = (await second.prepare([third]))[third.uid]
    assert not isinstance(outcome, ClaimError), outcome


async def test_two_specs_that_hold_one_gpu_are_reported_by_both_names_and_neither_overwritten(
    node: Node,
) -> None:
    first = await node.started()
    work, rogue = new_ref("work"), new_ref("rogue")
    node.allocate(work, "gpu-2")
    await first.prepare([work])
    # A spec of another claim for the same GPU (a stale allocation's, from some earlier mistake).
    spec = node.specs.path_for(work.uid).read_text().replace(work.uid, rogue.uid)
    node.specs.path_for(rogue.uid).write_text(spec)
    an_hour_later = node.specs.path_for(work.uid).stat().st_mtime + 3600
    os.utime(node.specs.path_for(rogue.uid), (an_hour_later, an_hour_later))  # written after work's
    wipe_state(node)

    with structlog.testing.capture_logs() as logs:
        second = await node.started()

    (conflict,) = [
        e for e in logs if e["event"] == "two claims hold one device; the younger one is not recorded"
    ]
    assert (conflict["claim_uid"], conflict["held_by"]) == (rogue.uid, work.uid)  # work keeps gpu-2
    (reported,) = second.recovery_conflicts  # for the Event on the Node (e2e/test_driver_recovery.py)
    assert (reported.uid, reported.holder) == (rogue.uid, work.uid)
    assert set(node.on_disk().claims) == {work.uid}
    assert (await second.unprepare([rogue]))[rogue.uid] is None
    node.allocate(rogue, "gpu-2")
    assert isinstance((await second.prepare([rogue]))[rogue.uid], ClaimError)
    again = (await second.prepare([work]))[work.uid]
    assert not isinstance(again, ClaimError), again


async def test_an_admin_claim_rebuilt_from_its_spec_stays_prepared_when_its_gpu_went_into_mig_mode(
    node: Node,
) -> None:
    # Found by the state model: admin access holds nothing, so a MIG device of the same GPU was
    # prepared after it, switching the GPU into MIG mode. Rebuilt from its spec, the admin claim
    # was planned afresh at the kubelet's repeated prepare, where a full GPU in MIG mode is refused.
    first = await node.started()
    admin, mig = new_ref("admin"), new_ref("mig")
    node.allocate(admin, "gpu-0", admin_access=True)
    node.allocate(mig, "gpu-0-mig-1g10gb-19-0")
    prepared = await first.prepare([admin])
    assert not isinstance(prepared[admin.uid], ClaimError), prepared
    assert not isinstance((await first.prepare([mig]))[mig.uid], ClaimError)

    wipe_state(node)
    second = await node.started()

    again = (await second.prepare([admin]))[admin.uid]
    assert not isinstance(again, ClaimError), again
    assert again == prepared[admin.uid]  # the same devices and CDI ids, for the same requests
    assert (await second.unprepare([admin]))[admin.uid] is None
    assert (await second.unprepare([mig]))[mig.uid] is None
    assert not node.spec_files()
