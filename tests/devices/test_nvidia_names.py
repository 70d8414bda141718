"""NVIDIA's naming rules, checked against every profile of the shipped catalog and the notes' examples."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dra_driver.devices.catalog import load_catalog
from dra_driver.devices.nvidia_names import (
    architecture_name,
    brand_name,
    mig_memory_size_gb,
    mig_profile_name,
    normalize_pci_bus_id,
    split_pci_device_id,
)

MIB = 2**20

CATALOG_PROFILES = [
    pytest.param(model, profile, id=f"{model.key}:{profile.name}")
    for model in load_catalog().values()
    for profile in model.mig_profiles
]


@pytest.mark.parametrize(("model", "profile"), CATALOG_PROFILES)
def test_formula_reproduces_every_catalog_profile_name(model, profile):
    assert mig_profile_name(profile.nvml_profile, profile.memory_mib, model.memory_bytes) == profile.name


def test_catalog_has_profiles_to_check():
    assert len(CATALOG_PROFILES) == 7 * 7  # A100 40/80, H100, H100 NVL, H200, B200, GB200


@pytest.mark.parametrize(
    ("total_mib", "profile_mib", "gb"),
    [
        (40960, 4864, 5),  # A100-40GB 1g: 0.11875 of the GPU -> one eighth of 40 GiB
        (143771, 16384, 18),  # H200 1g: 16 GiB, named after 1/8 of 141 GiB = 17.625
        (143771, 71168, 71),  # H200 3g: 0.5 x 141 = 70.5, ties round away from zero
        (95830, 22144, 24),  # H100 NVL 1g.24gb: 0.25 x 94 = 23.5
        (183359, 22528, 23),  # B200 1g: 0.125 x 180 = 22.5
        (189471, 46592, 47),  # GB200 1g.47gb: 0.25 x 186 = 46.5
    ],
)
def test_memory_in_the_name_follows_the_notes_examples(total_mib, profile_mib, gb):
    assert mig_memory_size_gb(total_mib * MIB, profile_mib) == gb


@given(
    total_mib=st.integers(min_value=8 * 1024, max_value=256 * 1024),
    eighths=st.integers(min_value=1, max_value=8),
    data=st.data(),
)
def test_any_size_in_a_band_of_eighths_names_that_many_eighths(total_mib, eighths, data):
    # go-nvlib's TestGetMigMemorySizeGB: sizes in ((k-1)/8, k/8] of the total map to k/8 of the total GiB.
    low = (eighths - 1) * total_mib // 8 + 1
    high = eighths * total_mib // 8
    size = data.draw(st.integers(min_value=low, max_value=high))
    total_gb = -(-total_mib // 1024)
    expected = int(eighths * total_gb / 8 + 0.5)
    assert mig_memory_size_gb(total_mib * MIB, size) == expected


@pytest.mark.parametrize(
    ("constant", "name"),
    [
        (0x0, "1g.24gb"),
        (0x7, "1g.24gb+me"),
        (0x9, "1g.24gb"),  # REV2: twice the memory, no suffix
        (0xD, "1g.24gb-me"),
        (0xF, "1g.24gb+me.all"),
        (0xA, "1g.24gb+gfx"),
    ],
)
def test_suffixes_follow_the_gpu_instance_constant(constant, name):
    # an RTX PRO 6000-like part: 96 GiB, a quarter of it per 1-slice profile
    assert mig_profile_name(constant, 24 * 1024, 96 * 1024 * MIB) == name


def test_gpu_slices_follow_the_constant_not_the_memory():
    assert mig_profile_name(0x3, 40448, 81559 * MIB) == "4g.40gb"
    assert mig_profile_name(0x2, 40448, 81559 * MIB) == "3g.40gb"


def test_unknown_profile_constant_is_refused():
    with pytest.raises(ValueError, match="0x12"):
        mig_profile_name(0x12, 4864, 40960 * MIB)


def test_nvml_bus_ids_become_kubernetes_bus_ids():
    assert normalize_pci_bus_id("00000000:3B:00.0") == "0000:3b:00.0"
    assert normalize_pci_bus_id("0000:3b:00.0") == "0000:3b:00.0"
    assert normalize_pci_bus_id("00010000:C1:00.0") == "00010000:c1:00.0"  # a non-zero domain stays whole


def test_pci_device_id_is_split_into_device_and_vendor():
    assert split_pci_device_id(0x233010DE) == (0x2330, 0x10DE)


def test_brand_and_architecture_strings_are_those_nvidia_publishes():
    assert brand_name(14) == "Nvidia"
    assert brand_name(2) == "Tesla"
    assert brand_name(99) == "Unknown"
    assert architecture_name(7) == "Ampere"
    assert architecture_name(8) == "Ada Lovelace"
    assert architecture_name(10) == "Blackwell"
