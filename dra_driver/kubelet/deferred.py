"""The claim preparer the kubelet reaches while the daemon is still starting.

The daemon opens its kubelet sockets as soon as its settings are checked, so the kubelet
registers it a fraction of a second after start, and builds the real preparer behind them:
the API client, the GPUs, the node's store repaired after a crash. A ``NodePrepareResources``
or ``NodeUnprepareResources`` that arrives in between waits here until that preparer is
ready, and is then served by it like any other call.

What the kubelet does with a plugin that registers and then holds a call, from its source
(``pkg/kubelet/cm/dra/plugin``, 1.34 to 1.37):

* registration is GetInfo (1 s timeout) and NotifyRegistrationStatus (5 s), both answered
  at once by the registration servicer; nothing else is asked of a plugin to register it;
* every prepare or unprepare call carries a deadline of 45 s (``defaultClientCallTimeout``).
  grpc.aio cancels the handler when the server sees the deadline pass (a moment after the
  kubelet gives up), and with it the wait here, so a held call is not served once it expired.
  A call that times out fails the pod's prepare (event ``FailedPrepareDynamicResources``) and
  the pod worker retries it,
  exactly as for a slow API server; the unprepare reconcile loop retries every 60 s;
* the kubelet's health stream (1.36+) is served from the start: the device health board
  exists before the sockets do and sends what it knows.

The upstream Go helper (``k8s.io/dynamic-resource-allocation/kubeletplugin``) serves the
DRA socket and then registers, like this daemon; drivers built on it build their state
before calling its ``Start``, so they register later instead of holding calls.

If the start fails after the sockets opened, every held call gets the start's error for
each of its claims before the sockets are removed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from dra_driver.node.types import ClaimError, ClaimPreparer, ClaimRef, PrepareOutcome


class DeferredPreparer:
    """A :class:`ClaimPreparer` that holds calls until :meth:`ready` hands it the real one.

    After :meth:`failed`, every call answers that error for each claim instead.
    """

    def __init__(self) -> None:
        self._preparer: ClaimPreparer | None = None
        self._failure: ClaimError | None = None
        self._settled = asyncio.Event()
        self._held = 0

    @property
    def held(self) -> int:
        """How many calls are waiting for the daemon to be ready."""
        return self._held

    def ready(self, preparer: ClaimPreparer) -> None:
        """Serve every held and later call with ``preparer``."""
        self._preparer = preparer
        self._settled.set()

    def failed(self, reason: str) -> None:
        """The daemon did not start: answer every held and later call with ``reason``."""
        if self._preparer is None:
            self._failure = ClaimError(f"the DRA driver failed to start: {reason}")
            self._settled.set()

    async def prepare(self, claims: Sequence[ClaimRef]) -> dict[str, PrepareOutcome]:
        preparer = self._preparer or await self._settle()
        if isinstance(preparer, ClaimError):
            return {claim.uid: preparer for claim in claims}
        return await preparer.prepare(claims)

    async def unprepare(self, claims: Sequence[ClaimRef]) -> dict[str, ClaimError | None]:
        preparer = self._preparer or await self._settle()
        if isinstance(preparer, ClaimError):
            return {claim.uid: preparer for claim in claims}
        return await preparer.unprepare(claims)

    async def _settle(self) -> ClaimPreparer | ClaimError:
        self._held += 1
        try:
            await self._settled.wait()  # cancelled with the call when the kubelet's deadline passes
        finally:
            self._held -= 1
        result = self._preparer or self._failure
        assert result is not None
        return result
