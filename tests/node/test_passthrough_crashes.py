"""A passthrough claim's prepare or unprepare killed at each of its crash points, then the next start.

The kill -9 suite once left a GPU on vfio-pci with no claim holding it (docs/reliability.md). What
a crash must leave, whatever the point, is a state the next start of the plugin repairs: the
claim prepared (its CDI spec, its record, its GPU on vfio-pci), or its GPU back on nvidia and
seen by NVML again, so published; and after the kubelet's retried prepare and its unprepare,
nothing but the GPU on nvidia. The same holds when the node's store is lost too before the start
(the spec, written before the GPU leaves nvidia, still names it).

A crash is a SIGKILL simulated in this process, as in ``test_state_model.py``: at the armed point
the directories a killed process leaves (the store, the CDI specs, the simulated GPUs and their
sysfs tree) are copied and :class:`Crash` is raised; every later crash point raises too, since a
dead process writes nothing more; once the call has unwound, the copy is put back and the crashed
instance is closed, never to be called again.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from dra_driver import crashpoint
from dra_driver.devices.pci import NVIDIA, VFIO_PCI
from dra_driver.node.preparer import NodePreparer
from dra_driver.node.types import ClaimError, ClaimRef

from .builders import Node, new_ref
from .test_passthrough_prepare import bus, place_of, started, vfio_name

# Each point a passthrough claim's prepare passes, with the number of times: its reservation and
# its completed record are a transaction each, its spec is written before the GPU leaves nvidia and
# again once it is on vfio-pci (test_the_crash_points_of_a_passthrough_claim checks the list).
PREPARE = {
    "store.before_commit": 2, "store.after_commit": 2, "cdi.before_rename": 2, "cdi.after_write": 2,
    "vfio.before_bind": 1, "vfio.after_bind": 1,
}  # fmt: skip
# And its unprepare: the GPU back on nvidia, then the spec goes, then the record.
UNPREPARE = {
    "vfio.before_unbind": 1, "vfio.after_unbind": 1, "cdi.before_remove": 1, "cdi.after_remove": 1,
    "store.before_commit": 1, "store.after_commit": 1,
}  # fmt: skip


def every_hit(points: dict[str, int]) -> list[tuple[str, int]]:
    return [(point, nth) for point, hits in points.items() for nth in range(1, hits + 1)]


class Crash(BaseException):
    """A SIGKILL: a BaseException, so that no ``except Exception`` of the driver takes it."""


class Killed:
    """:func:`dra_driver.crashpoint.reached`, killing the process at the ``nth`` hit of ``point``."""

    def __init__(self, node: Node, point: str, nth: int) -> None:
        self._directories = (node.state_dir, node.cdi_dir, node.root / "sim")
        self._point, self._nth = point, nth
        self.hits: Counter[str] = Counter()  # every point passed, with how often
        self._copy: Path | None = None

    def reached(self, name: str) -> None:
        if self._copy is not None:
            raise Crash("dead")
        self.hits[name] += 1
        if name != self._point or self.hits[name] < self._nth:
            return
        self._copy = Path(tempfile.mkdtemp(prefix="killed-"))
        for number, directory in enumerate(self._directories):
            if directory.exists():
                shutil.copytree(directory, self._copy / str(number), symlinks=True)
        raise Crash(f"{name}@{self._nth}")

    def leave_the_disk_as_it_was(self) -> None:
        """The directories as they were at the kill (what the dying call's unwinding did is undone)."""
        assert self._copy is not None
        for number, directory in enumerate(self._directories):
            shutil.rmtree(directory, ignore_errors=True)
            if (self._copy / str(number)).exists():
                shutil.copytree(self._copy / str(number), directory, symlinks=True)
        shutil.rmtree(self._copy)


@contextlib.contextmanager
def armed(node: Node, point: str, nth: int) -> Iterator[Killed]:
    killed = Killed(node, point, nth)
    original, crashpoint.reached = crashpoint.reached, killed.reached
    try:
        yield killed
    finally:
        crashpoint.reached = original


async def call(preparer: NodePreparer, operation: str, ref: ClaimRef) -> object:
    if operation == "prepare":
        return (await preparer.prepare([ref]))[ref.uid]
    return (await preparer.unprepare([ref]))[ref.uid]


async def killed_during(
    node: Node, preparer: NodePreparer, operation: str, ref: ClaimRef, at: tuple[str, int]
) -> None:
    """``operation`` of ``ref`` killed at the ``at[1]``-th hit of crash point ``at[0]``."""
    with armed(node, *at) as killed, pytest.raises(Crash):
        await call(preparer, operation, ref)
    preparer.close()
    killed.leave_the_disk_as_it_was()


def lose_the_store(node: Node) -> None:
    for path in node.state_dir.iterdir():
        path.unlink()


def repaired(node: Node, ref: ClaimRef) -> str:
    """What the start left of the claim's GPU: "prepared" or "on nvidia"; AssertionError otherwise."""
    address = place_of(node, 0).address
    driver = bus(node).driver(address)
    record = node.on_disk().claims.get(ref.uid)
    if driver == VFIO_PCI:
        assert record is not None, "the GPU is on vfio-pci, and no claim holds it"
        assert record.phase in ("PrepareCompleted", "Recovered"), f"on vfio-pci, the record {record.phase}"
        assert node.specs.path_for(ref.uid).exists(), "on vfio-pci, and no spec names it"
        return "prepared"
    assert driver == NVIDIA, f"the GPU is bound to {driver or 'no driver'}"
    assert address in {g.pci_bus_id for g in node.backend.inventory().gpus}, "NVML does not see the GPU"
    return "on nvidia"


def clean(node: Node, ref: ClaimRef) -> None:
    assert bus(node).driver(place_of(node, 0).address) == NVIDIA
    assert ref.uid not in node.on_disk().claims
    assert not node.specs.path_for(ref.uid).exists()


async def test_the_crash_points_of_a_passthrough_claim(node: Node) -> None:
    """The lists the tests below kill at are every point that prepare and unprepare pass."""
    preparer = await started(node)
    vm = new_ref("vm")
    node.allocate(vm, vfio_name(node, 0))
    for operation, points in (("prepare", PREPARE), ("unprepare", UNPREPARE)):
        with armed(node, "none", 1) as passed:
            outcome = await call(preparer, operation, vm)
        assert outcome is None or not isinstance(outcome, ClaimError), outcome
        assert dict(passed.hits) == points, operation


@pytest.mark.parametrize("kubelet", ["retries", "unprepares"])
@pytest.mark.parametrize("store", ["kept", "lost"])
@pytest.mark.parametrize("at", every_hit(PREPARE), ids="{0[0]}@{0[1]}".format)
async def test_a_prepare_killed_anywhere_is_repaired_by_the_next_start(
    node: Node, at: tuple[str, int], store: str, kubelet: str
) -> None:
    """The kubelet then retries the prepare, or goes straight to unprepare (the pod was deleted
    while the plugin was down); either way its unprepare leaves nothing and the GPU on nvidia."""
    first = await started(node)
    vm = new_ref("vm")
    node.allocate(vm, vfio_name(node, 0))
    await killed_during(node, first, "prepare", vm, at)
    if store == "lost":
        lose_the_store(node)

    second = await started(node)
    repaired(node, vm)
    if kubelet == "retries":
        assert not isinstance(await call(second, "prepare", vm), ClaimError)
        assert repaired(node, vm) == "prepared"
    assert await call(second, "unprepare", vm) is None
    clean(node, vm)


@pytest.mark.parametrize("store", ["kept", "lost"])
@pytest.mark.parametrize("at", every_hit(UNPREPARE), ids="{0[0]}@{0[1]}".format)
async def test_an_unprepare_killed_anywhere_is_repaired_by_the_next_start(
    node: Node, at: tuple[str, int], store: str
) -> None:
    first = await started(node)
    vm = new_ref("vm")
    node.allocate(vm, vfio_name(node, 0))
    assert not isinstance(await call(first, "prepare", vm), ClaimError)
    await killed_during(node, first, "unprepare", vm, at)
    if store == "lost":
        lose_the_store(node)

    second = await started(node)
    repaired(node, vm)
    assert await call(second, "unprepare", vm) is None  # the kubelet's retry
    clean(node, vm)
