"""Setting a real node up: bad input gets one clear line and leaves nothing behind, and a node that
ran leaves the host as it found it (mounts, cgroups, kernel tunables, processes)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from kubernetes import client

from e2e.cluster import ClusterInfo
from e2e.cluster.binaries import REPO_ROOT
from e2e.real_node.driver import DriverRelease
from e2e.real_node.gpu_view import container, create, gpu_claim_template, pod_manifest, view_of
from e2e.realnode import config
from e2e.realnode.images import ImageArchive
from e2e.realnode.node import RealNode, RealNodeBinaries, RealNodeError, preflight

pytestmark = pytest.mark.real_node

AS_NOBODY = ("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups")
BROKEN_DEVICE = "no-edits-at-all"
SYSCTLS = ("vm/overcommit_memory", "kernel/panic", "kernel/panic_on_oops")


def host_state() -> dict[str, object]:
    """What a node must not change on the host: mounts, its cgroups, kernel tunables."""
    cgroups = sorted(
        p.name for p in Path("/sys/fs/cgroup/memory").iterdir() if p.name.startswith("dra-real-node-")
    )
    return {
        "mounts": Path("/proc/self/mountinfo").read_text().count("\n"),
        "cgroups": cgroups,
        "sysctls": {name: Path(f"/proc/sys/{name}").read_text() for name in SYSCTLS},
    }


# Read when pytest imports this module, before any fixture starts a node.
HOST_BEFORE_ANY_NODE = host_state()


def test_a_node_needs_root_and_says_so_before_starting_anything() -> None:
    before = host_state()
    with tempfile.TemporaryDirectory() as scratch:
        Path(scratch).chmod(0o777)  # the unprivileged user may write its output there
        out = Path(scratch) / "out"
        result = subprocess.run(
            [*AS_NOBODY, sys.executable, "-m", "e2e.cluster", "up", "--node", "real",
             "--output-dir", str(out)],
            cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert result.returncode == 1
        assert result.stderr.strip() == (
            "cluster up: a real node needs root (mount namespaces, cgroups, mknod, containers); run as root"
        )
        assert not (out / "cluster" / "state.json").exists()
    assert host_state() == before


def test_a_missing_kernel_feature_is_named(tmp_path: Path) -> None:
    filesystems = tmp_path / "filesystems"
    filesystems.write_text("nodev\tsysfs\nnodev\ttmpfs\n\text4\n")
    with pytest.raises(
        RealNodeError, match=r"^the kernel has no overlayfs \(not in .*filesystems\); containerd needs it$"
    ):
        preflight(tmp_path / "node", filesystems=filesystems)

    cgroups = tmp_path / "cgroup"
    for controller in ("cpu", "cpuacct", "cpuset", "pids", "devices", "freezer"):  # no memory
        (cgroups / controller).mkdir(parents=True)
        (cgroups / controller / "cgroup.procs").write_text("")
    with pytest.raises(RealNodeError, match=r"^cgroup v1 controllers not mounted under .*cgroup: memory "):
        preflight(tmp_path / "node", cgroups=cgroups)


def test_a_node_directory_in_use_is_refused(tmp_path: Path) -> None:
    (tmp_path / "node").mkdir()
    (tmp_path / "node" / "ready").write_text("ready\n")
    with pytest.raises(RealNodeError, match=r"^the node directory .*/node is in use \(not empty\)"):
        preflight(tmp_path / "node")


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (None, r"^no driver image at .*driver\.oci\.tar; build it with `make image` \(as root\)$"),
        (
            b"half a tar",
            r"^.*driver\.oci\.tar is not an OCI image archive \(a failed build\?\); run `make image` again$",
        ),
    ],
)
def test_an_image_that_failed_to_build_is_named(tmp_path: Path, content: bytes | None, expected: str) -> None:
    archive = tmp_path / "driver.oci.tar"
    if content is not None:
        archive.write_bytes(content)
    with pytest.raises(RealNodeError, match=expected):
        ImageArchive("driver", "localhost/dra-driver-gpu", archive, "0.1.0").check()


def test_building_images_without_root_says_so() -> None:
    result = subprocess.run(
        [*AS_NOBODY, str(REPO_ROOT / "hack" / "build-image.sh"), "pause"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 1
    (last,) = result.stderr.strip().splitlines()[-1:]
    assert (
        last
        == "build-image: error: building images needs root (mmdebstrap, chroot and root-owned files); "
        + "run as root"
    )


def test_a_port_in_use_stops_the_start_with_its_reason_and_leaves_nothing(
    real_cluster: ClusterInfo, real_node_binaries: RealNodeBinaries, tmp_path: Path
) -> None:
    before = host_state()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        node = RealNode(real_cluster, real_node_binaries, tmp_path / "node", kubelet_port=port)
        with pytest.raises(
            RealNodeError, match=rf"(?s)the real node stopped while starting.*{port}.*address already in use"
        ):
            node.start(timeout_seconds=60)
    assert host_state() == before
    assert not list((tmp_path / "node").glob("root/*"))


def test_a_running_node_leaves_the_host_untouched(real_node: RealNode) -> None:
    """The kubelet runs with protectKernelDefaults and sees the values it wants only in its namespace."""
    assert real_node.state is not None
    inside = subprocess.run(
        ["nsenter", f"--target={real_node.state.holder.pid}", "--mount",
         "cat", *(f"/proc/sys/{n}" for n in SYSCTLS)],
        capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    assert inside == [config.KUBELET_SYSCTLS[n] for n in SYSCTLS]
    assert host_state()["sysctls"] == HOST_BEFORE_ANY_NODE["sysctls"]
    # None of the node's mounts (overlays, netns, its /var/lib) is visible here.
    assert str(real_node.base) not in Path("/proc/self/mountinfo").read_text()


def test_a_broken_cdi_spec_of_another_vendor_does_not_stop_the_drivers_pods(
    driver: DriverRelease, real_node: RealNode, real_api: client.ApiClient, namespace: str
) -> None:
    """containerd reads every spec in the directory when it injects devices; it refuses one with a
    device that has no edits, says so in one warning naming the file, and the driver's specs next
    to it still give the pod its GPU: containerd never reports one of the driver's specs."""
    assert real_node.layout is not None
    cdi = real_node.layout.host_path(config.CDI_DIR)
    broken = cdi / "example.com-broken.json"
    broken.write_text(
        json.dumps(
            {"cdiVersion": "0.3.0", "kind": "example.com/broken", "devices": [{"name": BROKEN_DEVICE}]}
        )
    )
    try:
        create(real_api, namespace, gpu_claim_template("one-gpu"))
        create(
            real_api,
            namespace,
            pod_manifest(
                "next-to-broken",
                {"gpu": {"resourceClaimTemplateName": "one-gpu"}},
                [container("app", ["gpu"])],
            ),
        )
        view = view_of(real_api, namespace, "next-to-broken", "app")
        assert len(view.gpu_nodes) == 1
        assert len(view.uuids) == 1
    finally:
        broken.unlink()
    refusals = [
        line
        for line in (real_node.layout.logs / "containerd.log").read_text().splitlines()
        if "CDI registry refresh failed" in line
    ]
    # containerd names the device it refused (not the file), and it is only ever this one.
    assert refusals
    assert all(line.count("failed to load CDI Spec") == 1 for line in refusals), refusals[-3:]
    assert all(
        f'failed add device \\"{BROKEN_DEVICE}\\": invalid device, empty device edits' in line
        for line in refusals
    ), refusals[-3:]


def test_cluster_up_and_down_with_a_real_node_leave_the_host_as_it_was(tmp_path: Path) -> None:
    before = host_state()
    out = tmp_path / "out"

    def cluster(*args: str) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "e2e.cluster", *args, "--output-dir", str(out)]
        return subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, check=False)

    up = cluster("up", "--node", "real")
    try:
        assert up.returncode == 0, up.stderr
        assert "node:    127.0.0.1 (kubelet + containerd" in up.stdout
        state = json.loads((out / "cluster" / "real-node.json").read_text())
        namespace = state["mount_namespace"]
        status = cluster("status")
        assert status.returncode == 0, status.stdout
    finally:
        down = cluster("down")
    assert down.returncode == 0, down.stderr
    assert host_state() == before
    assert [p.name for p in Path("/proc").iterdir() if p.name.isdigit() and _mnt_ns(p) == namespace] == []
    assert not (out / "real-node" / "root").exists()


def _mnt_ns(process: Path) -> str | None:
    try:
        return os.readlink(process / "ns" / "mnt")
    except OSError:
        return None
