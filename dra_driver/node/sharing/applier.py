"""Applying a claim's sharing on the node, and undoing it: the side effects :mod:`.policy` plans.

The preparer calls, in order (see :mod:`dra_driver.node.preparer`):

1. :meth:`SharingApplier.record` before the claim's reservation: what each GPU has now (or had,
   before an earlier attempt or another claim changed it), into the record committed with
   PrepareStarted -- so a crash after a GPU was changed still knows what to put back;
2. :meth:`SharingApplier.apply` after the MIG devices exist: the compute mode and time slice of
   each GPU, then the MPS daemon (started and waited for), and the plan with the daemon's
   container edits for the CDI spec;
3. :meth:`SharingApplier.undo` when the prepare fails, and at unprepare: the daemon stops and each
   GPU gets its earlier settings back -- unless another prepared claim still uses that GPU's
   settings or that daemon (shares of one GPU), in which case the last one to leave restores.

Setting a GPU to what it has already is a no-op in both backends, so a repeated step is harmless.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable, Iterable

import structlog

from dra_driver.devices.backend import Backend, DeviceError
from dra_driver.devices.types import ComputeMode, ComputePolicy
from dra_driver.node.claims import ClaimRejected
from dra_driver.node.plan import ClaimPlan
from dra_driver.node.records import ClaimRecord, NodeState, SharingRecord, SharingState
from dra_driver.node.sharing.mps import (
    DEFAULT_READY_TIMEOUT_S,
    MpsDaemonError,
    MpsDaemons,
    container_env,
    container_mounts,
)
from dra_driver.node.sharing.policy import (
    SharingPlan,
    applied_policy,
    check_agrees,
    daemon_spec,
    gpu_records,
    held_by_others,
    mps_daemon_id,
    mps_spec,
    previous_policy,
    shared_daemon_id,
)
from dra_driver.resources.device_names import gpu_device_name

log = structlog.get_logger(__name__)


class SharingError(Exception):
    """Sharing could not be applied or undone; the message names the device and says why."""


class SharingApplier:
    """Applies sharing with ``backend`` (compute policy) and ``mps`` (daemons; None: MPS refused)."""

    def __init__(
        self, backend: Backend, mps: MpsDaemons | None, *, ready_timeout_s: float = DEFAULT_READY_TIMEOUT_S
    ) -> None:
        self._backend = backend
        self._mps = mps
        self._ready_timeout_s = ready_timeout_s
        # Held from the check against other claims until the reservation is committed, so that two
        # claims for one GPU cannot both pass the check.
        self.lock = asyncio.Lock()
        # Per daemon id, around starting and stopping it: the shares of one GPU use one daemon, and
        # two of them prepared at once must not both start it (nor one stop it while another starts).
        self._daemon_locks: dict[str, asyncio.Lock] = {}

    async def record(
        self,
        uid: str,
        plan: ClaimPlan,
        sharing: SharingPlan,
        existing: ClaimRecord | None,
        state: SharingState,
    ) -> SharingRecord | None:
        """The claim's sharing record; :class:`ClaimRejected` when it cannot be done. Changes nothing."""
        if not sharing.changes_anything:
            return None
        if sharing.mps_devices and self._mps is None:
            raise ClaimRejected(
                f"devices {', '.join(d.result.device for d in sharing.mps_devices)} ask for MPS, but this "
                "plugin runs no MPS control daemons (see docs/sharing.md); use TimeSlicing or Exclusive"
            )
        check_agrees(uid, sharing.gpus, state)
        earlier = {
            g.gpu_uuid: previous_policy(g)
            for g in (existing.sharing.gpus if existing and existing.sharing else ())
        }
        held = held_by_others(uid, state)
        previous: dict[str, ComputePolicy] = {}
        for change in sharing.gpus:
            if change.gpu_uuid in earlier:
                previous[change.gpu_uuid] = earlier[change.gpu_uuid]  # before our own earlier attempt
            elif change.gpu_uuid in held:
                previous[change.gpu_uuid] = previous_policy(held[change.gpu_uuid][1])
            else:
                now = await self._read(change.device, change.gpu_uuid)
                if now.compute_mode is ComputeMode.PROHIBITED:
                    raise ClaimRejected(
                        f"device {change.device}: its GPU is in compute mode Prohibited (an administrator "
                        "set `nvidia-smi -c PROHIBITED`): it runs no CUDA process, shared or not"
                    )
                previous[change.gpu_uuid] = now
        return SharingRecord(
            gpus=gpu_records(sharing.gpus, previous), mps_daemon=mps_daemon_id(plan, sharing)
        )

    async def apply(self, plan: ClaimPlan, sharing: SharingPlan, record: SharingRecord | None) -> ClaimPlan:
        """Set the GPUs, start the MPS daemon; the plan with the daemon's CDI edits."""
        if record is None:
            return plan
        for change in sharing.gpus:
            try:
                await asyncio.to_thread(self._backend.set_compute_policy, change.gpu_uuid, change.policy)
            except DeviceError as error:
                raise SharingError(
                    f"device {change.device}: cannot apply its sharing settings: {error}"
                ) from None
        if record.mps_daemon is None or self._mps is None:
            return plan
        spec = mps_spec(plan, sharing, record.mps_daemon)
        daemon = daemon_spec(spec, sharing)  # shares of a GPU: the GPU's daemon, without one share's limits
        try:
            async with self._daemon_lock(daemon.id):
                paths = await self._mps.start(daemon)
                await self._mps.wait_ready(daemon, self._ready_timeout_s)
        except MpsDaemonError as error:
            raise SharingError(f"{error}") from None
        log.info("mps_daemon_ready", daemon=spec.id, devices=spec.visible_devices)
        common = dataclasses.replace(
            plan.common,
            mounts=plan.common.mounts + container_mounts(paths),
            env=plan.common.env + container_env(spec),
        )
        return dataclasses.replace(plan, common=common)

    async def undo(self, uid: str, record: SharingRecord | None, state: SharingState) -> None:
        """Stop the daemon and restore the GPUs, except what other claims still use; raises SharingError."""
        if record is None:
            return
        shared = bool(state.daemons.get(record.mps_daemon or "", set()) - {uid})
        if record.mps_daemon and self._mps is not None and not shared:
            try:
                async with self._daemon_lock(record.mps_daemon):
                    await self._mps.stop(record.mps_daemon)
            except MpsDaemonError as error:
                raise SharingError(str(error)) from None
        held = held_by_others(uid, state)
        failures = []
        for gpu in record.gpus:
            if gpu.gpu_uuid in held:
                continue  # the last claim sharing the GPU restores it
            try:
                await asyncio.to_thread(self._backend.set_compute_policy, gpu.gpu_uuid, previous_policy(gpu))
            except DeviceError as error:
                failures.append(f"GPU {gpu.gpu_uuid}: {error}")
            else:
                if applied_policy(gpu) != previous_policy(gpu):
                    log.info("gpu_sharing_restored", gpu=gpu.gpu_uuid, **previous_policy(gpu).as_dict())
        if failures:
            raise SharingError(f"cannot restore the GPUs' settings: {'; '.join(failures)}")

    async def stop_leftover_daemons(self, fresh_state: Callable[[], Awaitable[NodeState]]) -> None:
        """Stop the daemons no claim records (a prepare that crashed before recording its daemon).

        A claim recovered from its CDI spec has no sharing record: daemons named after its uid stay.
        The records are read after the daemons are listed: a prepare records its daemon before it
        starts it, so a daemon that the other instance of a rolling update started meanwhile has
        its record by then.
        """
        if self._mps is None:
            return
        try:
            running = await self._mps.running()
        except Exception as error:  # the plugin still serves without this clean-up
            log.warning("mps_daemons_unlisted", error=str(error))
            return
        state = await fresh_state()
        recorded = set(state.sharing.daemons)
        recorded |= await self._shared_daemons_of_recovered(state.claims.values())
        for daemon in sorted(running - recorded):
            if any(daemon.startswith(f"{uid}-") for uid in state.claims):
                continue
            log.warning("stopping an MPS daemon no claim records", daemon=daemon)
            try:
                await self._mps.stop(daemon)
            except MpsDaemonError as error:
                log.error("mps_daemon_not_stopped", daemon=daemon, error=str(error))

    async def stop_daemons_of(self, uid: str, state: NodeState) -> None:
        """Stop the daemons of claim ``uid``, whose record of them was lost with the store.

        Those are the daemons named after the claim, and the shared daemon of each GPU it holds a
        share of, unless another claim of ``state`` may still be a client of that one.
        """
        if self._mps is None:
            return
        record = state.claims.get(uid)
        others = [r for u, r in state.claims.items() if u != uid]
        shared = await self._shared_daemons_of_recovered([record] if record else [])
        if shared:
            shared -= await self._shared_daemons_of_recovered(others)
            shared -= {daemon for daemon, uids in state.sharing.daemons.items() if uids - {uid}}
        try:
            for daemon in sorted(await self._mps.running()):
                if daemon.startswith(f"{uid}-") or daemon in shared:
                    await self._mps.stop(daemon)
        except MpsDaemonError as error:
            raise SharingError(str(error)) from None

    async def stop_shared_daemons_after(self, record: ClaimRecord, state: NodeState) -> None:
        """After the release of ``record``, a claim recovered from its CDI spec: stop the shared
        daemons of the GPUs it held shares of that no claim of ``state``, read after the release,
        still uses. The check before the release (:meth:`stop_daemons_of`) misses one case: two such
        claims of one pod unprepared together each see the other, and neither stops the daemon."""
        if self._mps is None:
            return
        shared = await self._shared_daemons_of_recovered([record])
        if not shared:
            return
        shared -= await self._shared_daemons_of_recovered(state.claims.values())
        shared -= {daemon for daemon, uids in state.sharing.daemons.items() if uids}
        try:
            for daemon in sorted(shared & await self._mps.running()):
                await self._mps.stop(daemon)
        except MpsDaemonError as error:
            raise SharingError(str(error)) from None

    async def _shared_daemons_of_recovered(self, records: Iterable[ClaimRecord]) -> set[str]:
        """The shared daemons of the GPUs that claims recovered from their CDI specs hold shares of.

        Such a claim's record lost what it knew of its daemon; a share of a GPU is a client of that
        GPU's shared daemon, so the daemon counts as used by it.
        """
        shares = {d.device for r in records if r.phase == "Recovered" for d in r.devices if d.share_id}
        if not shares:
            return set()
        inventory = await asyncio.to_thread(self._backend.inventory)
        return {shared_daemon_id(g.uuid) for g in inventory.gpus if gpu_device_name(g.minor) in shares}

    def _daemon_lock(self, daemon_id: str) -> asyncio.Lock:
        # Kept for the plugin's life: one per daemon id, and ids are per claim or per shared GPU.
        return self._daemon_locks.setdefault(daemon_id, asyncio.Lock())

    async def _read(self, device: str, gpu_uuid: str) -> ComputePolicy:
        try:
            return await asyncio.to_thread(self._backend.compute_policy, gpu_uuid)
        except DeviceError as error:
            raise SharingError(f"device {device}: cannot read its GPU's compute mode: {error}") from None
