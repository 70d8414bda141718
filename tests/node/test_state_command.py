"""``dra-driver state`` on a node's store: claims, their devices, the MIG devices the driver made,
read beside a running plugin and as JSON; a clear line when there is no store."""

from __future__ import annotations

import json
import subprocess
import sys

from .builders import DRIVER, Node, gpu_config, new_ref, opaque


def dra_driver(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dra_driver", *args], capture_output=True, text=True, timeout=60, check=False
    )


async def test_state_lists_the_claims_and_the_mig_devices_the_driver_made_while_the_plugin_runs(
    node: Node,
) -> None:
    preparer = await node.started()  # still running: its connection stays open
    work, admin, mig = new_ref("work"), new_ref("admin"), new_ref("sliced")
    node.allocate(work, "gpu-2")
    node.allocate(admin, "gpu-2", admin_access=True)
    node.allocate(mig, "gpu-0-mig-3g40gb-9-4")
    await preparer.prepare([work, admin, mig])
    mig_uuid = node.on_disk().claims[mig.uid].devices[0].mig.uuid  # type: ignore[union-attr]

    table = dra_driver("state", "--data-dir", str(node.state_dir), "--driver-name", DRIVER)
    document = json.loads(dra_driver("state", "--data-dir", str(node.state_dir), "-o", "json").stdout)

    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert any(line.startswith("default/work ") and line.endswith("gpu-2") for line in lines), table.stdout
    assert any(line.startswith("default/admin ") and "gpu-2 (admin access)" in line for line in lines)
    assert any(f"gpu-0-mig-3g40gb-9-4 (created {mig_uuid})" in line for line in lines)
    assert any(line.startswith(f"{mig_uuid} ") and " gpu-0 " in line for line in lines)
    assert {c["name"]: c["phase"] for c in document["claims"]} == {
        "work": "PrepareCompleted",
        "admin": "PrepareCompleted",
        "sliced": "PrepareCompleted",
    }
    assert [m["uuid"] for m in document["migDevices"]] == [mig_uuid]
    assert document["bootId"] == node.boot_id_path.read_text().strip()


def test_state_without_a_store_says_where_it_looked(node: Node) -> None:
    done = dra_driver("state", "--data-dir", str(node.state_dir))
    assert done.returncode != 0
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr  # one line, no traceback
    assert f"no store at {node.state_dir / 'state.db'}" in done.stderr
    assert "DRA_DATA_DIR points elsewhere" in done.stderr


async def test_state_lists_the_mps_daemons_and_the_compute_modes_to_restore_from_their_tables(
    node: Node,
) -> None:
    preparer = await node.started()
    sliced, mps = new_ref("sliced"), new_ref("mps")
    interval = {"strategy": "TimeSlicing", "timeSlicing": {"interval": "Long"}}
    node.allocate(sliced, "gpu-2", configs=[opaque(gpu_config(interval), source="FromClaim")])
    node.allocate(mps, "gpu-3", configs=[opaque(gpu_config({"strategy": "MPS"}), source="FromClaim")])
    await preparer.prepare([sliced, mps])
    daemon = node.on_disk().claims[mps.uid].sharing.mps_daemon  # type: ignore[union-attr]

    document = json.loads(dra_driver("state", "--data-dir", str(node.state_dir), "-o", "json").stdout)
    table = dra_driver("state", "--data-dir", str(node.state_dir)).stdout

    assert document["mpsDaemons"] == [{"id": daemon, "claims": [mps.uid]}]
    restores = {r["claims"][0]: (r["computeMode"], r["timeSlice"]) for r in document["computeModesToRestore"]}
    assert restores == {sliced.uid: ("Default", "Default"), mps.uid: ("Default", "Default")}
    assert document["orphanedGpuInstances"] == []
    assert any(line.startswith(f"{daemon} ") and line.endswith(mps.uid) for line in table.splitlines())
    assert "no GPU instances left by a failed rollback" in table

    await preparer.unprepare([sliced, mps])
    emptied = json.loads(dra_driver("state", "--data-dir", str(node.state_dir), "-o", "json").stdout)
    assert (emptied["mpsDaemons"], emptied["computeModesToRestore"]) == ([], [])
