"""Device metadata (KEP-5304) through the preparer: each request's file, mounted by the claim's spec.

What a container would read is checked where it comes from: the spec's mount names a host file, and
that file names the request's devices with the attributes the node's ResourceSlice publishes for
them (the PCI address KubeVirt passes through, the NUMA node). Unprepare takes the file away with
the spec; with the setting off, neither exists.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from dra_driver.cdi.metadata import MetadataFiles
from dra_driver.cdi.spec import common_edits
from dra_driver.gpu_plugin.policies import desired_slices
from dra_driver.node.claims import allocated_claim
from dra_driver.node.plan import MetadataSource, plan_claim
from dra_driver.node.preparer import NodePreparer
from dra_driver.node.types import ClaimError
from dra_driver.settings import Settings

from .builders import DRIVER, NODE, Node, claim_json, new_ref, result

CONTAINER_DIR = "/var/run/kubernetes.io/dra-device-attributes"


def plugin_dir(node: Node) -> Path:
    return node.root / "plugins" / DRIVER


async def started(node: Node) -> NodePreparer:
    return await node.started(metadata=MetadataFiles(plugin_dir(node)))


def mounts(node: Node, uid: str) -> dict[str, list[dict[str, Any]]]:
    """Each CDI device of the claim's spec (by our device name) with its mounts."""
    spec = json.loads(node.specs.path_for(uid).read_text())
    return {d["name"].removeprefix(f"{uid}-"): d["containerEdits"].get("mounts", []) for d in spec["devices"]}


def read_metadata(path: str) -> dict[str, Any]:
    """The first object of the stream: the newest version, which a reader takes."""
    first, _ = json.JSONDecoder().raw_decode(Path(path).read_text())
    assert isinstance(first, dict)
    return first


def published(node: Node, device: str) -> dict[str, Any]:
    """The attributes of ``device`` in the node's desired ResourceSlices."""
    slices = desired_slices(Settings(driver_name=DRIVER, node_name=NODE), node.backend.inventory())
    attributes: dict[str, Any] = next(d for s in slices for d in s.devices if d["name"] == device)[
        "attributes"
    ]
    return attributes


async def test_each_request_mounts_its_file_naming_its_devices_as_published(node: Node) -> None:
    preparer = await started(node)
    ref = new_ref("vm-gpus", "tenant")
    node.claims.put(
        claim_json(
            ref, [result("gpu-0", "passthrough"), result("gpu-1", "passthrough"), result("gpu-4", "infer")]
        )
    )

    await preparer.prepare([ref])

    by_device = mounts(node, ref.uid)
    passthrough = f"{CONTAINER_DIR}/resourceclaims/vm-gpus/passthrough/{DRIVER}-metadata.json"
    assert [(m["containerPath"], m["options"]) for m in by_device["gpu-0"]] == [(passthrough, ["ro", "bind"])]
    assert by_device["gpu-1"] == by_device["gpu-0"]  # one file per request: the runtime mounts it once
    assert (
        by_device["gpu-4"][0]["containerPath"]
        == f"{CONTAINER_DIR}/resourceclaims/vm-gpus/infer/{DRIVER}-metadata.json"
    )

    host_file = by_device["gpu-0"][0]["hostPath"]
    assert host_file == str(
        plugin_dir(node) / "dra-device-metadata" / "tenant_vm-gpus" / "passthrough" / "metadata.json"
    )
    content = read_metadata(host_file)
    assert content["metadata"] == {"name": "vm-gpus", "namespace": "tenant", "uid": ref.uid, "generation": 1}
    (request,) = content["requests"]
    assert request["name"] == "passthrough"
    assert [(d["driver"], d["pool"], d["name"]) for d in request["devices"]] == [
        (DRIVER, NODE, "gpu-0"),
        (DRIVER, NODE, "gpu-1"),
    ]
    gpu_0 = request["devices"][0]["attributes"]
    assert gpu_0 == published(node, "gpu-0")
    bus_id = node.backend.inventory().gpus[0].pci_bus_id
    assert gpu_0["resource.kubernetes.io/pciBusID"] == {"string": bus_id}
    assert "int" in gpu_0["resource.kubernetes.io/numaNode"]


async def test_a_claim_from_a_template_is_found_under_the_pods_name_for_it(node: Node) -> None:
    preparer = await started(node)
    ref = new_ref("vm-7f3k9-gpu-x2x4q")
    claim = claim_json(ref, [result("gpu-4", "gpu/l4")])  # a firstAvailable subrequest
    claim["metadata"]["annotations"] = {"resource.kubernetes.io/pod-claim-name": "gpu"}
    node.claims.put(claim)

    await preparer.prepare([ref])

    (mount,) = mounts(node, ref.uid)["gpu-4"]
    assert mount["containerPath"] == f"{CONTAINER_DIR}/resourceclaimtemplates/gpu/gpu/{DRIVER}-metadata.json"
    content = read_metadata(mount["hostPath"])
    assert content["podClaimName"] == "gpu"
    assert (
        content["requests"][0]["name"] == "gpu/l4"
    )  # the file is the request's, the object names the subrequest


async def test_a_created_mig_device_is_described_with_its_uuid(node: Node) -> None:
    preparer = await started(node)
    ref = new_ref()
    node.allocate(ref, "gpu-0-mig-3g40gb-9-4")

    await preparer.prepare([ref])

    (mount,) = mounts(node, ref.uid)["gpu-0-mig-3g40gb-9-4"]
    attributes = read_metadata(mount["hostPath"])["requests"][0]["devices"][0]["attributes"]
    (mig,) = node.backend.inventory().gpus[0].mig_devices
    assert attributes["uuid"] == {"string": mig.uuid}
    assert attributes["profile"] == {"string": "3g.40gb"}
    assert attributes["parentUUID"] == {"string": node.backend.inventory().gpus[0].uuid}


async def test_unprepare_removes_the_file_with_the_spec(node: Node) -> None:
    preparer = await started(node)
    ref = new_ref()
    node.allocate(ref, "gpu-0")
    await preparer.prepare([ref])
    assert read_metadata(mounts(node, ref.uid)["gpu-0"][0]["hostPath"])["requests"][0]["name"] == "gpu"

    assert await preparer.unprepare([ref]) == {ref.uid: None}

    assert not node.specs.path_for(ref.uid).exists()
    assert not (plugin_dir(node) / "dra-device-metadata" / f"{ref.namespace}_{ref.name}").exists()


async def test_a_failed_prepare_leaves_no_file(node: Node) -> None:
    preparer = await started(node)
    holder, second = new_ref("holder"), new_ref("second")
    node.allocate(holder, "gpu-0")
    node.allocate(second, "gpu-0")
    await preparer.prepare([holder])

    outcome = await preparer.prepare([second])

    assert isinstance(outcome[second.uid], ClaimError)
    assert not (plugin_dir(node) / "dra-device-metadata" / f"{second.namespace}_{second.name}").exists()
    assert (plugin_dir(node) / "dra-device-metadata" / f"{holder.namespace}_{holder.name}").exists()


async def test_off_by_default_no_file_and_no_mount(node: Node) -> None:
    preparer = await node.started()
    ref = new_ref()
    node.allocate(ref, "gpu-0")

    await preparer.prepare([ref])

    assert mounts(node, ref.uid) == {"gpu-0": []}
    assert not (node.root / "plugins").exists()


async def test_a_request_name_that_cannot_be_a_path_fails_the_claim_alone(node: Node) -> None:
    preparer = await started(node)
    bad, good = new_ref("bad"), new_ref("good")
    node.claims.put(claim_json(bad, [result("gpu-0", "../../etc")]))
    node.allocate(good, "gpu-1")

    outcome = await preparer.prepare([bad, good])

    assert isinstance(outcome[bad.uid], ClaimError)
    assert "'../../etc' cannot name a device metadata file" in outcome[bad.uid].message
    assert not isinstance(outcome[good.uid], ClaimError)
    assert not (plugin_dir(node) / "dra-device-metadata" / "default_bad").exists()


@pytest.mark.parametrize("kind", ["full GPU (one step)", "MIG device to create (in steps)"])
async def test_a_failed_spec_write_takes_the_file_back(
    node: Node, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    preparer = await started(node)
    ref = new_ref()
    node.allocate(ref, "gpu-0" if kind.startswith("full") else "gpu-0-mig-3g40gb-9-4")

    def failing_write(claim_uid: str, spec: Mapping[str, Any]) -> tuple[Path, int]:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(preparer._specs, "_write_locked", failing_write)

    outcome = await preparer.prepare([ref])

    assert isinstance(outcome[ref.uid], ClaimError)
    assert not (plugin_dir(node) / "dra-device-metadata" / f"{ref.namespace}_{ref.name}").exists()


async def test_after_a_reboot_no_file_of_the_earlier_boot_is_left(node: Node) -> None:
    ref = new_ref()
    node.allocate(ref, "gpu-0")
    await (await started(node)).prepare([ref])
    assert (plugin_dir(node) / "dra-device-metadata" / f"{ref.namespace}_{ref.name}").is_dir()

    node.reboot()
    await started(node)

    assert not (plugin_dir(node) / "dra-device-metadata").exists()


def test_every_device_the_node_publishes_is_described_as_published(node: Node) -> None:
    """Whatever kind a published device is, its file carries the attributes its slice does.

    Planned, not prepared: every full GPU, an administrator's MIG device, every maintenance device
    (admin access only) and every passthrough device. A placement is described once its MIG device
    exists (test_a_created_mig_device_is_described_with_its_uuid). A new kind of device that the
    pool publishes but the metadata describes otherwise fails here.
    """
    node.backend.admin_set_mig_mode(1, True)
    node.backend.admin_create_mig(1, "3g.40gb", 4)
    inventory = node.backend.inventory()
    settings = Settings(driver_name=DRIVER, node_name=NODE, passthrough=True)
    passthrough = node.backend.pci().passthrough_gpus()
    devices = [d for s in desired_slices(settings, inventory, passthrough=passthrough) for d in s.devices]
    source = MetadataSource(Path("/plugins") / DRIVER, inventory)
    described = 0
    for device in devices:
        ref = new_ref()
        options: dict[str, Any] = {"admin_access": True} if device["name"].endswith("-maintenance") else {}
        claim = allocated_claim(ref, claim_json(ref, [result(device["name"], **options)]), DRIVER, NODE)
        planned = plan_claim(
            claim, inventory, DRIVER, common_edits(inventory, None), metadata=source, passthrough=passthrough
        )
        if planned.to_create:
            continue
        (content,) = planned.metadata_files.values()
        first, _ = json.JSONDecoder().raw_decode(content.decode())
        (entry,) = first["requests"][0]["devices"]
        assert entry["attributes"] == device["attributes"], device["name"]
        described += 1
    kinds = {d["attributes"]["type"]["string"] for d in devices if "uuid" in d["attributes"]}
    assert kinds == {"gpu", "mig", "maintenance", "vfio"}
    assert described == sum(1 for d in devices if "uuid" in d["attributes"])
