"""The contract between the kubelet adapters and the prepare logic.

The kubelet layer translates protocol messages into these objects and back; all the
rules live behind :class:`ClaimPreparer`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class ClaimRef:
    """What the kubelet tells us about a claim: only its identity."""

    namespace: str
    name: str
    uid: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name} ({self.uid})"


@dataclass(frozen=True)
class PreparedDevice:
    """One allocated device, ready for the container runtime."""

    requests: tuple[str, ...]  # request names ("req", never "req/sub"); empty = all requests
    pool: str
    device: str
    cdi_device_ids: tuple[str, ...]
    share_id: str | None = None


@dataclass(frozen=True)
class ClaimError:
    """Why one claim could not be prepared or unprepared; goes to the kubelet verbatim."""

    message: str


PrepareOutcome = tuple[PreparedDevice, ...] | ClaimError


class ClaimPreparer(Protocol):
    """Prepares and unprepares claims. Claims in one call are independent of each other."""

    async def prepare(self, claims: Sequence[ClaimRef]) -> dict[str, PrepareOutcome]:
        """Return an outcome for every claim, keyed by claim UID."""
        ...

    async def unprepare(self, claims: Sequence[ClaimRef]) -> dict[str, ClaimError | None]:
        """Return ``None`` (success) or an error for every claim, keyed by claim UID."""
        ...
