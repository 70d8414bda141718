"""The conflict rules of :func:`dra_driver.node.state.apply`, with the holders it keeps between calls."""

from __future__ import annotations

import pytest

from dra_driver.node import state as state_module
from dra_driver.node.checkpoint import Checkpoint, ClaimRecord, DeviceRecord
from dra_driver.node.state import MutationRejected, Release, Reserve, apply


def record(attempt: str, device: str) -> ClaimRecord:
    return ClaimRecord(
        namespace="ns",
        name=f"claim-{attempt}",
        phase="PrepareCompleted",
        attempt=attempt,
        devices=(
            DeviceRecord(request="gpu", pool="node-a", device=device, cdi_device_ids=(f"k/c={device}",)),
        ),
    )


def empty() -> Checkpoint:
    return Checkpoint(boot_id="boot-1", generation=1, claims={})


def test_a_device_stays_exclusive_across_consecutive_applies() -> None:
    held, (outcome,) = apply(empty(), [Reserve("u1", record("a1", "gpu-0"))])
    assert outcome is None
    _, (refused,) = apply(held, [Reserve("u2", record("a2", "gpu-0"))])
    assert isinstance(refused, MutationRejected)
    released, _ = apply(held, [Release("u1")])
    taken, (outcome,) = apply(released, [Reserve("u2", record("a2", "gpu-0"))])
    assert outcome is None
    assert sorted(taken.claims) == ["u2"]


def test_an_older_or_foreign_checkpoint_gets_its_own_holders() -> None:
    held, _ = apply(empty(), [Reserve("u1", record("a1", "gpu-0"))])
    released, _ = apply(held, [Release("u1")])
    # The older state again (a write that failed keeps it): u1 still holds gpu-0 there.
    _, (refused,) = apply(held, [Reserve("u2", record("a2", "gpu-0"))])
    assert isinstance(refused, MutationRejected)
    # An equal copy read from the file is another object: the same rules, from its own claims.
    copy = Checkpoint.model_validate_json(held.model_dump_json())
    _, (refused,) = apply(copy, [Reserve("u3", record("a3", "gpu-0"))])
    assert isinstance(refused, MutationRejected)
    _, (outcome,) = apply(released, [Reserve("u3", record("a3", "gpu-0"))])
    assert outcome is None


def test_consecutive_applies_do_not_walk_every_claim_again(monkeypatch: pytest.MonkeyPatch) -> None:
    state, _ = apply(empty(), [Reserve(f"u{i}", record(f"a{i}", f"gpu-{i}")) for i in range(200)])
    built: list[int] = []
    real_init = state_module._Holders.__init__

    def counting_init(self: state_module._Holders, claims: dict[str, ClaimRecord]) -> None:
        built.append(len(claims))
        real_init(self, claims)

    monkeypatch.setattr(state_module._Holders, "__init__", counting_init)
    for i in range(200, 250):
        state, (outcome,) = apply(state, [Reserve(f"u{i}", record(f"a{i}", f"gpu-{i}"))])
        assert outcome is None
        state, _ = apply(state, [Release(f"u{i - 200}")])
    assert built == []  # the cost of a commit does not grow with the claims the node holds
    assert len(state.claims) == 200
