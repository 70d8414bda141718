"""Shares of a GPU (consumable capacity) through the preparer: real files, the simulated node.

The node (tests/node/builders.py) has 2x H100 80GB (gpu-0, gpu-1: 132 SMs, 79Gi per share at
most), 2x A100 40GB and 2x L4.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

from dra_driver.node.types import ClaimError, PreparedDevice

from .builders import DRIVER, NODE, Node, gpu_config, new_ref, opaque, result

KIND = f"k8s.{DRIVER}/claim"
GIB = 2**30


def share_id() -> str:
    return str(uuid.uuid4())


def spec(node: Node, uid: str) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(node.specs.path_for(uid).read_text())
    return loaded


def device_env(node: Node, uid: str) -> dict[str, dict[str, str]]:
    """Each CDI device's env of the claim's spec, by CDI device name."""
    return {
        device["name"]: dict(v.split("=", 1) for v in device["containerEdits"]["env"])
        for device in spec(node, uid)["devices"]
    }


async def test_shares_of_one_gpu_get_distinct_cdi_devices_and_their_own_limits(node: Node) -> None:
    preparer = await node.started(consumable=True)
    refs = [new_ref(f"share-{i}") for i in range(3)]
    shares = [share_id() for _ in refs]
    for ref, share in zip(refs, shares, strict=True):
        node.allocate(ref, "gpu-0", share_id=share, consumed={"memory": "10Gi", "multiprocessors": "0"})

    outcomes = await preparer.prepare(refs)

    ids = set()
    for ref, share in zip(refs, shares, strict=True):
        name = f"{ref.uid}-gpu-0-share-{share}"
        assert outcomes[ref.uid] == (PreparedDevice(("gpu",), NODE, "gpu-0", (f"{KIND}={name}",), share),)
        env = device_env(node, ref.uid)[name]
        assert env["DRA_GPU_SHARING_STRATEGY_GPU_0"] == "MPS"
        assert env["DRA_GPU_MPS_PINNED_DEVICE_MEMORY_LIMIT_GPU_0"] == str(10 * GIB)
        assert "DRA_GPU_MPS_ACTIVE_THREAD_PERCENTAGE_GPU_0" not in env  # no SMs asked: no compute limit
        ids.add(name)
        recorded = node.on_disk().claims[ref.uid].devices[0]
        assert (recorded.device, recorded.share_id) == ("gpu-0", share)
        assert recorded.config is not None
        assert recorded.config["sharing"] == {
            "strategy": "MPS",
            "mps": {"defaultPinnedDeviceMemoryLimit": "10240Mi"},
        }
    assert len(ids) == 3


async def test_unpreparing_one_share_leaves_the_others(node: Node) -> None:
    preparer = await node.started(consumable=True)
    first, second = new_ref("first"), new_ref("second")
    for ref in (first, second):
        node.allocate(ref, "gpu-1", share_id=share_id(), consumed={"memory": "20Gi"})
    await preparer.prepare([first, second])

    assert await preparer.unprepare([first]) == {first.uid: None}

    assert set(node.on_disk().claims) == {second.uid}
    assert not node.specs.path_for(first.uid).exists()
    assert node.specs.path_for(second.uid).exists()


async def test_sms_asked_become_an_active_thread_percentage_rounded_up(node: Node) -> None:
    preparer = await node.started(consumable=True)
    ref = new_ref()
    share = share_id()
    node.allocate(ref, "gpu-0", share_id=share, consumed={"memory": "10Gi", "multiprocessors": "33"})

    await preparer.prepare([ref])

    env = device_env(node, ref.uid)[f"{ref.uid}-gpu-0-share-{share}"]
    assert env["DRA_GPU_MPS_ACTIVE_THREAD_PERCENTAGE_GPU_0"] == "25"  # 33 of 132 SMs


async def test_a_share_that_takes_the_whole_gpu_is_prepared_as_the_gpu(node: Node) -> None:
    """A claim that asks for no memory consumes the policy's default, all of it: nothing to limit."""
    preparer = await node.started(consumable=True)
    ref = new_ref()
    share = share_id()
    node.allocate(ref, "gpu-0", share_id=share, consumed={"memory": "79Gi", "multiprocessors": "0"})

    await preparer.prepare([ref])

    env = device_env(node, ref.uid)[f"{ref.uid}-gpu-0-share-{share}"]
    assert env["DRA_GPU_SHARING_STRATEGY_GPU_0"] == "Exclusive"


async def test_two_shares_of_one_gpu_in_one_claim_are_pooled(node: Node) -> None:
    preparer = await node.started(consumable=True)
    ref = new_ref()
    a, b = share_id(), share_id()
    node.claims.put(
        {
            "metadata": {"namespace": ref.namespace, "name": ref.name, "uid": ref.uid},
            "status": {
                "allocation": {
                    "devices": {
                        "results": [
                            result("gpu-0", "a", share_id=a, consumed={"memory": "10Gi"}),
                            result("gpu-0", "b", share_id=b, consumed={"memory": "5Gi"}),
                        ]
                    }
                }
            },
        }
    )

    outcome = await preparer.prepare([ref])

    assert not isinstance(outcome[ref.uid], ClaimError), outcome
    envs = device_env(node, ref.uid)
    assert set(envs) == {f"{ref.uid}-gpu-0-share-{a}", f"{ref.uid}-gpu-0-share-{b}"}
    assert {env["DRA_GPU_MPS_PINNED_DEVICE_MEMORY_LIMIT_GPU_0"] for env in envs.values()} == {str(15 * GIB)}


async def test_an_mps_config_may_tighten_a_share_but_not_loosen_it(node: Node) -> None:
    preparer = await node.started(consumable=True)
    tight, loose = new_ref("tight"), new_ref("loose")
    mps = {"strategy": "MPS", "mps": {"defaultPinnedDeviceMemoryLimit": "8Gi"}}
    node.allocate(
        tight, "gpu-0", share_id=share_id(), consumed={"memory": "10Gi"}, configs=[opaque(gpu_config(mps))]
    )
    mps_loose = {"strategy": "MPS", "mps": {"defaultPinnedDeviceMemoryLimit": "12Gi"}}
    node.allocate(
        loose,
        "gpu-0",
        share_id=share_id(),
        consumed={"memory": "10Gi"},
        configs=[opaque(gpu_config(mps_loose))],
    )

    outcomes = await preparer.prepare([tight, loose])

    (env,) = device_env(node, tight.uid).values()
    assert env["DRA_GPU_MPS_PINNED_DEVICE_MEMORY_LIMIT_GPU_0"] == str(8 * GIB)
    assert isinstance(outcomes[loose.uid], ClaimError)
    assert "defaultPinnedDeviceMemoryLimit 12Gi, more than the share" in outcomes[loose.uid].message
    assert ref_not_prepared(node, loose.uid)


async def test_a_tenant_cannot_time_slice_a_share_and_lock_its_neighbours_out(node: Node) -> None:
    """The strategy of a share is its class's: a claim's TimeSlicing is refused, first or not."""
    preparer = await node.started(consumable=True)
    sliced, neighbour = new_ref("sliced"), new_ref("neighbour")
    slicing = {"strategy": "TimeSlicing", "timeSlicing": {"interval": "Long"}}
    node.allocate(
        sliced,
        "gpu-1",
        share_id=share_id(),
        consumed={"memory": "10Gi"},
        configs=[opaque(gpu_config(slicing))],
    )
    node.allocate(neighbour, "gpu-1", share_id=share_id(), consumed={"memory": "10Gi"})

    first = (await preparer.prepare([sliced]))[sliced.uid]
    second = (await preparer.prepare([neighbour]))[neighbour.uid]

    assert isinstance(first, ClaimError)
    assert "asks for TimeSlicing with interval Long, but the sharing of a share is its DeviceClass's" in (
        first.message
    )
    assert ref_not_prepared(node, sliced.uid)
    assert not isinstance(second, ClaimError)  # the MPS-limited neighbour is not locked out
    (env,) = device_env(node, neighbour.uid).values()
    assert env["DRA_GPU_MPS_PINNED_DEVICE_MEMORY_LIMIT_GPU_1"] == str(10 * GIB)


async def test_shares_are_time_sliced_when_their_class_says_so(node: Node) -> None:
    preparer = await node.started(consumable=True)
    plain, same, other, mps = new_ref("plain"), new_ref("same"), new_ref("other"), new_ref("mps")
    class_slicing = opaque(
        gpu_config({"strategy": "TimeSlicing", "timeSlicing": {"interval": "Long"}}), source="FromClass"
    )
    claims = {
        plain: [class_slicing, opaque(gpu_config())],  # Exclusive: says nothing about a share
        same: [
            class_slicing,
            opaque(gpu_config({"strategy": "TimeSlicing", "timeSlicing": {"interval": "Long"}})),
        ],
        other: [
            class_slicing,
            opaque(gpu_config({"strategy": "TimeSlicing", "timeSlicing": {"interval": "Short"}})),
        ],
        mps: [class_slicing, opaque(gpu_config({"strategy": "MPS"}))],
    }
    for ref, configs in claims.items():
        node.allocate(ref, "gpu-0", share_id=share_id(), consumed={"memory": "10Gi"}, configs=configs)

    outcomes = await preparer.prepare(list(claims))

    for ref in (plain, same):
        (env,) = device_env(node, ref.uid).values()
        assert env["DRA_GPU_SHARING_STRATEGY_GPU_0"] == "TimeSlicing"
        assert env["DRA_GPU_TIME_SLICE_INTERVAL_GPU_0"] == "Long"
        assert "DRA_GPU_MPS_PINNED_DEVICE_MEMORY_LIMIT_GPU_0" not in env
    for ref, asked in ((other, "TimeSlicing with interval Short"), (mps, "MPS")):
        outcome = outcomes[ref.uid]
        assert isinstance(outcome, ClaimError)
        assert (
            "time-sliced as its DeviceClass says (TimeSlicing with interval Long); config[1] (FromClaim"
            in (outcome.message)
        )
        assert f"asks for {asked}, but the sharing of a share is its class's" in outcome.message


def ref_not_prepared(node: Node, uid: str) -> bool:
    return uid not in node.on_disk().claims and not node.specs.path_for(uid).exists()


async def test_a_share_that_does_not_fit_the_policy_is_refused_clearly(node: Node) -> None:
    preparer = await node.started(consumable=True)
    too_big, unaligned, no_memory = new_ref("big"), new_ref("unaligned"), new_ref("none")
    node.allocate(too_big, "gpu-0", share_id=share_id(), consumed={"memory": "80Gi"})
    node.allocate(unaligned, "gpu-0", share_id=share_id(), consumed={"memory": "1536Mi"})
    node.allocate(no_memory, "gpu-0", share_id=share_id(), consumed={"multiprocessors": "1"})

    outcomes = await preparer.prepare([too_big, unaligned, no_memory])

    messages = {
        ref.name: outcome.message
        for ref in (too_big, unaligned, no_memory)
        if isinstance(outcome := outcomes[ref.uid], ClaimError)
    }
    assert "memory 80Gi is outside the policy's range 1Gi-79Gi" in messages["big"]
    assert "is not a whole number of 1Gi steps" in messages["unaligned"]
    assert "it records no memory" in messages["none"]
    assert all("delete the pod so the claim is allocated again" in m for m in messages.values())
    assert node.spec_files() == set()


async def test_a_share_is_refused_where_consumable_capacity_is_off(node: Node) -> None:
    preparer = await node.started()
    ref = new_ref()
    node.allocate(ref, "gpu-0", share_id=share_id(), consumed={"memory": "10Gi"})

    (outcome,) = (await preparer.prepare([ref])).values()

    assert isinstance(outcome, ClaimError)
    assert "consumable capacity is off on this node (--consumable-capacity)" in outcome.message


async def test_a_share_of_a_mig_device_is_refused(node: Node) -> None:
    preparer = await node.started(consumable=True)
    ref = new_ref()
    node.allocate(ref, "gpu-0-mig-1g10gb-19-0", share_id=share_id(), consumed={"memory": "1Gi"})

    (outcome,) = (await preparer.prepare([ref])).values()

    assert isinstance(outcome, ClaimError)
    assert "only full GPUs are published as shareable" in outcome.message


async def test_exclusive_allocations_and_shares_of_one_gpu_never_mix(node: Node) -> None:
    """What a switch of --consumable-capacity with claims still prepared could bring."""
    preparer = await node.started(consumable=True)
    shared, exclusive = new_ref("shared"), new_ref("exclusive")
    node.allocate(shared, "gpu-0", share_id=share_id(), consumed={"memory": "10Gi"})
    node.allocate(exclusive, "gpu-0")
    await preparer.prepare([shared])

    refused = (await preparer.prepare([exclusive]))[exclusive.uid]

    assert isinstance(refused, ClaimError)
    assert "device gpu-0 cannot be prepared exclusively: claim default/shared" in refused.message
    assert "holds a share of gpu-0" in refused.message

    await preparer.unprepare([shared])
    assert not isinstance((await preparer.prepare([exclusive]))[exclusive.uid], ClaimError)
    late = new_ref("late")
    node.allocate(late, "gpu-0", share_id=share_id(), consumed={"memory": "10Gi"})
    refused = (await preparer.prepare([late]))[late.uid]
    assert isinstance(refused, ClaimError)
    assert (
        "a share of device gpu-0 cannot be prepared: it is prepared exclusively for claim default/exclusive"
        in (refused.message)
    )


async def test_shares_that_together_exceed_the_gpus_memory_are_refused_at_the_store(node: Node) -> None:
    """What a stale ResourceSlice, or a second scheduler, could allocate: 100Gi of an 80GB GPU."""
    preparer = await node.started(consumable=True)
    first, second = new_ref("first"), new_ref("second")
    node.allocate(first, "gpu-0", share_id=share_id(), consumed={"memory": "50Gi"})
    node.allocate(second, "gpu-0", share_id=share_id(), consumed={"memory": "50Gi"})
    await preparer.prepare([first])

    refused = (await preparer.prepare([second]))[second.uid]

    assert isinstance(refused, ClaimError)
    assert "the shares of device gpu-0 would use 100Gi of its" in refused.message
    assert "default/first" in refused.message
    assert set(node.on_disk().claims) == {first.uid}
    assert not node.specs.path_for(second.uid).exists()
    await preparer.unprepare([first])
    assert not isinstance((await preparer.prepare([second]))[second.uid], ClaimError)


async def test_no_mig_device_is_created_on_a_gpu_with_shares(node: Node) -> None:
    preparer = await node.started(consumable=True)
    shared, partition = new_ref("shared"), new_ref("partition")
    node.allocate(shared, "gpu-0", share_id=share_id(), consumed={"memory": "10Gi"})
    node.allocate(partition, "gpu-0-mig-1g10gb-19-0")
    await preparer.prepare([shared])

    refused = (await preparer.prepare([partition]))[partition.uid]

    assert isinstance(refused, ClaimError)
    assert "MIG device gpu-0-mig-1g10gb-19-0 cannot be created: claim default/shared" in refused.message
    assert not [m for gpu in node.backend.inventory().gpus for m in gpu.mig_devices]


async def test_a_share_survives_a_lost_store(node: Node, tmp_path: Path) -> None:
    """Rebuilt from its CDI spec, a share keeps only its share reserved: the neighbour can come."""
    preparer = await node.started(consumable=True)
    ref, neighbour = new_ref("ref"), new_ref("neighbour")
    share = share_id()
    node.allocate(ref, "gpu-0", share_id=share, consumed={"memory": "10Gi"})
    node.allocate(neighbour, "gpu-0", share_id=share_id(), consumed={"memory": "10Gi"})
    await preparer.prepare([ref])
    for path in node.state_dir.glob("state.db*"):
        path.unlink()

    restarted = await node.started(consumable=True)

    (recovered,) = node.on_disk().claims[ref.uid].devices
    assert (recovered.device, recovered.share_id) == ("gpu-0", share)
    assert not isinstance((await restarted.prepare([neighbour]))[neighbour.uid], ClaimError)


def claim_env(node: Node, uid: str) -> dict[str, str]:
    return dict(v.split("=", 1) for v in spec(node, uid)["containerEdits"]["env"])


def gpu_uuid(node: Node, minor: int) -> str:
    return next(gpu.uuid for gpu in node.backend.inventory().gpus if gpu.minor == minor)


async def test_shares_of_one_gpu_are_clients_of_one_mps_daemon_each_with_its_limits(node: Node) -> None:
    preparer = await node.started(consumable=True)
    small, large = new_ref("small"), new_ref("large")
    node.allocate(small, "gpu-0", share_id=share_id(), consumed={"memory": "10Gi", "multiprocessors": "33"})
    node.allocate(large, "gpu-0", share_id=share_id(), consumed={"memory": "30Gi", "multiprocessors": "66"})

    outcomes = await preparer.prepare([small, large])

    assert not any(isinstance(o, ClaimError) for o in outcomes.values()), outcomes
    daemons = {node.on_disk().claims[r.uid].sharing.mps_daemon for r in (small, large)}  # type: ignore[union-attr]
    (daemon,) = daemons  # one per GPU: a GPU in ExclusiveProcess mode runs one MPS server
    assert daemon is not None
    assert node.mps.pid(daemon) is not None
    uuid = gpu_uuid(node, 0)
    assert claim_env(node, small.uid)["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"{uuid}=10240M"
    assert claim_env(node, small.uid)["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
    assert claim_env(node, large.uid)["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"{uuid}=30720M"
    assert claim_env(node, large.uid)["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
    assert node.backend.compute_policy(uuid).compute_mode.value == "ExclusiveProcess"

    assert (await preparer.unprepare([small]))[small.uid] is None
    assert node.mps.pid(daemon) is not None  # the other share still uses it
    assert (await preparer.unprepare([large]))[large.uid] is None
    assert node.mps.pid(daemon) is None
    assert node.backend.compute_policy(uuid).compute_mode.value == "Default"


async def test_shares_of_a_gpu_beside_other_mps_devices_in_one_claim_are_refused(node: Node) -> None:
    preparer = await node.started(consumable=True)
    ref = new_ref()
    node.claims.put(
        {
            "metadata": {"namespace": ref.namespace, "name": ref.name, "uid": ref.uid},
            "status": {
                "allocation": {
                    "devices": {
                        "results": [
                            result("gpu-0", "a", share_id=share_id(), consumed={"memory": "10Gi"}),
                            result("gpu-1", "b", share_id=share_id(), consumed={"memory": "10Gi"}),
                        ]
                    }
                }
            },
        }
    )

    (outcome,) = (await preparer.prepare([ref])).values()

    assert isinstance(outcome, ClaimError)
    assert "put the shares in a claim of their own" in outcome.message
    assert ref_not_prepared(node, ref.uid)


def standins_serving(root: Path) -> list[int]:
    """The stand-in MPS daemon processes alive under ``root`` (by their command line)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"dra_driver.simulated.mps_control" in cmdline and any(str(root).encode() in a for a in cmdline):
            found.append(int(proc.name))
    return found


async def test_shares_prepared_at_once_start_their_gpus_daemon_once(node: Node) -> None:
    preparer = await node.started(consumable=True)
    refs = [new_ref(f"share-{i}") for i in range(4)]
    for ref in refs:
        node.allocate(ref, "gpu-0", share_id=share_id(), consumed={"memory": "10Gi"})

    outcomes = await preparer.prepare(refs)

    assert not any(isinstance(o, ClaimError) for o in outcomes.values()), outcomes
    assert len(standins_serving(node.root / "mps")) == 1
    await preparer.unprepare(refs)
    assert standins_serving(node.root / "mps") == []
