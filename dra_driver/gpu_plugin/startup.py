"""What the daemon checks before it serves: everything a user can get wrong, said in one line.

Settings whose value alone is wrong are refused by :class:`~dra_driver.settings.Settings`.
Here are the ones only the host can judge: whether a socket path fits, a directory takes
files, an address can be listened on, a listed GPU exists (a kubeconfig is checked where it is
loaded, :mod:`dra_driver.apiserver.connect`). Each raises
:class:`~dra_driver.errors.StartupError` naming the setting by flag and environment variable;
``dra_driver.cli.main`` prints it. They run before the daemon logs, opens or serves anything,
so the error is the only line a failed start leaves (the GPU check needs the GPUs read first).
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from dra_driver.devices.types import Inventory
from dra_driver.errors import StartupError
from dra_driver.kubelet.sockets import (
    DIRECTORY_MODE,
    KubeletSocketError,
    SocketPaths,
    check_socket_path,
    socket_paths,
)
from dra_driver.node.records import read_boot_id
from dra_driver.settings import MIG_PARTITION_KEYWORDS, Settings, partition_gpus

if TYPE_CHECKING:  # check_before_starting runs before the kubelet sockets open: not the status server
    from dra_driver.gpu_plugin.http import StatusServer


def check_before_starting(settings: Settings) -> None:
    """The checks that need neither the GPUs nor the event loop, cheapest first."""
    paths = check_sockets(settings)
    read_boot_id(settings.boot_id_file)  # the preparer reads it again; a missing one stops us here
    check_writable_dir(settings.state_dir, "--data-dir / DRA_DATA_DIR (default <plugins-dir>/<driver-name>)")
    check_writable_dir(settings.cdi_dir, "--cdi-dir / DRA_CDI_DIR")
    # Probe files start with a dot: the kubelet's plugin watcher ignores those.
    check_writable_dir(paths.dra.parent, "--plugins-dir / DRA_PLUGINS_DIR", mode=DIRECTORY_MODE)
    check_writable_dir(paths.registration.parent, "--registry-dir / DRA_REGISTRY_DIR", mode=DIRECTORY_MODE)


def check_sockets(settings: Settings) -> SocketPaths:
    """The plugin's socket paths; StartupError for one the kernel cannot bind."""
    paths = socket_paths(
        settings.driver_name, settings.plugins_dir, settings.registry_dir, settings.pod_uid or None
    )
    try:
        for path in dataclasses.astuple(paths):
            check_socket_path(path)
    except KubeletSocketError as err:
        raise StartupError(
            f"{err} (--plugins-dir / DRA_PLUGINS_DIR, --registry-dir / DRA_REGISTRY_DIR)"
        ) from err
    return paths


def check_writable_dir(directory: Path, setting: str, *, mode: int = 0o777) -> None:
    """Create ``directory`` (``mode`` less the umask) if needed and prove that files can be made in it."""
    try:
        directory.mkdir(mode=mode, parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".dra-driver-probe-", suffix=".tmp"):
            pass
    except OSError as err:
        # mkdir says "File exists" for a file in the way; say what is wrong with it instead.
        problem = "not a directory" if isinstance(err, FileExistsError) else err.strerror or str(err)
        raise StartupError(
            f"cannot write to {directory} ({setting}): {problem}; point the setting at a "
            "writable directory, or make this one writable for the plugin"
        ) from err


async def start_status_server(status: StatusServer, address: str) -> None:
    """Listen for probes and metrics; StartupError when this host cannot listen at ``address``."""
    try:
        await status.start()
    except OSError as err:  # socket.gaierror (an unknown host name) is one too
        await status.stop()
        raise StartupError(
            f"cannot listen on --http-address / DRA_HTTP_ADDRESS {address}: {err.strerror or err}; use an "
            "address of this host and a free port, e.g. 0.0.0.0:8080, or an empty value to disable it"
        ) from err


def check_mig_partitions(settings: Settings, inventory: Inventory) -> None:
    """Refuse a ``--mig-partitions`` list naming a GPU the node lacks: a typo would silently offer none."""
    if settings.mig_partitions in MIG_PARTITION_KEYWORDS:
        return
    known = {str(gpu.minor) for gpu in inventory.gpus} | {gpu.uuid for gpu in inventory.gpus}
    missing = [gpu for gpu in partition_gpus(settings.mig_partitions) if gpu not in known]
    if missing:
        minors = ", ".join(str(gpu.minor) for gpu in sorted(inventory.gpus, key=lambda g: g.minor))
        raise StartupError(
            f"--mig-partitions / DRA_MIG_PARTITIONS names {', '.join(missing)}, which node "
            f"{settings.node_name or '(unnamed)'} does not have; its GPUs are the minor numbers "
            f"{minors or '(none)'} or their UUIDs (`dra-driver inventory` lists them); or use all, none, "
            "mig-mode or auto"
        )
