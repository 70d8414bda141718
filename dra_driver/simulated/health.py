"""The simulated GPUs' faults: what ``dra-driver simulate xid|recover`` injected, as a health source.

The real node's source is NVML's event stream (:class:`dra_driver.devices.health.NvmlHealthSource`);
:func:`dra_driver.devices.backends.open_health_source` picks the one that goes with the backend.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Collection

import structlog

from dra_driver.devices.backend import DeviceError
from dra_driver.devices.faults import APPLICATION_XIDS, Fault, FaultKind, NodeFaults, carry_over
from dra_driver.devices.health import IgnoredXids
from dra_driver.simulated.gpus import SimulatedBackend

log = structlog.get_logger(__name__)


class SimulatedHealthSource:
    """The faults injected into the simulator (``dra-driver simulate xid|recover``), read every period.

    The state file is the simulated hardware, shared with the CLI in another process, so it
    is simply read again: a few kilobytes, parsed in well under a millisecond.
    """

    def __init__(
        self,
        backend: SimulatedBackend,
        *,
        ignored_xids: Collection[int] = APPLICATION_XIDS,
        poll_seconds: float = 0.5,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._backend = backend
        self._ignored = IgnoredXids(ignored_xids)
        self._poll_seconds = poll_seconds
        self._clock = clock

    async def watch(self) -> AsyncIterator[NodeFaults]:
        current: dict[str, tuple[Fault, ...]] | None = None
        while True:
            try:
                injected = await asyncio.to_thread(self._backend.faults)
            except DeviceError as error:
                log.warning("reading the simulated GPUs' faults failed; retrying", error=str(error))
            else:
                now = int(self._clock())
                observed = {
                    uuid: [
                        Fault(FaultKind.XID, since=now, xid=xid)
                        for xid in xids
                        if self._ignored.critical(uuid, xid)
                    ]
                    for uuid, xids in injected.items()
                }
                latest = carry_over(current or {}, observed)
                if latest != current:
                    current = latest
                    yield latest
            await asyncio.sleep(self._poll_seconds)
