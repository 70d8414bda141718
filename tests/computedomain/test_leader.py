"""Leader election on a Lease: one leader among candidates, hand-over on expiry and on release.

The API server is an in-memory store with its optimistic concurrency (resourceVersion, 409 on a
stale write, 409 on creating what exists); the end-to-end test runs the same against the real one.
"""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import pytest

from dra_driver.apiserver.rest import ApiError
from dra_driver.computedomain.controller.leader import LeaderElector, LeaseConfig, LostLease

PATH = "/apis/coordination.k8s.io/v1/namespaces/ns/leases/cd"


class FakeLeases:
    def __init__(self) -> None:
        self.lease: dict[str, Any] | None = None
        self.version = 0
        self.down = False  # the API server unreachable

    def _check(self) -> None:
        if self.down:
            raise OSError("connection refused")

    async def get(self, path: str) -> dict[str, Any] | None:
        self._check()
        await asyncio.sleep(0)
        return copy.deepcopy(self.lease)

    async def create(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        self._check()
        await asyncio.sleep(0)
        if self.lease is not None:
            raise ApiError(409, "AlreadyExists", "exists")
        return self._store(body)

    async def replace(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        self._check()
        await asyncio.sleep(0)
        assert self.lease is not None
        if body["metadata"].get("resourceVersion") != self.lease["metadata"]["resourceVersion"]:
            raise ApiError(409, "Conflict", "the object has been modified")
        return self._store(body)

    def _store(self, body: dict[str, Any]) -> dict[str, Any]:
        self.version += 1
        self.lease = copy.deepcopy(
            {**body, "metadata": {**body["metadata"], "resourceVersion": str(self.version)}}
        )
        return copy.deepcopy(self.lease)

    @property
    def holder(self) -> str | None:
        return None if self.lease is None else self.lease["spec"].get("holderIdentity")


def config(identity: str) -> LeaseConfig:
    return LeaseConfig("ns", "cd", identity, lease_duration=0.6, renew_deadline=0.4, retry_period=0.05)


def elector(api: FakeLeases, identity: str) -> LeaderElector:
    return LeaderElector(api, config(identity))  # type: ignore[arg-type]


async def _lead_forever(active: list[str], me: str, became: asyncio.Event | None = None) -> None:
    active.append(me)
    if became is not None:
        became.set()
    try:
        await asyncio.Event().wait()
    finally:
        active.remove(me)


def test_of_racing_candidates_exactly_one_leads_and_a_cancelled_leader_hands_over() -> None:
    async def scenario() -> None:
        api = FakeLeases()
        active: list[str] = []
        tasks = {
            name: asyncio.create_task(elector(api, name).run(lambda n=name: _lead_forever(active, n)))
            for name in ("a", "b", "c")
        }
        for _ in range(20):  # many renew rounds: never two leaders
            await asyncio.sleep(0.05)
            assert len(active) == 1
            assert api.holder == active[0]
        first = active[0]
        stopped = tasks.pop(first)
        stopped.cancel()  # an orderly stop releases the Lease ...
        with pytest.raises(asyncio.CancelledError):
            await stopped
        await asyncio.sleep(0.3)  # ... so another takes over well before the 0.6 s expiry
        assert len(active) == 1
        assert active[0] != first
        assert api.lease is not None
        assert api.lease["spec"]["leaseTransitions"] == 1
        for task in tasks.values():
            task.cancel()
        await asyncio.gather(*tasks.values(), return_exceptions=True)
        assert active == []
        assert api.holder is None

    asyncio.run(scenario())


def test_a_holder_that_vanished_is_replaced_only_after_the_lease_duration() -> None:
    async def scenario() -> None:
        api = FakeLeases()
        ghost = {
            "metadata": {"name": "cd", "namespace": "ns"},
            "spec": {"holderIdentity": "ghost", "leaseDurationSeconds": 1, "leaseTransitions": 4},
        }
        await api.create(PATH, ghost)  # a leader killed with SIGKILL: the record stays, unrenewed
        active: list[str] = []
        loop = asyncio.get_running_loop()
        started = loop.time()
        became = asyncio.Event()
        task = asyncio.create_task(elector(api, "b").run(lambda: _lead_forever(active, "b", became)))
        await became.wait()
        assert loop.time() - started >= 1.0  # the Lease's own duration (1 s), not ours (0.6 s)
        assert api.lease is not None
        assert (api.holder, api.lease["spec"]["leaseTransitions"]) == ("b", 5)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(scenario())


def test_a_leader_that_cannot_renew_stops_leading_and_says_why() -> None:
    async def scenario() -> None:
        api = FakeLeases()
        active: list[str] = []
        became = asyncio.Event()
        task = asyncio.create_task(elector(api, "a").run(lambda: _lead_forever(active, "a", became)))
        await became.wait()
        api.down = True  # cut off from the API server: it cannot know whether another leads
        with pytest.raises(LostLease, match=r"could not renew Lease ns/cd within 0\.4s"):
            await asyncio.wait_for(task, timeout=5)
        assert active == []  # its work was stopped before it gave up

    asyncio.run(scenario())


def test_timings_that_cannot_work_are_refused() -> None:
    with pytest.raises(ValueError, match="retry period < renew deadline < lease duration"):
        LeaseConfig("ns", "cd", "a", lease_duration=5, renew_deadline=10, retry_period=2)
