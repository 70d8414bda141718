"""The node's state lost (a wiped data directory): what the CDI specs say is prepared stays exclusive.

The review's reproduction of issue 20: a workload holds gpu-2, a maintenance claim has admin access
to it, and the state directory is deleted. The new instance must answer the kubelet's repeated
prepare of the workload, and must not hand gpu-2 to a third claim once the maintenance claim is
gone: the workload's container still runs on it.
"""

from __future__ import annotations

import shutil

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
