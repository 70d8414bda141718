"""Leader election on a ``coordination.k8s.io/v1`` Lease, with client-go's rules, on asyncio.

Several replicas of the compute-domain controller may run (a rolling update, or ``replicas > 1``
for a fast hand-over); only the one holding the Lease reconciles, so two never create, judge or
delete the same domain's objects at once. The rules are client-go's ``leaderelection`` package's,
the one NVIDIA's controller uses:

* a candidate takes the Lease when it does not exist, when it names no holder, or when its record
  has not changed for ``lease_duration`` -- measured on the candidate's own monotonic clock from the
  moment it *saw* the record change, so clock skew between machines does not matter;
* every write carries the ``resourceVersion`` read, so of two candidates racing for an expired
  Lease exactly one wins (the other gets 409 Conflict);
* the holder renews every ``retry_period``; failing to renew for ``renew_deadline`` it stops
  leading at once -- it can no longer be sure nobody else leads -- and the process exits so that
  it restarts with a clean slate, as NVIDIA's does;
* a holder that stops in an orderly way releases the Lease (holder cleared), so a standby takes
  over after one ``retry_period`` instead of a whole ``lease_duration``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import structlog

from dra_driver.apiserver.rest import ApiError, Json, JsonApi

log = structlog.get_logger(__name__)


class LostLease(RuntimeError):
    """The holder could not renew its Lease in time; someone else may lead now."""


def _micro_time() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass(frozen=True)
class LeaseConfig:
    namespace: str
    name: str
    identity: str
    lease_duration: float = 15.0
    renew_deadline: float = 10.0
    retry_period: float = 2.0

    def __post_init__(self) -> None:
        if not 0 < self.retry_period < self.renew_deadline < self.lease_duration:
            raise ValueError(
                "leader election needs 0 < retry period < renew deadline < lease duration, got "
                f"{self.retry_period}s, {self.renew_deadline}s, {self.lease_duration}s"
            )


class LeaderElector:
    def __init__(self, kube: JsonApi, config: LeaseConfig) -> None:
        self._kube = kube
        self._config = config
        self._collection = f"/apis/coordination.k8s.io/v1/namespaces/{config.namespace}/leases"
        self._path = f"{self._collection}/{config.name}"
        # What we last saw of the record, and when (our monotonic clock): the expiry is judged by it.
        self._observed: tuple[Any, ...] | None = None
        self._observed_at = 0.0
        self.leading = False

    async def run(self, lead: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Wait for the Lease, then run ``lead()`` while holding it.

        Returns when ``lead()`` returns; raises :class:`LostLease` (after cancelling ``lead()``) when
        the Lease could not be renewed in time. Cancelled, it releases the Lease it holds.
        """
        config = self._config
        log.info(
            "waiting for the leader lease", lease=f"{config.namespace}/{config.name}", id=config.identity
        )
        while True:
            try:
                if await self._try_acquire_or_renew():
                    break
            except (ApiError, OSError) as error:  # the API server away: try again
                log.warning("reading the leader lease failed", error=str(error) or type(error).__name__)
            await asyncio.sleep(config.retry_period)
        self.leading = True
        log.info("became the leader", lease=f"{config.namespace}/{config.name}", id=config.identity)
        work = asyncio.create_task(lead())
        renew = asyncio.create_task(self._renew())
        try:
            done, _ = await asyncio.wait({work, renew}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.leading = False
            for task in (work, renew):
                task.cancel()
            await asyncio.gather(work, renew, return_exceptions=True)
            with contextlib.suppress(Exception):
                await asyncio.shield(self._release())
        (done.pop() if work not in done else work).result()  # lead()'s error, or LostLease

    async def _renew(self) -> None:
        config = self._config
        while True:
            await asyncio.sleep(config.retry_period)
            deadline = time.monotonic() + config.renew_deadline
            while True:
                try:
                    async with asyncio.timeout(max(deadline - time.monotonic(), 0.01)):
                        if await self._try_acquire_or_renew():
                            break
                except (TimeoutError, ApiError, OSError) as error:
                    log.warning("renewing the leader lease failed", error=str(error) or type(error).__name__)
                if time.monotonic() >= deadline:
                    raise LostLease(
                        f"could not renew Lease {config.namespace}/{config.name} within "
                        f"{config.renew_deadline:g}s; stopping so that one controller leads at a time"
                    )
                await asyncio.sleep(min(config.retry_period, max(deadline - time.monotonic(), 0.0)))

    async def _try_acquire_or_renew(self) -> bool:
        config = self._config
        now = _micro_time()
        lease = await self._kube.get(self._path)
        if lease is None:
            body = {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {"name": config.name, "namespace": config.namespace},
                "spec": self._spec(now, now, transitions=0),
            }
            try:
                created = await self._kube.create(self._collection, body)
            except ApiError as error:
                if error.status == 409:  # another candidate created it first
                    return False
                raise
            self._observe(created)
            return True
        spec: Json = lease.get("spec") or {}
        holder = str(spec.get("holderIdentity") or "")
        self._observe(lease)
        duration = float(spec.get("leaseDurationSeconds") or config.lease_duration)
        if holder and holder != config.identity and time.monotonic() < self._observed_at + duration:
            return False  # someone else holds it and renewed it recently (by our clock)
        transitions = int(spec.get("leaseTransitions") or 0)
        acquired = spec.get("acquireTime") or now
        if holder != config.identity:
            transitions += 1
            acquired = now
        body = {**lease, "spec": self._spec(acquired, now, transitions)}
        try:
            updated = await self._kube.replace(self._path, body)
        except ApiError as error:
            if error.status == 409:  # it changed under us: another candidate won this round
                return False
            raise
        self._observe(updated)
        return True

    def _spec(self, acquired: str, renewed: str, transitions: int) -> Json:
        return {
            "holderIdentity": self._config.identity,
            "leaseDurationSeconds": max(int(self._config.lease_duration), 1),
            "acquireTime": acquired,
            "renewTime": renewed,
            "leaseTransitions": transitions,
        }

    def _observe(self, lease: Json) -> None:
        spec = lease.get("spec") or {}
        record = (spec.get("holderIdentity"), spec.get("renewTime"), spec.get("leaseTransitions"))
        if record != self._observed:
            self._observed = record
            self._observed_at = time.monotonic()

    async def _release(self) -> None:
        """Clear the holder if it is still us, so that a standby need not wait for the expiry."""
        lease = await self._kube.get(self._path)
        if lease is None or (lease.get("spec") or {}).get("holderIdentity") != self._config.identity:
            return
        spec = {
            **lease["spec"],
            "holderIdentity": None,
            "leaseDurationSeconds": 1,
            "renewTime": _micro_time(),
        }
        await self._kube.replace(self._path, {**lease, "spec": spec})
        log.info("released the leader lease", lease=f"{self._config.namespace}/{self._config.name}")
