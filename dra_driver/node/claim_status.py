"""``status.devices`` of the claims prepared on this node: which GPU each result is, and its health.

After a claim is prepared, every result of ours gets an entry in the claim's status::

    status:
      devices:
      - driver: gpu.dra-driver.dev
        pool: node-1
        device: gpu-3
        data: {uuid: GPU-...}                 # a MIG device: {uuid: MIG-..., parentUUID: GPU-...}
        conditions:
        - type: Healthy
          status: "True"                      # False: a fault on the GPU; Unknown: not monitored
          reason: NoFault                     # XidError, GpuLost, Unmonitored
          message: ...
          lastTransitionTime: ...

so that monitoring tools map a claim, and through it a pod, to the hardware (DCGM exporters
label their metrics with the GPU uuid). The entries are written again when the health of a
device changes, and when the plugin starts (for the claims its store holds).

Writing is best effort and never delays or fails a prepare: a background loop writes with
server-side apply (field manager = the driver name, so entries of other drivers and fields
of other writers are kept), coalesces repeated changes of one claim, and retries failures
with capped backoff.

The writes also give way to the kubelet's calls. A write is a PATCH that costs the node and
the API server more CPU than the prepare's own GET; started right after a prepare answers,
it ran beside the pod's next call (its unprepare, the next pod's prepare) and made that one
wait: on a 2-core node it doubled the p50 of an unprepare that followed a prepare. So a
write waits until no claim operation has run for :data:`SETTLE_S`, or until the oldest due
write has waited :data:`MAX_DELAY_S` (a node that is never quiet still gets its statuses).
A claim unprepared meanwhile is not written at all: its allocation goes with it.

What the API server demands (checked on Kubernetes 1.37): ``patch`` on
``resourceclaims/status``, and -- for any change of ``status.devices`` -- the verb
``associated-node:patch`` on the synthetic subresource ``resourceclaims/driver`` with
``resourceNames: [<driver>]``. "Associated node" means the plugin's token is bound to a pod
on the node the claim is allocated to: a plugin cannot write the status of another node's
claims, nor that of another driver's devices. A refusal of the latter comes back as 422.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

import structlog

from dra_driver.devices.faults import FaultKind, NodeFaults
from dra_driver.devices.types import Gpu, HealthState, Inventory, MigDevice
from dra_driver.node.types import ClaimRef, PreparedDevice
from dra_driver.resources.device_names import gpu_device_name, mig_device_name
from dra_driver.resources.taints import gpu_devices, gpu_health

log = structlog.get_logger(__name__)

CONDITION_TYPE = "Healthy"
_STATUS_OF = {HealthState.HEALTHY: "True", HealthState.UNHEALTHY: "False", HealthState.UNKNOWN: "Unknown"}
_REASON_OF = {FaultKind.GPU_LOST: "GpuLost", FaultKind.XID: "XidError", FaultKind.UNMONITORED: "Unmonitored"}
_MAX_ATTEMPTS = 8
_REQUEST_TIMEOUT_S = 30.0  # a hung request must not stall the writes of every other claim
# The claim is gone (404), or was replaced or the content is refused (422): retrying cannot help.
_NOT_RETRIED = {404, 409, 422}
SETTLE_S = 0.2  # quiet time after the last claim operation before a status is written
MAX_DELAY_S = 5.0  # the longest a due write waits for that quiet


class StatusWriteError(Exception):
    """The API server did not take the status; ``status`` is its HTTP status (0: no answer)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


ALLOCATION_BYTES_REASON = (
    "Kubernetes refuses every status write of this claim because its opaque config was created "
    "as JSON other than kubectl sends (compact, keys sorted), e.g. by a Python client's json.dumps; "
    "create the claim or its template with kubectl, Helm or server-side apply "
    "(docs/binding-conditions.md)"
)


def refusal_reason(error: StatusWriteError) -> str | None:
    """Why the API server will never take a status of this claim, when the refusal says so."""
    text = str(error)
    if (
        error.status == 422
        and "status.allocation" in text
        and ("cannot be modified once set" in text or "field is immutable" in text)
    ):
        return ALLOCATION_BYTES_REASON
    return None


class ClaimStatusApi(Protocol):
    async def apply_status(self, ref: ClaimRef, devices: list[dict[str, Any]], field_manager: str) -> None:
        """Server-side apply ``status.devices`` of the claim; raises :class:`StatusWriteError`."""
        ...


@dataclass(frozen=True)
class DeviceHardware:
    """What a published device name stands for on this node right now."""

    uuid: str
    parent_uuid: str | None = None  # a MIG device's GPU


def hardware_of(inventory: Inventory, device: str) -> DeviceHardware | None:
    """The GPU or the live MIG device behind ``device``; None when the node has no such hardware now."""
    for gpu in inventory.gpus:
        if device == gpu_device_name(gpu.minor):
            return DeviceHardware(gpu.uuid)
        if mig := _mig_named(gpu, device):
            return DeviceHardware(mig.uuid, parent_uuid=gpu.uuid)
    return None


def _mig_named(gpu: Gpu, device: str) -> MigDevice | None:
    return next(
        (
            mig
            for mig in gpu.mig_devices
            if device == mig_device_name(gpu.minor, mig.profile, mig.profile_id, mig.placement.start)
        ),
        None,
    )


@dataclass(frozen=True)
class DeviceCondition:
    status: str  # "True" | "False" | "Unknown"
    reason: str
    message: str


def device_condition(inventory: Inventory, faults: NodeFaults, device: str) -> DeviceCondition:
    """The ``Healthy`` condition of a published device, from the faults of its GPU."""
    gpu = next((gpu for gpu in inventory.gpus if device in gpu_devices(gpu)), None)
    if gpu is None:
        return DeviceCondition("Unknown", "NotFound", f"the node has no device {device} now")
    gpu_faults = faults.get(gpu.uuid, ())
    if not gpu_faults:
        return DeviceCondition("True", "NoFault", "no fault reported for the GPU")
    health = gpu_health(gpu_faults)
    kinds = {fault.kind for fault in gpu_faults}
    reason = next(reason for kind, reason in _REASON_OF.items() if kind in kinds)
    return DeviceCondition(_STATUS_OF[health.state], reason, health.message)


def status_entry(
    driver: str,
    device: PreparedDevice,
    hardware: DeviceHardware | None,
    condition: DeviceCondition,
    since: str,
) -> dict[str, Any]:
    """One ``status.devices`` entry; ``since`` is the condition's lastTransitionTime (RFC 3339)."""
    entry: dict[str, Any] = {"driver": driver, "pool": device.pool, "device": device.device}
    if device.share_id is not None:
        entry["shareID"] = device.share_id
    if hardware is not None:
        data = {"uuid": hardware.uuid}
        if hardware.parent_uuid is not None:
            data["parentUUID"] = hardware.parent_uuid
        entry["data"] = data
    entry["conditions"] = [
        {
            "type": CONDITION_TYPE,
            "status": condition.status,
            "reason": condition.reason,
            "message": condition.message,
            "lastTransitionTime": since,
        }
    ]
    return entry


@dataclass(frozen=True)
class ClaimDevice:
    """One row of the claim-to-hardware mapping (for the metric)."""

    claim: ClaimRef
    device: str
    uuid: str
    health: str  # "True" | "False" | "Unknown", as in the condition


@dataclass
class _Tracked:
    ref: ClaimRef
    devices: tuple[PreparedDevice, ...]
    written: list[dict[str, Any]] | None = None  # the entries last applied
    transitions: dict[str, tuple[str, str]] | None = None  # device -> (condition status, since)
    attempts: int = 0
    refused: bool = False  # the API server will never take a status of this claim (refusal_reason)


class ClaimStatusWriter:
    """Keeps ``status.devices`` of the claims prepared on this node current; see the module doc.

    ``inventory`` and ``faults`` are called on the event loop and must not block. ``busy`` says
    whether a claim operation is running (the preparer's); writes wait for ``settle`` seconds
    without one, at most ``max_delay`` seconds (see the module doc).
    """

    def __init__(
        self,
        api: ClaimStatusApi,
        *,
        driver_name: str,
        inventory: Callable[[], Inventory],
        faults: Callable[[], NodeFaults],
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        retry_initial: float = 0.5,
        retry_cap: float = 30.0,
        busy: Callable[[], bool] = lambda: False,
        settle: float = SETTLE_S,
        max_delay: float = MAX_DELAY_S,
    ) -> None:
        self._api = api
        self._driver = driver_name
        self._inventory = inventory
        self._faults = faults
        self._clock = clock
        self._retry_initial = retry_initial
        self._retry_cap = retry_cap
        self._claims: dict[str, _Tracked] = {}
        self._due: dict[str, float] = {}  # uid -> when its write became due, oldest first
        self._wakeup = asyncio.Event()
        self._busy = busy
        self._settle = settle
        self._max_delay = max_delay
        self._last_operation = -math.inf  # time.monotonic() of the last prepare or unprepare heard of

    def prepared(self, ref: ClaimRef, devices: Sequence[PreparedDevice]) -> None:
        """``ref`` is prepared with ``devices``: write its status (again, if it changed)."""
        self._last_operation = time.monotonic()
        ours = tuple(devices)
        tracked = self._claims.get(ref.uid)
        if tracked is None or tracked.devices != ours:
            self._claims[ref.uid] = _Tracked(ref, ours, transitions=tracked.transitions if tracked else None)
        self._schedule(ref.uid)

    def unprepared(self, ref: ClaimRef) -> None:
        """``ref`` is unprepared: nothing more to write for it (its allocation goes with it)."""
        self._last_operation = time.monotonic()
        self._claims.pop(ref.uid, None)
        self._due.pop(ref.uid, None)

    def health_changed(self) -> None:
        """Device health may have changed: rewrite the claims whose entries differ now."""
        for uid in self._claims:
            self._schedule(uid)

    def mapping(self) -> list[ClaimDevice]:
        """Every prepared device whose hardware is known, with the health last computed for it."""
        rows = []
        for tracked in self._claims.values():
            for entry in tracked.written or ():
                if "data" in entry:
                    health = entry["conditions"][0]["status"]
                    rows.append(ClaimDevice(tracked.ref, entry["device"], entry["data"]["uuid"], health))
        return rows

    async def run(self) -> None:
        """Write what is due until cancelled; one claim at a time, so a burst costs no more than needed."""
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while self._due:
                await self._until_quiet()
                if not self._due:  # all unprepared meanwhile
                    break
                uid = next(iter(self._due))
                del self._due[uid]
                tracked = self._claims.get(uid)
                if tracked is not None:
                    await self._write(tracked)

    def _schedule(self, uid: str) -> None:
        self._due.setdefault(uid, time.monotonic())  # one already due keeps its place
        self._wakeup.set()

    async def _until_quiet(self) -> None:
        """Return once no claim operation ran for ``settle`` s, or the oldest write waited ``max_delay`` s."""
        while self._due:
            now = time.monotonic()
            overdue_in = next(iter(self._due.values())) + self._max_delay - now
            if overdue_in <= 0:
                return
            if self._busy():
                wait = max(self._settle, 0.01)
            else:
                wait = self._last_operation + self._settle - now
                if wait <= 0:
                    return
            await asyncio.sleep(min(wait, overdue_in))

    def _entries(self, tracked: _Tracked) -> list[dict[str, Any]]:
        inventory, faults = self._inventory(), self._faults()
        now = self._clock().strftime("%Y-%m-%dT%H:%M:%SZ")
        transitions = dict(tracked.transitions or {})
        entries = []
        for device in tracked.devices:
            condition = device_condition(inventory, faults, device.device)
            previous = transitions.get(device.device)
            since = previous[1] if previous and previous[0] == condition.status else now
            transitions[device.device] = (condition.status, since)
            entries.append(
                status_entry(self._driver, device, hardware_of(inventory, device.device), condition, since)
            )
        tracked.transitions = transitions
        return entries

    async def _write(self, tracked: _Tracked) -> None:
        entries = self._entries(tracked)
        if entries == tracked.written or tracked.refused:
            return
        bound = log.bind(claim_namespace=tracked.ref.namespace, claim_name=tracked.ref.name)
        try:
            await self._api.apply_status(tracked.ref, entries, self._driver)
        except StatusWriteError as error:
            self._failed(tracked, error, bound)
            return
        tracked.written = entries
        tracked.attempts = 0
        bound.debug("claim status written", devices=[e["device"] for e in entries])

    def _failed(self, tracked: _Tracked, error: StatusWriteError, bound: Any) -> None:
        tracked.attempts += 1
        if (reason := refusal_reason(error)) is not None:
            tracked.refused = True  # not tried again, not even when the health changes: logged once
            bound.warning("claim status not written, and never will be", reason=reason, error=str(error))
            return
        hint = (
            "grant the plugin patch on resourceclaims/status and associated-node:patch on "
            f"resourceclaims/driver (resourceNames: [{self._driver}]), with a token bound to its pod"
            if error.status == 403 or "resourceclaims/driver" in str(error)
            else None
        )
        if error.status in _NOT_RETRIED or tracked.attempts >= _MAX_ATTEMPTS:
            bound.warning(
                "claim status not written; giving up", error=str(error), attempts=tracked.attempts, hint=hint
            )
            return
        delay = min(self._retry_cap, self._retry_initial * 2 ** (tracked.attempts - 1))
        delay = random.uniform(delay / 2, delay)
        bound.warning(
            "claim status not written; retrying", error=str(error), retry_in_s=round(delay, 2), hint=hint
        )
        asyncio.get_running_loop().call_later(delay, self._retry, tracked.ref.uid, tracked)

    def _retry(self, uid: str, tracked: _Tracked) -> None:
        if self._claims.get(uid) is tracked:  # not unprepared (or prepared anew) meanwhile
            self._schedule(uid)


class ApiServerClaimStatus:
    """:class:`ClaimStatusApi` on ``kubernetes.aio``: server-side apply on the ``status`` subresource.

    The claim's uid is part of the applied object, so the status of a claim that was deleted
    and re-created under the same name is never written (the server refuses a different uid).
    """

    def __init__(self, api_client: Any) -> None:
        self._api = api_client

    async def apply_status(self, ref: ClaimRef, devices: list[dict[str, Any]], field_manager: str) -> None:
        body = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": ref.name, "namespace": ref.namespace, "uid": ref.uid},
            "status": {"devices": devices},
        }
        what = f"apply status of ResourceClaim {ref.namespace}/{ref.name}"
        try:
            request = await self._api.param_serialize(
                method="PATCH",
                resource_path="/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims/{name}/status",
                path_params={"namespace": ref.namespace, "name": ref.name},
                query_params=[("fieldManager", field_manager), ("force", "true")],
                header_params={
                    "Content-Type": "application/apply-patch+yaml",
                    "Accept": "application/json",
                },
                body=body,
                auth_settings=["BearerToken"],
            )
            method, url, headers, serialized, _ = request
            response: Any = await self._api.call_api(
                method, url, header_params=headers, body=serialized, _request_timeout=_REQUEST_TIMEOUT_S
            )
            text: bytes = await response.read()
        except Exception as error:  # aiohttp and the client raise many types; all mean "no answer"
            raise StatusWriteError(0, f"{what}: {error or type(error).__name__}") from error
        if response.status >= 300:
            raise StatusWriteError(response.status, f"{what}: HTTP {response.status}: {_message(text)}")


def _message(body: bytes) -> str:
    try:
        status = json.loads(body)
    except ValueError:
        return body[:200].decode(errors="replace")
    if isinstance(status, Mapping) and isinstance(status.get("message"), str):
        return str(status["message"])
    return body[:200].decode(errors="replace")
