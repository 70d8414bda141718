"""docs/kubernetes-versions.md against the release under test: the feature-gate table says what
this release's kube-apiserver --help says of each gate (run against every release by
hack/e2e-versions.sh --subset, so every column is checked)."""

from __future__ import annotations

import re
import subprocess

import pytest

from e2e.cluster import ControlPlaneBinaries
from e2e.cluster.binaries import REPO_ROOT
from e2e.cluster.features import kube_minor

pytestmark = [pytest.mark.cluster, pytest.mark.kube_versions]

DOC = REPO_ROOT / "docs" / "kubernetes-versions.md"
_TABLE = re.compile(r"<!-- feature gates: .*? -->\n(.*?)<!-- end of feature gates -->", re.S)
# "kube:DRAPartitionableDevices=true|false (BETA - default=true)"
_GATE_HELP = re.compile(r"\b([A-Z][A-Za-z0-9]+)=true\|false \((ALPHA|BETA) - default=(true|false)\)")


def documented_states(minor: int) -> dict[str, str]:
    """Gate -> the table's cell for release 1.<minor> ("alpha, off", "beta, on", "GA", ...)."""
    match = _TABLE.search(DOC.read_text())
    assert match, f"{DOC.name} has no feature-gate table between its markers"
    header, _rule, *rows = [
        [cell.strip() for cell in line.strip().strip("|").split("|")]
        for line in match[1].strip().splitlines()
    ]
    column = header.index(f"v1.{minor}")
    return {row[1].strip("`"): row[column] for row in rows}


def states_in_help(help_text: str) -> dict[str, str]:
    return {
        gate: f"{stage.lower()}, {'on' if default == 'true' else 'off'}"
        for gate, stage, default in _GATE_HELP.findall(help_text)
    }


def test_the_feature_gate_table_matches_this_release(control_plane_binaries: ControlPlaneBinaries) -> None:
    help_text = subprocess.run(
        [str(control_plane_binaries.kube_apiserver), "--help"], capture_output=True, text=True, check=False
    ).stdout
    settable = states_in_help(help_text)
    assert "DRAPartitionableDevices" in settable or "DRAConsumableCapacity" in settable, "help not parsed"

    documented = documented_states(kube_minor(control_plane_binaries.kube_version))

    # A gate the binary no longer lets anyone set is GA (locked on); the driver needs no removed gate.
    # "in `X`": the release has no such gate yet, and gate X covers the feature.
    actual = {
        gate: settable.get(gate, "GA") if not cell.startswith("in `") else f"in `{cell[4:-1]}`"
        for gate, cell in documented.items()
    }
    assert actual == documented
    for gate, cell in documented.items():
        if cell.startswith("in `"):
            assert gate not in settable, f"{gate} exists in this release: document its state"
            assert cell[4:-1] in settable, f"{cell[4:-1]} is not a gate of this release"
