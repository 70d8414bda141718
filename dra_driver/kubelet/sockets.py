"""The plugin's unix socket files: where they live, how they appear, and who removes them.

gRPC binds a unix socket at the path it is given and unlinks that path again when the
server stops, whichever file is there by then. During a rolling update without pod
UIDs in the names, the path may by then belong to the new plugin instance, and
deleting it would silently unregister that instance. So gRPC binds a private dot-file
name (the kubelet's plugin watcher ignores dot-files) and we publish it by renaming it
to the public name. The rename replaces a stale socket of ours in one step, makes the
socket appear only once it is fully set up, and leaves gRPC's unlink at shutdown
nothing to hit. We remove the public name ourselves, and only while it is still the
very file we published.
"""

from __future__ import annotations

import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

# sun_path holds 108 bytes including the terminating NUL.
MAX_SOCKET_PATH_BYTES = 107
# Only the owner may connect. The kubelet runs as root, which needs no permission bits;
# anything else that can reach these directories has no business calling the plugin.
SOCKET_MODE = 0o600
DIRECTORY_MODE = 0o750

_PRIVATE_NAME_BYTES = 3  # ".<6 hex digits>": unique enough among instances starting at once


class KubeletSocketError(RuntimeError):
    """A socket file of the plugin cannot be created where it has to be."""


@dataclass(frozen=True)
class SocketPaths:
    dra: Path  # serves the DRA plugin and health services; the kubelet learns it from GetInfo
    registration: Path  # in the kubelet's plugins_registry directory, watched by the kubelet


def socket_paths(driver_name: str, plugins_dir: Path, registry_dir: Path, pod_uid: str | None) -> SocketPaths:
    """The socket paths of one plugin instance.

    With a pod UID every instance has names of its own, so that two instances can serve
    side by side during a rolling update of the DaemonSet.
    """
    dra_name = f"dra-{pod_uid}.sock" if pod_uid else "dra.sock"
    registration_name = f"{driver_name}-{pod_uid}-reg.sock" if pod_uid else f"{driver_name}-reg.sock"
    return SocketPaths(
        dra=Path(os.path.abspath(plugins_dir)) / driver_name / dra_name,
        registration=Path(os.path.abspath(registry_dir)) / registration_name,
    )


def check_socket_path(path: Path) -> None:
    """Raise :class:`KubeletSocketError` when ``path`` is too long for a unix socket."""
    if len(os.fsencode(path)) > MAX_SOCKET_PATH_BYTES:
        raise KubeletSocketError(
            f"unix socket path {path} is {len(os.fsencode(path))} bytes, but the kernel allows at most "
            f"{MAX_SOCKET_PATH_BYTES}; use shorter kubelet directories or a shorter driver name"
        )


class PublishedSocket:
    """One socket file that this process publishes and, at the end, removes."""

    def __init__(self, path: Path) -> None:
        """Raises :class:`KubeletSocketError` when ``path`` is too long for a unix socket."""
        check_socket_path(path)
        self.path = path
        # Never longer than a public name ("dra.sock" is the shortest), so it fits wherever they do.
        self._private = path.with_name(f".{secrets.token_hex(_PRIVATE_NAME_BYTES)}")
        self._published: os.stat_result | None = None

    @property
    def bind_address(self) -> str:
        """The gRPC address to bind before :meth:`publish`."""
        return f"unix:{self._private}"

    def prepare(self) -> None:
        """Create the directory and check that the public path is free for a socket."""
        try:
            self.path.parent.mkdir(mode=DIRECTORY_MODE, parents=True, exist_ok=True)
            existing = self.path.lstat()
        except FileNotFoundError:
            return
        except OSError as exc:
            raise KubeletSocketError(f"cannot prepare socket {self.path}: {exc}") from exc
        if not stat.S_ISSOCK(existing.st_mode):
            raise KubeletSocketError(
                f"{self.path} exists and is not a socket; remove it, or point the plugin at another directory"
            )

    def publish(self) -> None:
        """Give the bound socket its permissions and its public name, replacing a stale socket there."""
        try:
            os.chmod(self._private, SOCKET_MODE)
            os.replace(self._private, self.path)
            self._published = self.path.lstat()
        except OSError as exc:
            raise KubeletSocketError(f"cannot publish socket {self.path}: {exc}") from exc

    def remove(self) -> None:
        """Remove our socket file: the public name only while it is still the file we published."""
        self._private.unlink(missing_ok=True)  # there only when publishing never happened
        published, self._published = self._published, None
        if published is None:
            return
        try:
            current = self.path.lstat()
        except FileNotFoundError:
            return
        if (current.st_dev, current.st_ino) == (published.st_dev, published.st_ino):
            self.path.unlink(missing_ok=True)
