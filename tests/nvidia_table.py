"""The NVIDIA compatibility table of ``docs/nvidia-compatibility.md``, read as data.

The table is the promise NVIDIA's users read: each attribute and capacity NVIDIA's driver
publishes, its type, the devices that carry it and a selector that uses it. Reading it here
lets the unit tests check it against what ``dra_driver.resources.devices`` publishes and
the e2e tests run each selector through the real scheduler, so the table cannot drift.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

COMPATIBILITY_DOC = Path(__file__).resolve().parents[1] / "docs" / "nvidia-compatibility.md"
BEGIN = "<!-- BEGIN NVIDIA ATTRIBUTES"
END = "<!-- END NVIDIA ATTRIBUTES -->"
_CODE = re.compile(r"^`(.*)`$")


@dataclass(frozen=True)
class Row:
    name: str  # "productName", "resource.kubernetes.io/pciBusID", "memorySlice<N>"
    kind: Literal["attribute", "capacity"]
    type: Literal["string", "version", "int", "bool", "quantity"]
    devices: frozenset[str]  # of "gpu", "mig", "existing mig"
    selector: str  # CEL, written for the driver name gpu.nvidia.com

    @property
    def wire_key(self) -> str:
        """The key of the value in a ResourceSlice: "string", "version", ... or "value"."""
        return "value" if self.kind == "capacity" else self.type


def read_table(markdown: Path = COMPATIBILITY_DOC) -> list[Row]:
    """The rows between the table's markers; ValueError for a row that does not parse."""
    text = markdown.read_text()
    try:
        body = text[text.index(BEGIN) : text.index(END)]
    except ValueError:
        raise ValueError(f"{markdown}: the NVIDIA attributes table markers are missing") from None
    rows: list[Row] = []
    for line in body.splitlines()[1:]:
        if not line.startswith("| `"):
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) != 5:
            raise ValueError(f"{markdown}: a table row needs 5 cells: {line}")
        name, kind, type_, devices, selector = cells
        rows.append(
            Row(
                name=_unquote(name),
                kind=kind,  # type: ignore[arg-type]  # checked by the tests against the slices
                type=type_,  # type: ignore[arg-type]
                devices=frozenset(_devices(devices)),
                selector=_unquote(selector),
            )
        )
    return rows


def _unquote(cell: str) -> str:
    match = _CODE.match(cell)
    if match is None:
        raise ValueError(f"expected a `code` cell, got {cell!r}")
    return match[1]


def _devices(cell: str) -> list[str]:
    """ "gpu, mig (coherent-memory systems only)" -> ["gpu", "mig"]."""
    return [part.strip() for part in re.sub(r"\(.*?\)", "", cell).split(",") if part.strip()]
