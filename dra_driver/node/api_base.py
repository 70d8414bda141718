"""What the opaque config APIs share: strict API objects and memory quantities.

Both config APIs the driver serves (its own ``resource.dra-driver.dev`` and NVIDIA's
``resource.nvidia.com``, see :mod:`dra_driver.node.config` and
:mod:`dra_driver.node.nvidia_config`) are built from these, so they reject the same
mistakes with the same words.
"""

from __future__ import annotations

import re
from decimal import Decimal
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError
from pydantic.alias_generators import to_camel
from pydantic_core import PydanticCustomError

_MULTIPLIERS = {
    "": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
}  # fmt: skip
_QUANTITY_PATTERN = r"^([0-9]+(?:\.[0-9]+)?)(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$"


def quantity_bytes(quantity: str) -> int:
    """A memory quantity ("10Gi", "512M", "1.5Gi") as bytes; ValueError unless a whole positive number.

    The subset of Kubernetes quantities that make sense for memory: no sign, no
    exponent, no milli.
    """
    match = re.fullmatch(_QUANTITY_PATTERN, quantity)
    if match is None:
        raise ValueError(f"{quantity!r} is not a memory quantity such as 10Gi or 512M")
    value = Decimal(match[1]) * _MULTIPLIERS[match[2] or ""]
    if value <= 0 or value != value.to_integral_value():
        raise ValueError(f"{quantity!r} is not a whole, positive number of bytes")
    return int(value)


def _check_quantity(quantity: str) -> str:
    try:
        quantity_bytes(quantity)
    except ValueError as error:
        raise PydanticCustomError("memory_quantity", str(error)) from None
    return quantity


MemoryQuantity = Annotated[
    str, Field(pattern=_QUANTITY_PATTERN, examples=["10Gi", "512Mi"]), AfterValidator(_check_quantity)
]


class ApiObject(BaseModel):
    """Strict: unknown fields and values of the wrong JSON type are errors, never coerced."""

    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        frozen=True,
        alias_generator=to_camel,
        field_title_generator=lambda name, _info: to_camel(name),
    )


def describe_errors(error: ValidationError) -> str:
    """Every problem pydantic found, each as ``field.path: message``, joined by '; '."""
    return "; ".join(
        f"{'.'.join(str(part) for part in e['loc']) or '(object)'}: {e['msg']}" for e in error.errors()
    )


def only_with_strategy(*settings: tuple[str, str]) -> dict[str, Any]:
    """JSON schema saying that each ``(field, strategy)``'s field may be set (not null) only when
    ``strategy`` is the sharing strategy: the schema form of a model validator, which pydantic cannot
    derive, for a model's ``json_schema_extra``."""
    return {
        "allOf": [
            {
                "if": {"required": [field], "properties": {field: {"not": {"type": "null"}}}},
                "then": {"properties": {"strategy": {"const": strategy}}},
            }
            for field, strategy in settings
        ]
    }
