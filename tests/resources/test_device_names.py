from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dra_driver.names import is_dns_label
from dra_driver.resources.device_names import (
    counter_set_name,
    gpu_device_name,
    memory_slice_counter,
    mig_device_name,
    mig_profile_label,
    require_dns_label,
)


def test_names_are_spelled_like_nvidias_driver() -> None:
    assert gpu_device_name(0) == "gpu-0"
    assert mig_device_name(0, "1g.5gb", 19, 0) == "gpu-0-mig-1g5gb-19-0"
    assert mig_device_name(3, "1g.10gb+me", 20, 6) == "gpu-3-mig-1g10gb-me-20-6"
    assert mig_device_name(1, "1g.24gb+me.all", 65, 2) == "gpu-1-mig-1g24gb-meall-65-2"
    assert counter_set_name(7) == "gpu-7-counter-set"
    assert memory_slice_counter(5) == "memory-slice-5"


def test_profiles_sharing_a_label_still_get_distinct_names_through_their_profile_id() -> None:
    assert mig_profile_label("1g.24gb+me") == mig_profile_label("1g.24gb-me") == "1g24gb-me"
    assert mig_device_name(0, "1g.24gb+me", 21, 0) != mig_device_name(0, "1g.24gb-me", 67, 0)


@pytest.mark.parametrize(
    ("name", "valid"),
    [
        ("gpu-0", True),
        ("a" * 63, True),
        ("a" * 64, False),
        ("", False),
        ("-gpu", False),
        ("gpu-", False),
        ("Gpu-0", False),
        ("gpu.0", False),
        ("gpu_0", False),
    ],
)
def test_dns_label_rules(name: str, valid: bool) -> None:
    assert is_dns_label(name) is valid


def test_an_invalid_name_is_rejected_with_what_it_names() -> None:
    with pytest.raises(ValueError, match="device name 'gpu_0' is not a valid DNS label"):
        require_dns_label("gpu_0", "device name")


# Profile names as go-nvlib prints them: "<g>g.<gb>gb" or "<c>c.<g>g.<gb>gb", then "+attr[,attr]" or "-attr".
_attribute = st.sampled_from(["me", "me.all", "gfx"])
profile_names = st.builds(
    lambda compute, gpu, gb, suffix: f"{compute}{gpu}g.{gb}gb{suffix}",
    st.sampled_from(["", "1c.", "2c.", "3c."]),
    st.integers(1, 8),
    st.integers(1, 999),
    st.one_of(
        st.just(""),
        st.lists(_attribute, min_size=1, max_size=2, unique=True).map(lambda a: "+" + ",".join(a)),
        st.just("-me"),
    ),
)


@given(
    minor=st.integers(0, 4095),
    profile=profile_names,
    profile_id=st.integers(0, 127),
    start=st.integers(0, 31),
)
def test_every_generated_name_is_a_dns_label(minor: int, profile: str, profile_id: int, start: int) -> None:
    assert is_dns_label(gpu_device_name(minor))
    assert is_dns_label(counter_set_name(minor))
    assert is_dns_label(mig_device_name(minor, profile, profile_id, start))


@given(text=st.text())
def test_a_profile_label_never_holds_a_character_a_label_cannot(text: str) -> None:
    label = mig_profile_label(text)
    assert set(label) <= set("abcdefghijklmnopqrstuvwxyz0123456789-")
    assert not label.startswith("-")
    assert not label.endswith("-")


# A node: distinct minors; per GPU, profiles with distinct names and ids, each with distinct starts.
_gpu_profiles = st.dictionaries(
    keys=profile_names,
    values=st.tuples(st.integers(0, 127), st.sets(st.integers(0, 7), min_size=1)),
    min_size=1,
    max_size=10,
).filter(lambda profiles: len({profile_id for profile_id, _ in profiles.values()}) == len(profiles))


@given(node=st.dictionaries(keys=st.integers(0, 255), values=_gpu_profiles, min_size=1, max_size=16))
def test_names_are_unique_on_a_node(node: dict[int, dict[str, tuple[int, set[int]]]]) -> None:
    names = []
    for minor, profiles in node.items():
        names.append(gpu_device_name(minor))
        names.append(counter_set_name(minor))
        for profile, (profile_id, starts) in profiles.items():
            names.extend(mig_device_name(minor, profile, profile_id, start) for start in starts)
    assert len(names) == len(set(names))
