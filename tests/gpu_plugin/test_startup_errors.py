"""Bad input at start-up, tried as a user would: the ``dra-driver`` entry point in a subprocess.

Every case must end with ONE line on stderr that names what is wrong and what to set, a
non-zero exit, and no traceback: on a terminal ``error: ...``, in a pod (stderr not a
terminal, the default ``auto`` log format) one JSON log event, so the log stays parseable.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

# Never contacted: every case fails before the daemon talks to the API server.
KUBECONFIG = """\
apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "https://127.0.0.1:1", insecure-skip-tls-verify: true}}]
users: [{name: u, user: {token: t}}]
contexts: [{name: c, context: {cluster: c, user: u}}]
current-context: c
"""


def dra_driver(
    *args: str, env: dict[str, str] | None = None, log_format: str | None = "console"
) -> subprocess.CompletedProcess[str]:
    """Run the console script's code with a clean environment: no DRA_* settings, not in a pod.

    ``log_format`` is DRA_LOG_FORMAT; ``None`` leaves it unset (``auto``).
    """
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("DRA_", "KUBERNETES_SERVICE"))}
    if log_format is not None:
        clean["DRA_LOG_FORMAT"] = log_format
    return subprocess.run(
        [sys.executable, "-m", "dra_driver", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**clean, **(env or {})},
    )


def one_line_error(result: subprocess.CompletedProcess[str], exit_code: int, *facts: str) -> str:
    """The single ``error:`` line of ``result``, checked to hold every one of ``facts``."""
    assert "Traceback" not in result.stderr
    assert result.returncode == exit_code, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    line = lines[0]
    assert line.startswith("error: "), line
    for fact in facts:
        assert fact in line
    return line


@dataclass
class Node:
    """A simulated node's directories and the daemon flags that point at them."""

    base: Path

    @property
    def kubeconfig(self) -> Path:
        return self.base / "kubeconfig"

    @property
    def data_dir(self) -> Path:
        return self.base / "data"

    def flags(self, *extra: str) -> list[str]:
        return [
            "--simulate=dgx-h100",
            "--node-name=n1",
            f"--data-dir={self.data_dir}",
            f"--plugins-dir={self.base / 'plugins'}",
            f"--registry-dir={self.base / 'registry'}",
            f"--cdi-dir={self.base / 'cdi'}",
            f"--kubeconfig={self.kubeconfig}",
            f"--boot-id-file={self.base / 'boot_id'}",
            "--http-address=127.0.0.1:0",
            *extra,
        ]

    def sockets(self) -> list[Path]:
        """The unix sockets under the node's directories (the daemon opens them before it reads the
        kubeconfig or binds the HTTP address, and must remove them when that fails)."""
        return [path for path in self.base.rglob("*") if path.is_socket()]

    def plugin(
        self, *extra: str, env: dict[str, str] | None = None, log_format: str | None = "console"
    ) -> subprocess.CompletedProcess[str]:
        return dra_driver("kubelet-plugin", *self.flags(*extra), env=env, log_format=log_format)


@pytest.fixture
def node() -> Iterator[Node]:
    # A short base directory: pytest's tmp_path can make socket paths too long by itself.
    base = Path(tempfile.mkdtemp(prefix="dra-start-"))
    (base / "kubeconfig").write_text(KUBECONFIG)
    (base / "boot_id").write_text("boot-1\n")
    try:
        yield Node(base)
    finally:
        shutil.rmtree(base)


# --- the kubeconfig -------------------------------------------------------------------------------


def test_a_missing_kubeconfig_names_the_file_and_the_setting(node: Node) -> None:
    result = node.plugin("--kubeconfig=/nonexistent/kubeconfig")
    one_line_error(result, 1, "/nonexistent/kubeconfig", "--kubeconfig / DRA_KUBECONFIG", "No such file")
    assert node.sockets() == []


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (None, "Is a directory"),  # the path is a directory: unreadable as a file
        ("{{{\n", "not a usable kubeconfig"),  # the YAML parser's multi-line error, in one line
        ("", "not a usable kubeconfig"),
        ("apiVersion: v1\nkind: Config\n", "not a usable kubeconfig"),  # no current-context
    ],
)
def test_an_unreadable_kubeconfig_is_one_line(node: Node, content: str | None, says: str) -> None:
    path = node.base / "bad-kubeconfig"
    if content is None:
        path.mkdir()
    else:
        path.write_text(content)
    one_line_error(node.plugin(f"--kubeconfig={path}"), 1, str(path), "DRA_KUBECONFIG", says)


def test_no_kubeconfig_outside_a_pod_says_to_set_one(node: Node) -> None:
    flags = [flag for flag in node.flags() if not flag.startswith("--kubeconfig")]
    result = dra_driver("kubelet-plugin", *flags)
    one_line_error(result, 1, "--kubeconfig / DRA_KUBECONFIG", "not a pod")


# --- the HTTP endpoint ----------------------------------------------------------------------------


@pytest.mark.parametrize("address", ["notaport", ":99999", "::1:8080", "host:port"])
def test_a_malformed_http_address_is_refused_as_a_setting(node: Node, address: str) -> None:
    flags = [flag for flag in node.flags() if not flag.startswith("--http-address")]
    result = dra_driver("kubelet-plugin", *flags, env={"DRA_HTTP_ADDRESS": address})
    one_line_error(result, 2, "--http-address / DRA_HTTP_ADDRESS", repr(address), "host:port")


def test_an_address_the_host_lacks_is_one_line(node: Node) -> None:
    # 192.0.2.0/24 is TEST-NET-1 (RFC 5737): no host has it.
    result = node.plugin("--http-address=192.0.2.1:8080")
    one_line_error(result, 1, "--http-address / DRA_HTTP_ADDRESS", "192.0.2.1:8080", "address of this host")
    # The directory checks before it made the socket directory as the sockets need it: owner only.
    assert (node.base / "plugins" / "gpu.dra-driver.dev").stat().st_mode & 0o777 == 0o750
    assert not list(node.base.rglob(".dra-driver-probe-*"))  # no probe file left behind


def test_a_port_in_use_is_one_line(node: Node) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        result = node.plugin(f"--http-address={address}")
    one_line_error(result, 1, "DRA_HTTP_ADDRESS", address, "in use")
    assert node.sockets() == []


# --- sockets and directories ----------------------------------------------------------------------


def test_a_socket_path_over_107_bytes_is_one_line(node: Node) -> None:
    long_dir = node.base / ("p" * 100)
    result = node.plugin(f"--plugins-dir={long_dir}")
    one_line_error(result, 1, "107", str(long_dir), "--plugins-dir / DRA_PLUGINS_DIR")
    assert not long_dir.exists()  # refused before anything was created


@pytest.mark.parametrize(("below", "says"), [("", "not a directory"), ("sub", "Not a directory")])
def test_an_unwritable_data_dir_is_one_line(node: Node, below: str, says: str) -> None:
    in_the_way = node.base / "a-file"
    in_the_way.write_text("not a directory\n")
    data_dir = in_the_way / below if below else in_the_way
    result = node.plugin(f"--data-dir={data_dir}")
    one_line_error(result, 1, str(data_dir), "--data-dir / DRA_DATA_DIR", says)


@pytest.mark.parametrize("flag", ["--cdi-dir", "--plugins-dir", "--registry-dir"])
def test_other_unwritable_directories_are_one_line(node: Node, flag: str) -> None:
    in_the_way = node.base / "a-file"
    in_the_way.write_text("")
    result = node.plugin(f"{flag}={in_the_way}")
    env = "DRA_" + flag[2:].upper().replace("-", "_")
    one_line_error(result, 1, str(in_the_way), f"{flag} / {env}")


# --- values that used to be accepted silently -----------------------------------------------------


def test_mig_partitions_that_name_nothing_are_refused(node: Node) -> None:
    one_line_error(node.plugin("--mig-partitions=bogus"), 2, "--mig-partitions / DRA_MIG_PARTITIONS", "bogus")


def test_mig_partitions_naming_a_gpu_the_node_lacks_are_refused(node: Node) -> None:
    result = node.plugin("--mig-partitions=0,99")
    line = one_line_error(result, 1, "--mig-partitions / DRA_MIG_PARTITIONS", "99", "0, 1, 2, 3, 4, 5, 6, 7")
    assert "names 99," in line  # only the missing GPU is blamed


def test_inventory_refuses_the_same_mig_partitions() -> None:
    result = dra_driver("inventory", "--simulate=l4x4", "--mig-partitions=7")
    one_line_error(result, 1, "DRA_MIG_PARTITIONS", "names 7")
    assert result.stdout == ""


def test_a_node_name_that_is_no_dns_subdomain_is_refused(node: Node) -> None:
    result = node.plugin("--node-name=N1_bad!")
    one_line_error(result, 2, "--node-name / DRA_NODE_NAME", "'N1_bad!'", "DNS subdomain")


def test_a_relative_driver_root_is_refused(node: Node) -> None:
    result = node.plugin(env={"DRA_DRIVER_ROOT": "run/nvidia/driver"})
    one_line_error(result, 2, "--driver-root / DRA_DRIVER_ROOT", "'run/nvidia/driver'", "absolute")


def test_simulate_refuses_a_negative_xid(node: Node) -> None:
    result = dra_driver("simulate", "xid", "--xid=-5", "--gpu=0", *node.flags()[:3])
    one_line_error(result, 2, "--xid", "-5", "positive")
    assert not (node.data_dir / "simulated-gpus.json").exists()


def test_simulated_state_of_another_profile_is_refused(node: Node) -> None:
    made = dra_driver(
        "simulate", "create-mig", "--gpu=0", "--profile=1g.10gb", "--start=0", *node.flags()[:3]
    )
    assert made.returncode == 0, made.stderr
    result = node.plugin("--simulate=dgx-a100-80gb")
    one_line_error(result, 1, "dgx-h100", "dgx-a100-80gb", str(node.data_dir), "delete the file")
    # The other profile's MIG device is still there for its own node.
    listing = dra_driver("inventory", *node.flags()[:3])
    assert listing.returncode == 0, listing.stderr
    assert "1g.10gb@0" in listing.stdout


def test_simulated_state_of_another_node_is_refused(node: Node) -> None:
    common = ["--simulate=dgx-h100", f"--data-dir={node.data_dir}"]
    assert dra_driver("simulate", "xid", "--xid=79", "--gpu=1", "--node-name=n1", *common).returncode == 0
    result = dra_driver("inventory", *common)  # forgot --node-name: the default node-1 is not n1
    one_line_error(result, 1, "'n1'", "'node-1'", "--node-name")


# --- what the sweep over every flag and env var found ----------------------------------------------


@pytest.mark.parametrize(("content", "says"), [(None, "No such file"), (b"\xff\xfe", "not text")])
def test_a_boot_id_file_that_cannot_be_read_stops_it_first(
    node: Node, content: bytes | None, says: str
) -> None:
    boot_id = node.base / "boot_id"
    boot_id.unlink()
    if content is not None:
        boot_id.write_bytes(content)
    one_line_error(node.plugin(), 1, str(boot_id), "--boot-id-file / DRA_BOOT_ID_FILE", says)


def test_a_checkpoint_of_a_newer_driver_is_one_line_and_kept(node: Node) -> None:
    node.data_dir.mkdir()
    newer = json.dumps({"schemaVersion": 99, "checksum": "sha256:x", "payload": {}})
    (node.data_dir / "checkpoint.json").write_text(newer)
    result = node.plugin()
    # It is found once the daemon runs, after its first log lines: the error is the last line.
    assert "Traceback" not in result.stderr
    assert result.returncode == 1, result.stderr
    last = result.stderr.splitlines()[-1]
    assert last.startswith("error: ")
    assert "newer version of the driver" in last
    assert (node.data_dir / "checkpoint.json").read_text() == newer


def test_a_pod_uid_that_could_leave_the_socket_directory_is_refused(node: Node) -> None:
    result = node.plugin("--pod-uid=../../etc/x")
    one_line_error(result, 2, "--pod-uid / DRA_POD_UID", "'../../etc/x'")
    assert not (node.base / "etc").exists()


def test_an_unknown_flag_is_one_line_naming_the_help() -> None:
    result = dra_driver("kubelet-plugin", "--no-such-flag=1")
    one_line_error(result, 2, "unrecognized arguments: --no-such-flag=1", "dra-driver --help")


def test_simulate_with_a_file_for_its_data_dir_says_so(node: Node) -> None:
    in_the_way = node.base / "a-file"
    in_the_way.write_text("")
    result = dra_driver(
        "simulate",
        "xid",
        "--xid=79",
        "--gpu=0",
        "--simulate=l4x4",
        "--node-name=n1",
        f"--data-dir={in_the_way}",
    )
    one_line_error(result, 1, f"{in_the_way} is not a directory", "--data-dir / DRA_DATA_DIR")


def test_simulate_busy_of_a_gpu_the_node_lacks_says_so(node: Node) -> None:
    result = dra_driver("simulate", "busy", "--gpu=99", *node.flags()[:3])
    one_line_error(result, 1, "no GPU with index 99", "0..7")


def test_every_bad_setting_is_named_in_one_line(node: Node) -> None:
    result = node.plugin("--health-poll-seconds=nan", env={"DRA_INVENTORY_REFRESH_SECONDS": "soon"})
    one_line_error(result, 2, "DRA_HEALTH_POLL_SECONDS", "DRA_INVENTORY_REFRESH_SECONDS", "'soon'")


def test_a_misspelt_env_var_is_warned_about(node: Node) -> None:
    # DRA_MIG_PARTITION (no S) would silently leave MIG partitions on every GPU.
    result = node.plugin("--http-address=192.0.2.1:8080", env={"DRA_MIG_PARTITION": "0"})
    warning, error = result.stderr.splitlines()
    assert "DRA_MIG_PARTITION" in warning
    assert "names no setting" in warning
    assert error.startswith("error: cannot listen")


# --- in a pod -------------------------------------------------------------------------------------


def json_error(result: subprocess.CompletedProcess[str], exit_code: int) -> dict[str, object]:
    assert "Traceback" not in result.stderr
    assert result.returncode == exit_code, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    event: dict[str, object] = json.loads(lines[0])
    assert event["level"] == "error"
    assert event["event"] == "exiting"
    assert event["exit_code"] == exit_code
    assert "timestamp" in event
    return event


def test_in_a_pod_a_bad_setting_is_one_json_log_event(node: Node) -> None:
    # stderr is a pipe, as in a pod: the default log format "auto" writes JSON.
    result = node.plugin("--node-name=N1_bad!", log_format=None)
    event = json_error(result, 2)
    assert "--node-name / DRA_NODE_NAME" in str(event["error"])


def test_in_a_pod_a_start_up_failure_is_one_json_log_event(node: Node) -> None:
    bad = node.base / "bad-kubeconfig"
    bad.write_text("{{{\n")
    result = node.plugin(f"--kubeconfig={bad}", "--log-format=json", log_format=None)
    event = json_error(result, 1)
    assert "not a usable kubeconfig" in str(event["error"])


# --- NVML -----------------------------------------------------------------------------------------


def _without_nvml_on_the_library_path() -> dict[str, str]:
    return {"LD_LIBRARY_PATH": "", "MOCK_NVML_MACHINE": ""}


def test_a_driver_root_without_nvml_stops_the_plugin_in_one_line_naming_it(node: Node) -> None:
    empty = node.base / "driver-root"
    empty.mkdir()
    flags = [flag for flag in node.flags(f"--driver-root={empty}") if not flag.startswith("--simulate")]
    result = dra_driver("kubelet-plugin", *flags, env=_without_nvml_on_the_library_path())
    one_line_error(result, 1, "libnvidia-ml.so.1", f"driver root {empty}", "--driver-root / DRA_DRIVER_ROOT")


def test_inventory_reads_nvml_from_the_driver_root_and_says_when_it_is_not_there(tmp_path: Path) -> None:
    env = {**_without_nvml_on_the_library_path(), "DRA_DRIVER_ROOT": str(tmp_path)}
    result = dra_driver("inventory", env=env)
    one_line_error(
        result, 1, "libnvidia-ml.so.1", f"driver root {tmp_path}", "--driver-root / DRA_DRIVER_ROOT"
    )


def test_the_webhooks_kubeconfig_is_checked_like_the_plugins(tmp_path: Path) -> None:
    """`dra-driver webhook --kubeconfig` reads the driver's slices: a missing file is one line."""
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    subprocess.run(
        [
            *("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=x"),
            *("-keyout", str(key), "-out", str(cert)),
        ],
        check=True,
        capture_output=True,
    )
    tls = [f"--tls-cert-file={cert}", f"--tls-key-file={key}", "--webhook-address=127.0.0.1:0"]
    result = dra_driver("webhook", *tls, "--kubeconfig=/nonexistent/kubeconfig")
    one_line_error(result, 1, "/nonexistent/kubeconfig", "--kubeconfig / DRA_KUBECONFIG", "No such file")
