"""The simulated GPUs enforce the hardware's MIG rules, and keep their state like hardware does."""

from __future__ import annotations

import json

import pytest

from dra_driver.devices.backend import DeviceError, DeviceInUseError, PlacementUnavailableError
from dra_driver.devices.types import DeviceNode, Gpu, MigProfile, Placement
from dra_driver.simulated.gpus import SimulatedBackend, placement_refusal

# H100 profile ids (nvidia-smi mig -lgip)
H100_1G, H100_1G_ME, H100_1G_20GB, H100_2G, H100_3G, H100_4G, H100_7G = 19, 20, 15, 14, 9, 5, 0


@pytest.fixture
def boot_id(tmp_path):
    path = tmp_path / "boot_id"
    path.write_text("boot-1\n")
    return path


@pytest.fixture
def node(tmp_path, boot_id):
    return SimulatedBackend("mixed", "node-a", tmp_path / "state", boot_id_path=boot_id)


def _gpu(backend: SimulatedBackend, product: str, nth: int = 0) -> Gpu:
    return [g for g in backend.inventory().gpus if g.product_name == product][nth]


def _h100(backend: SimulatedBackend) -> Gpu:
    return _gpu(backend, "NVIDIA H100 80GB HBM3")


def _a100(backend: SimulatedBackend) -> Gpu:
    return _gpu(backend, "NVIDIA A100-SXM4-40GB")


def _now(backend: SimulatedBackend, gpu_uuid: str) -> Gpu:
    gpu = backend.inventory().gpu(gpu_uuid)
    assert gpu is not None
    return gpu


def _live(backend: SimulatedBackend, gpu_uuid: str) -> list[tuple[str, Placement]]:
    return sorted((d.profile, d.placement) for d in _now(backend, gpu_uuid).mig_devices)


def test_hopper_creates_a_mig_device_and_switches_mig_mode_on(node):
    h100 = _h100(node)
    created = node.create_mig_device(h100.uuid, H100_3G, Placement(4, 4))
    assert created.uuid.startswith("MIG-")
    assert (created.parent_uuid, created.profile, created.profile_id) == (h100.uuid, "3g.40gb", H100_3G)
    assert created.placement == Placement(4, 4)
    after = _now(node, h100.uuid)
    assert after.mig_enabled
    assert after.mig_devices == (created,)


def test_ids_and_capability_nodes_follow_the_driver_numbering(node):
    h100 = _h100(node)  # minor 0
    three_g = node.create_mig_device(h100.uuid, H100_3G, Placement(0, 4))
    one_g = node.create_mig_device(h100.uuid, H100_1G, Placement(6, 1))
    assert (three_g.gpu_instance_id, three_g.compute_instance_id) == (1, 0)
    assert three_g.cap_nodes == (
        DeviceNode("/dev/nvidia-caps/nvidia-cap12", 237, 12),
        DeviceNode("/dev/nvidia-caps/nvidia-cap13", 237, 13),
    )
    assert one_g.gpu_instance_id == 13  # the eighth at slice 6
    second = _gpu(node, "NVIDIA H100 80GB HBM3", 1)  # minor 1: 135 minors further
    seven_g = node.create_mig_device(second.uuid, H100_7G, Placement(0, 8))
    assert seven_g.gpu_instance_id == 0
    assert [n.minor for n in seven_g.cap_nodes] == [138, 139]


def test_overlapping_placements_are_refused_and_nothing_changes(node):
    h100 = _h100(node)
    node.create_mig_device(h100.uuid, H100_4G, Placement(0, 4))
    before = _live(node, h100.uuid)
    with pytest.raises(PlacementUnavailableError, match=r"overlap the live 4g\.40gb instance at 0\.\.3"):
        node.create_mig_device(h100.uuid, H100_1G, Placement(2, 1))
    with pytest.raises(PlacementUnavailableError, match="overlap"):
        node.create_mig_device(h100.uuid, H100_7G, Placement(0, 8))
    assert _live(node, h100.uuid) == before
    node.create_mig_device(h100.uuid, H100_3G, Placement(4, 4))  # the classic 4+3 split fits


def test_a_placement_the_profile_does_not_offer_is_refused(node):
    h100 = _h100(node)
    with pytest.raises(PlacementUnavailableError, match=r"starts at 0, 4 with size 4"):
        node.create_mig_device(h100.uuid, H100_3G, Placement(2, 4))
    with pytest.raises(PlacementUnavailableError, match="cannot be placed"):
        node.create_mig_device(h100.uuid, H100_1G, Placement(7, 1))  # 1g never starts at slice 7
    with pytest.raises(PlacementUnavailableError, match="cannot be placed"):
        node.create_mig_device(h100.uuid, H100_3G, Placement(0, 8))  # right start, wrong size
    gpu = _now(node, h100.uuid)
    assert not gpu.mig_enabled


def test_instance_count_is_respected(node):
    h100 = _h100(node)
    node.create_mig_device(h100.uuid, H100_1G_ME, Placement(0, 1))
    with pytest.raises(PlacementUnavailableError, match=r"1g\.10gb\+me allows 1 instance"):
        node.create_mig_device(h100.uuid, H100_1G_ME, Placement(3, 1))
    node.create_mig_device(h100.uuid, H100_1G, Placement(3, 1))  # the plain 1g still fits


def test_seven_one_g_fill_a_gpu_and_an_eighth_has_no_room(node):
    h100 = _h100(node)
    for start in range(7):
        node.create_mig_device(h100.uuid, H100_1G, Placement(start, 1))
    assert len(_live(node, h100.uuid)) == 7
    with pytest.raises(PlacementUnavailableError):
        node.create_mig_device(h100.uuid, H100_1G_20GB, Placement(6, 2))  # slice 7 is free, 6 is not


def test_the_gpu_instance_limit_holds_even_where_slices_are_free():
    # On the 8-slice layouts geometry stops at 7 instances anyway; a profile that could start at
    # every slice shows the limit on its own.
    eighth = MigProfile(
        name="1g.5gb",
        profile_id=19,
        nvml_profile=0,
        compute_slices=1,
        instance_count=8,
        memory_mib=4864,
        multiprocessors=14,
        copy_engines=1,
        decoders=0,
        encoders=0,
        jpeg_engines=0,
        ofa_engines=0,
        placements=tuple(Placement(start, 1) for start in range(8)),
    )
    live = [(eighth, Placement(start, 1)) for start in range(7)]
    assert placement_refusal(eighth, Placement(7, 1), live, max_gpu_instances=7) == (
        "the GPU already holds its maximum of 7 GPU instances"
    )
    assert placement_refusal(eighth, Placement(7, 1), live, max_gpu_instances=8) is None


def test_unknown_profile_id_lists_the_profiles(node):
    with pytest.raises(PlacementUnavailableError, match=r"no MIG profile with id 42.*9 \(3g\.40gb\)"):
        node.create_mig_device(_h100(node).uuid, 42, Placement(0, 4))


def test_a_gpu_without_mig_refuses_partitions(node):
    l4 = _gpu(node, "NVIDIA L4")
    with pytest.raises(DeviceError, match=r"NVIDIA L4\) does not support MIG"):
        node.create_mig_device(l4.uuid, 19, Placement(0, 1))


def test_an_unknown_gpu_is_an_error(node):
    with pytest.raises(DeviceError, match="no GPU GPU-0000"):
        node.create_mig_device("GPU-0000", H100_1G, Placement(0, 1))


def test_ampere_without_mig_mode_needs_an_administrator(node):
    a100 = _a100(node)
    with pytest.raises(DeviceError, match=r"needs a GPU reset.*nvidia-smi -i 2 -mig 1") as refused:
        node.create_mig_device(a100.uuid, 19, Placement(0, 1))
    assert not isinstance(refused.value, (PlacementUnavailableError, DeviceInUseError))
    gpu = _now(node, a100.uuid)
    assert not gpu.mig_enabled


def test_ampere_with_mig_mode_on_creates_and_keeps_the_mode(node):
    a100 = _a100(node)
    node.admin_set_mig_mode(a100.uuid, enabled=True)
    created = node.create_mig_device(a100.uuid, 19, Placement(0, 1))
    assert created.profile == "1g.5gb"
    node.destroy_mig_device(a100.uuid, created.uuid)
    gpu = _now(node, a100.uuid)
    assert gpu.mig_enabled
    assert gpu.mig_devices == ()


def test_hopper_switches_mig_mode_off_with_its_last_mig_device(node):
    h100 = _h100(node)
    first = node.create_mig_device(h100.uuid, H100_1G, Placement(0, 1))
    second = node.create_mig_device(h100.uuid, H100_1G, Placement(1, 1))
    node.destroy_mig_device(h100.uuid, first.uuid)
    gpu = _now(node, h100.uuid)
    assert gpu.mig_enabled
    node.destroy_mig_device(h100.uuid, second.uuid)
    gpu = _now(node, h100.uuid)
    assert not gpu.mig_enabled
    assert gpu.mig_devices == ()


def test_destroying_an_unknown_mig_device_is_a_no_op(node):
    h100 = _h100(node)
    kept = node.create_mig_device(h100.uuid, H100_1G, Placement(0, 1))
    node.destroy_mig_device(h100.uuid, "MIG-does-not-exist")
    node.destroy_mig_device(h100.uuid, kept.uuid)
    node.destroy_mig_device(h100.uuid, kept.uuid)  # twice: still fine
    assert _live(node, h100.uuid) == []


def test_mig_uuids_are_never_reused(node):
    h100 = _h100(node)
    seen = set()
    for _ in range(3):
        created = node.create_mig_device(h100.uuid, H100_7G, Placement(0, 8))
        seen.add(created.uuid)
        node.destroy_mig_device(h100.uuid, created.uuid)
    assert len(seen) == 3


def test_busy_mig_devices_cannot_be_destroyed(node):
    h100 = _h100(node)
    created = node.create_mig_device(h100.uuid, H100_2G, Placement(0, 2))
    node.set_busy(created.uuid, busy=True)
    with pytest.raises(DeviceInUseError, match="processes attached"):
        node.destroy_mig_device(h100.uuid, created.uuid)
    node.set_busy(created.uuid, busy=False)
    node.destroy_mig_device(h100.uuid, created.uuid)
    assert _live(node, h100.uuid) == []


def test_a_busy_full_gpu_cannot_switch_to_mig(node):
    h100 = _h100(node)
    node.set_busy(h100.uuid, busy=True)
    with pytest.raises(DeviceInUseError, match="full GPU"):
        node.create_mig_device(h100.uuid, H100_1G, Placement(0, 1))
    node.set_busy(h100.uuid, busy=False)
    node.create_mig_device(h100.uuid, H100_1G, Placement(0, 1))


def test_marking_an_unknown_device_busy_is_an_error(node):
    with pytest.raises(DeviceError, match="no GPU or MIG device MIG-nope"):
        node.set_busy("MIG-nope", busy=True)


def test_the_full_gpu_cannot_be_used_while_in_mig_mode(node):
    h100 = _h100(node)
    node.create_mig_device(h100.uuid, H100_1G, Placement(0, 1))
    with pytest.raises(DeviceError, match="MIG mode"):
        node.set_busy(h100.uuid, busy=True)


def test_admin_creates_static_mig_by_profile_name(node):
    created = node.admin_create_mig(0, "3g.40gb", 4)
    assert (created.profile, created.placement) == ("3g.40gb", Placement(4, 4))
    with pytest.raises(PlacementUnavailableError, match=r"no MIG profile '3g\.20gb'.*1g\.10gb"):
        node.admin_create_mig(0, "3g.20gb", 0)
    with pytest.raises(DeviceError, match="does not support MIG"):
        node.admin_create_mig(4, "1g.10gb", 0)
    with pytest.raises(DeviceError, match=r"index 6.*0\.\.5"):
        node.admin_create_mig(6, "1g.10gb", 0)


def test_admin_cannot_switch_mig_off_under_live_devices(node):
    a100 = _a100(node)
    node.admin_set_mig_mode(2, enabled=True)
    node.admin_create_mig(2, "7g.40gb", 0)
    with pytest.raises(DeviceError, match="destroy them first"):
        node.admin_set_mig_mode(a100.uuid, enabled=False)


def test_state_survives_a_new_backend_object(tmp_path, boot_id, node):
    h100 = _h100(node)
    created = node.create_mig_device(h100.uuid, H100_3G, Placement(0, 4))
    node.admin_set_mig_mode(2, enabled=True)
    node.inject_xid(5, 79)
    restarted = SimulatedBackend("mixed", "node-a", tmp_path / "state", boot_id_path=boot_id)
    assert restarted.inventory() == node.inventory()
    assert _live(restarted, h100.uuid) == [(created.profile, created.placement)]
    assert restarted.faults() == node.faults()


def test_a_reboot_clears_instances_and_faults_but_ampere_keeps_mig_mode(tmp_path, boot_id, node):
    h100, a100 = _h100(node), _a100(node)
    node.create_mig_device(h100.uuid, H100_1G, Placement(0, 1))
    node.admin_set_mig_mode(a100.uuid, enabled=True)
    node.admin_create_mig(a100.uuid, "1g.5gb", 0)
    node.inject_xid(h100.uuid, 48)
    boot_id.write_text("boot-2\n")
    h100_now, a100_now = _now(node, h100.uuid), _now(node, a100.uuid)
    assert (h100_now.mig_enabled, h100_now.mig_devices) == (False, ())
    assert (a100_now.mig_enabled, a100_now.mig_devices) == (True, ())
    assert node.faults() == {}


def test_another_process_changing_the_file_is_seen_at_the_next_call(tmp_path, boot_id, node):
    cli = SimulatedBackend("mixed", "node-a", tmp_path / "state", boot_id_path=boot_id)
    cli.admin_create_mig(0, "2g.20gb", 2)
    assert _live(node, _h100(node).uuid) == [("2g.20gb", Placement(2, 2))]


def test_faults_are_recorded_and_recovered(node):
    gpus = node.inventory().gpus
    node.inject_xid(gpus[0].uuid, 48)
    node.inject_xid(0, 79)
    node.inject_xid(3, 31)
    assert node.faults() == {gpus[0].uuid: (48, 79), gpus[3].uuid: (31,)}
    node.recover(0)
    assert node.faults() == {gpus[3].uuid: (31,)}
    with pytest.raises(DeviceError, match="no GPU with index 9"):
        node.inject_xid(9, 79)


def test_a_corrupt_state_file_says_how_to_recover(tmp_path, node):
    node.inject_xid(0, 79)
    (tmp_path / "state" / "simulated-gpus.json").write_text("{not json")
    with pytest.raises(DeviceError, match="delete the file to power-cycle"):
        node.inventory()


def test_state_that_cannot_be_written_is_a_device_error_and_changes_nothing(tmp_path, boot_id):
    (tmp_path / "in-the-way").write_text("")
    blocked = SimulatedBackend("mixed", "node-a", tmp_path / "in-the-way", boot_id_path=boot_id)
    with pytest.raises(DeviceError, match=r"in-the-way is not a directory; point --data-dir"):
        blocked.inject_xid(0, 79)
    assert (tmp_path / "in-the-way").read_text() == ""


def test_state_of_another_profile_or_node_is_refused_and_kept(tmp_path, node, boot_id):
    created = node.admin_create_mig(0, "1g.10gb", 3)
    saved = (tmp_path / "state" / "simulated-gpus.json").read_text()
    for profile, node_name in (("dgx-h100", "node-a"), ("mixed", "node-b")):
        other = SimulatedBackend(profile, node_name, tmp_path / "state", boot_id_path=boot_id)
        with pytest.raises(DeviceError, match="belongs to node 'node-a' with profile 'mixed'"):
            other.inventory()
        with pytest.raises(DeviceError, match="belongs to node"):
            other.inject_xid(0, 79)
    assert (tmp_path / "state" / "simulated-gpus.json").read_text() == saved
    assert [m.uuid for m in _h100(node).mig_devices] == [created.uuid]


def test_state_written_before_owners_were_recorded_is_taken_as_ours(tmp_path, node):
    created = node.admin_create_mig(0, "1g.10gb", 3)
    path = tmp_path / "state" / "simulated-gpus.json"
    document = json.loads(path.read_text())
    del document["profile"], document["nodeName"]
    path.write_text(json.dumps(document))
    assert [m.uuid for m in _h100(node).mig_devices] == [created.uuid]


def test_the_state_file_is_plain_json(tmp_path, node):
    created = node.admin_create_mig(0, "1g.10gb", 3)
    document = json.loads((tmp_path / "state" / "simulated-gpus.json").read_text())
    assert document["version"] == 1
    devices = document["gpus"][_h100(node).uuid]["migDevices"]
    assert devices == [
        {
            "uuid": created.uuid,
            "profileId": 19,
            "start": 3,
            "gpuInstanceId": 10,
            "computeInstanceId": 0,
            "busy": False,
        }
    ]
    # no temporary file is left behind by the atomic writes
    assert sorted(p.name for p in (tmp_path / "state").iterdir()) == [
        "simulated-gpus.json",
        "simulated-gpus.json.lock",
    ]
