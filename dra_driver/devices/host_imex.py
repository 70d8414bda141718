"""Whether the host's own ``nvidia-imex`` daemon is ready: the one check of the host-managed IMEX mode.

In that mode (NVIDIA's ``HostManagedIMEXDaemon``, docs/compute-domains.md) the cluster's
administrator runs ``nvidia-imex`` as a host service and the driver runs no IMEX daemon pods, so no
daemon of ours can say when IMEX is ready. Before a node hands a workload its IMEX channel, it asks
the host's daemon itself, as NVIDIA's plugin does: ``nvidia-imex-ctl -q --u=<socket>`` (query the
daemon's state once over its command socket) run inside the driver root, ready when the answer says
``READY``. The daemon answers there only when its ``/etc/nvidia-imex/config.cfg`` sets
``IMEX_CMD_ENABLED=1`` and ``IMEX_CMD_UNIX_DOMAIN_PATH`` to that socket.

On a simulated node the "host daemon" is one flag of the node's simulated state (``dra-driver
simulate host-imex --state ready|stopped``, :class:`dra_driver.simulated.gpus.SimulatedHostImex`);
its answers read like the real check's.

A check returns None when the daemon is ready, else the one-line reason; it blocks (a subprocess,
or a file read) and is called through a worker thread.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Protocol

from dra_driver.devices.driver_root import find_in

IMEX_CTL = "nvidia-imex-ctl"
DEFAULT_SOCKET = "/etc/nvidia-imex/imex_ctrl.sock"
# Where nvidia-imex-ctl is looked for under the driver root (NVIDIA's list).
IMEX_CTL_DIRS = ("opt/bin", "usr/bin", "usr/sbin", "bin", "sbin")
_TIMEOUT_S = 10.0  # a daemon that does not answer a status query within this is not ready
_OUTPUT_MAX = 300  # characters of the tool's answer quoted in a reason (it stays one line)


class HostImex(Protocol):
    def not_ready(self) -> str | None:
        """None when the host's nvidia-imex daemon is ready; else why not, in one line."""
        ...


def judge(returncode: int, output: str, socket: str) -> str | None:
    """What an ``nvidia-imex-ctl -q`` run says: None if ready, else the reason (NVIDIA's wording)."""
    answer = " ".join(output.split())[:_OUTPUT_MAX]
    if returncode != 0:
        return f"error running {IMEX_CTL} (socket {socket!r}): exit status {returncode}, output: {answer}"
    if "READY" not in output:
        return f"host nvidia-imex daemon not ready: {answer}"
    return None


class NvidiaImexCtl:
    """The real check: ``nvidia-imex-ctl -q --u=<socket>`` chrooted into the driver root."""

    def __init__(self, driver_root: Path, socket: str = DEFAULT_SOCKET) -> None:
        self.driver_root = driver_root  # as this process sees it (the chart's /driver-root)
        self.socket = socket

    def command(self, tool: str) -> list[str]:
        """The command line; inside the driver root so the tool finds the host's libraries and socket."""
        query = [f"/{tool}", "-q", f"--u={self.socket}"]
        if self.driver_root == Path("/"):
            return query
        return ["chroot", str(self.driver_root), *query]

    def not_ready(self) -> str | None:
        tool = find_in(self.driver_root, IMEX_CTL_DIRS, IMEX_CTL)
        if tool is None:
            return (
                f"{IMEX_CTL} not found under driver root {self.driver_root} (is nvidia-imex installed on "
                "this node?)"
            )
        try:
            run = subprocess.run(
                self.command(tool), capture_output=True, text=True, timeout=_TIMEOUT_S, check=False
            )
        except subprocess.TimeoutExpired:
            return f"{IMEX_CTL} (socket {self.socket!r}) did not answer within {_TIMEOUT_S:.0f}s"
        except OSError as error:
            return f"error running {IMEX_CTL} (socket {self.socket!r}): {error}"
        return judge(run.returncode, run.stdout + run.stderr, self.socket)
