"""Random sequences of MIG operations against the simulator, checked against a model of the hardware.

The model is written independently of the simulator's own rules: memory slices as
sets, a count per profile and per GPU. Whatever the sequence, the simulator must
agree with it, and no two live instances may ever share a memory slice.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from dra_driver.devices.backend import PlacementUnavailableError
from dra_driver.devices.catalog import gpu_model
from dra_driver.devices.types import Placement
from dra_driver.simulated.gpus import SimulatedBackend

H100 = gpu_model("h100-sxm5-80gb")
PROFILES = {p.profile_id: p for p in H100.mig_profiles}
GPU_INDICES = (0, 1)  # two of the dgx-h100's GPUs keep the search dense

# A profile with one of its own placements most of the time, else any start and size.
REQUESTS = st.sampled_from(sorted(PROFILES)).flatmap(
    lambda profile_id: st.tuples(
        st.just(profile_id),
        st.one_of(
            st.sampled_from([(p.start, p.size) for p in PROFILES[profile_id].placements]),
            st.tuples(st.integers(min_value=0, max_value=7), st.sampled_from((1, 2, 4, 8))),
        ),
    )
)


class MigModel(RuleBasedStateMachine):
    created = Bundle("created")

    def __init__(self) -> None:
        super().__init__()
        self.directory = Path(tempfile.mkdtemp(prefix="mig-model-"))
        self.backend = SimulatedBackend("dgx-h100", "model-node", self.directory)
        gpus = self.backend.inventory().gpus
        self.gpu_uuids = [gpus[i].uuid for i in GPU_INDICES]
        # model: per GPU, mig uuid -> (profile id, first slice, slices)
        self.live: dict[str, dict[str, tuple[int, int, frozenset[int]]]] = {u: {} for u in self.gpu_uuids}

    def teardown(self) -> None:
        shutil.rmtree(self.directory)

    def _hardware_allows(self, gpu: str, profile_id: int, start: int, size: int) -> bool:
        profile = PROFILES[profile_id]
        offered = {(p.start, p.size) for p in profile.placements}
        wanted = frozenset(range(start, start + size))
        occupied = frozenset().union(*(slices for _, _, slices in self.live[gpu].values()))
        same_profile = sum(1 for pid, _, _ in self.live[gpu].values() if pid == profile_id)
        return (
            (start, size) in offered
            and not wanted & occupied
            and same_profile < profile.instance_count
            and len(self.live[gpu]) < H100.max_gpu_instances
        )

    @rule(target=created, gpu=st.sampled_from(range(len(GPU_INDICES))), request=REQUESTS)
    def create(self, gpu, request):
        profile_id, (start, size) = request
        gpu_uuid = self.gpu_uuids[gpu]
        allowed = self._hardware_allows(gpu_uuid, profile_id, start, size)
        try:
            device = self.backend.create_mig_device(gpu_uuid, profile_id, Placement(start, size))
        except PlacementUnavailableError:
            assert not allowed, f"refused a placement the hardware allows: {profile_id}@{start}+{size}"
            return (gpu_uuid, "MIG-refused")
        assert allowed, f"accepted a placement the hardware refuses: {profile_id}@{start}+{size}"
        self.live[gpu_uuid][device.uuid] = (profile_id, start, frozenset(range(start, start + size)))
        return (gpu_uuid, device.uuid)

    @rule(device=consumes(created))
    def destroy(self, device):
        gpu_uuid, mig_uuid = device
        self.backend.destroy_mig_device(gpu_uuid, mig_uuid)
        self.live[gpu_uuid].pop(mig_uuid, None)

    @invariant()
    def the_gpus_show_exactly_the_model(self):
        inventory = self.backend.inventory()
        for gpu_uuid, expected in self.live.items():
            gpu = inventory.gpu(gpu_uuid)
            assert gpu is not None
            shown = {
                d.uuid: (d.profile_id, d.placement.start, frozenset(d.placement.memory_slices))
                for d in gpu.mig_devices
            }
            assert shown == expected
            assert gpu.mig_enabled == bool(expected)  # Hopper: on with the first device, off after the last

    @invariant()
    def no_memory_slice_is_shared(self):
        for gpu in self.backend.inventory().gpus:
            slices = [s for d in gpu.mig_devices for s in d.placement.memory_slices]
            assert len(slices) == len(set(slices))
            assert len({d.gpu_instance_id for d in gpu.mig_devices}) == len(gpu.mig_devices)


MigModel.TestCase.settings = settings(max_examples=60, stateful_step_count=25, deadline=None)
TestMigModel = MigModel.TestCase
