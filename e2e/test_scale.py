"""``make scale`` itself, on three nodes: it runs every phase and its report says what a script reads.

The 100-node run takes minutes of two cores (docs/scale.md); three nodes go through the same
phases -- publish, steady state, pods placed by the real scheduler, the rolling restart with pods
replaced meanwhile -- on a control plane of their own, so that the bench keeps working and the
driver keeps its steady-state and rolling-restart promises at every commit.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

NODES = 3


def test_make_scale_on_three_nodes_publishes_places_and_rolls_with_no_failed_prepare(tmp_path: Path) -> None:
    report = tmp_path / "scale.json"
    options = [f"--nodes={NODES}", "--steady-seconds=15", "--parallel=3", f"--output={report}"]
    run = subprocess.run(
        [sys.executable, "-m", "bench.scale", *options],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    figures = json.loads(report.read_text())

    assert figures["complete"] is True
    assert figures["nodes"] == NODES
    assert figures["slices_valid"] is True
    assert figures["publish_all_s"] > 0
    # In steady state the driver holds its watch and sends nothing (the kubelet's heartbeats are not its).
    assert figures["steady_requests_per_node_per_min"] == 0
    assert figures["pods"]["running"] == figures["pods"]["pods"] == NODES * 8
    assert figures["pods_placed_and_prepared_s"] > 0
    assert figures["rolling_restart"]["restarted"] == NODES
    assert figures["rolling_restart"]["pods_replaced_meanwhile"] > 0
    assert figures["rolling_restart_failed_prepares"] == 0
    assert 20 < figures["rss_mib_per_node"] < 500
