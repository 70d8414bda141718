"""Parsing the shipped GPU catalog into typed models, and refusing inconsistent data."""

from __future__ import annotations

from importlib import resources

import pytest

from dra_driver.devices.catalog import CatalogError, gpu_model, load_catalog, parse_catalog
from dra_driver.devices.types import Placement


def _shipped_text() -> str:
    return resources.files("dra_driver.devices").joinpath("data/gpu-catalog.yaml").read_text()


def test_h100_is_described_as_nvml_would():
    h100 = gpu_model("h100-sxm5-80gb")
    assert h100.product_name == "NVIDIA H100 80GB HBM3"
    assert (h100.brand, h100.architecture) == ("Nvidia", "Hopper")
    assert h100.cuda_compute_capability == (9, 0)
    assert h100.memory_bytes == 81559 * 2**20
    assert h100.multiprocessors == 132
    assert (h100.pci_device_id, h100.pci_vendor_id) == (0x2330, 0x10DE)
    assert h100.mig_capable
    assert not h100.mig_mode_change_requires_reset
    assert (h100.memory_slices, h100.max_gpu_instances) == (8, 7)


def test_mig_profiles_carry_ids_counts_engines_and_placements():
    h100 = gpu_model("h100-sxm5-80gb")
    three_g = h100.profile_by_id(9)
    assert three_g is not None
    assert three_g.name == "3g.40gb"
    assert (three_g.compute_slices, three_g.instance_count, three_g.memory_mib) == (3, 2, 40448)
    assert (three_g.multiprocessors, three_g.copy_engines, three_g.decoders) == (60, 3, 3)
    assert three_g.placements == (Placement(0, 4), Placement(4, 4))
    me = h100.profile_by_id(20)
    assert me is not None
    assert (me.name, me.instance_count, me.ofa_engines) == ("1g.10gb+me", 1, 1)


def test_ampere_needs_a_reset_for_mig_mode():
    assert gpu_model("a100-sxm4-40gb").mig_mode_change_requires_reset
    assert gpu_model("a100-sxm4-80gb").mig_mode_change_requires_reset


def test_gpus_without_mig_have_no_profiles():
    l4 = gpu_model("l4")
    assert not l4.mig_capable
    assert (l4.mig_profiles, l4.memory_slices) == ((), 0)
    assert l4.architecture == "Ada Lovelace"


def test_blackwell_models_offer_the_complete_profile_set():
    # 3g/4g/7g are filled in (marked in the data file) so a simulated B200 can do what a real one does
    for key in ("b200-180gb", "gb200"):
        model = gpu_model(key)
        assert sorted(p.compute_slices for p in model.mig_profiles) == [1, 1, 1, 2, 3, 4, 7]
        assert all(p.memory_mib > 0 and p.multiprocessors > 0 for p in model.mig_profiles)
        seven = next(p for p in model.mig_profiles if p.compute_slices == 7)
        assert seven.memory_mib <= model.memory_mib
        assert seven.multiprocessors <= model.multiprocessors


def test_every_placement_lies_within_the_memory_slices():
    for model in load_catalog().values():
        for profile in model.mig_profiles:
            assert all(p.start >= 0 and p.start + p.size <= model.memory_slices for p in profile.placements)


def test_unknown_model_lists_the_known_ones():
    with pytest.raises(KeyError, match="h100-sxm5-80gb"):
        gpu_model("h100-pcie")


def test_a_profile_name_that_contradicts_the_formula_is_refused():
    text = _shipped_text().replace(
        'name: "3g.40gb",    nvmlProfile: 0x2', 'name: "3g.39gb",    nvmlProfile: 0x2', 1
    )
    with pytest.raises(CatalogError, match=r"3g\.39gb.*'3g\.40gb'"):
        parse_catalog(text)


def test_unknown_fields_are_refused():
    text = _shipped_text().replace("    migCapable: false\n", "    migCapable: false\n    tdpWatts: 72\n", 1)
    with pytest.raises(CatalogError, match="tdpWatts"):
        parse_catalog(text)


def test_a_placement_beyond_the_last_memory_slice_is_refused():
    text = _shipped_text().replace(
        "placements: {size: 8, starts: [0]}", "placements: {size: 8, starts: [1]}", 1
    )
    with pytest.raises(CatalogError, match="outside memory slices"):
        parse_catalog(text)


def test_an_unpublished_brand_string_is_refused():
    text = _shipped_text().replace("brand: Nvidia", "brand: NVIDIA", 1)
    with pytest.raises(CatalogError, match="brand 'NVIDIA'"):
        parse_catalog(text)
