"""Kubernetes resource quantities ("79Gi", "85520809984", "500m", "1e3"), read exactly.

What the API server writes in ResourceSlices, in claims' ``capacity.requests`` and in their
allocations' ``consumedCapacity``. The values are exact fractions, so that the step
arithmetic of a request policy and a share's limit never round where Go's ``inf.Dec`` does not.
"""

from __future__ import annotations

import re
from fractions import Fraction

_SUFFIXES: dict[str, Fraction | int] = {
    "": 1, "n": Fraction(1, 10**9), "u": Fraction(1, 10**6), "m": Fraction(1, 1000),
    "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
}  # fmt: skip
# At most three exponent digits: "1e999999999" would otherwise be a billion-digit number to build.
_QUANTITY = re.compile(
    r"([+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+))"  # the number
    r"(?:([eE][+-]?[0-9]{1,3})|(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]))?"  # a decimal exponent, or a suffix
)
_BINARY = (("Ei", 2**60), ("Pi", 2**50), ("Ti", 2**40), ("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10))


def parse_quantity(text: object) -> Fraction:
    """A Kubernetes Quantity exactly; ValueError otherwise."""
    match = _QUANTITY.fullmatch(str(text).strip())
    if match is None:
        raise ValueError(f"{text!r} is not a quantity")
    number = Fraction(match[1])
    if match[2]:
        return number * Fraction(10) ** int(match[2][1:])
    return number * _SUFFIXES[match[3] or ""]


def format_quantity(value: Fraction) -> str:
    """``value`` as Kubernetes writes it: whole binary units where exact ("79Gi", "81559Mi")."""
    if value.denominator != 1:
        return f"{float(value):.6g}"
    whole = int(value)
    for suffix, unit in _BINARY:
        if whole and whole % unit == 0:
            return f"{whole // unit}{suffix}"
    return str(whole)
