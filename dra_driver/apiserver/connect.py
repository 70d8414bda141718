"""Connecting to the API server: from a kubeconfig, or from the pod's service account.

Every program of the driver connects this way, and a user's mistake (a kubeconfig that is missing,
unreadable or names no server; no service account outside a pod) ends its start with one line
naming the setting. The client's machinery (:mod:`.kube`) is imported only when a connection is
made: the kubelet plugin's sockets open before it (``dra_driver.gpu_plugin.launch``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from dra_driver.errors import StartupError

if TYPE_CHECKING:
    from dra_driver.apiserver import kube

# HTTP/1.1 connections to the API server at most (the client's default is 100). A burst of 200
# prepares opened one per claim GET in flight: a TLS handshake each, on both sides of a busy
# node, and their buffers kept afterwards. A GET takes a few ms, so 16 connections carry
# thousands a second, and leave room for the long-lived watches (slices, ComputeDomains).
API_CONNECTIONS = 16


async def api_client(kubeconfig: Path | None) -> kube.ApiClient:
    """A client of the API server: from ``kubeconfig`` if one is given, else the pod's service account."""
    from dra_driver.apiserver import kube

    configuration = kube.Configuration()
    await load_configuration(kubeconfig, configuration)
    kube.resolve_environment_once(configuration)
    configuration.connection_pool_maxsize = API_CONNECTIONS
    return kube.ApiClient(configuration)


async def load_configuration(kubeconfig: Path | None, configuration: kube.Configuration) -> None:
    """Fill ``configuration`` from ``kubeconfig``, or from the pod's service account when it is None."""
    from dra_driver.apiserver import kube

    if kubeconfig is not None:
        await _load_kubeconfig(kubeconfig, configuration)
        return
    try:
        kube.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
    except kube.ConfigException as err:
        outside = "KUBERNETES_SERVICE_HOST" not in os.environ
        raise StartupError(
            "no --kubeconfig / DRA_KUBECONFIG is set and this is not a pod (KUBERNETES_SERVICE_HOST "
            "is unset): set it to a kubeconfig file, e.g. --kubeconfig ~/.kube/config"
            if outside
            else f"cannot use the pod's service account: {err}; mount its token "
            "(automountServiceAccountToken), or set --kubeconfig / DRA_KUBECONFIG"
        ) from err


async def _load_kubeconfig(path: Path, configuration: kube.Configuration) -> None:
    from dra_driver.apiserver import kube

    where = f"kubeconfig {path} (--kubeconfig / DRA_KUBECONFIG)"
    try:
        with path.open("rb"):  # the client reports a missing file as "Expected key current-context"
            pass
    except OSError as err:
        raise StartupError(f"cannot read {where}: {err.strerror}; set it to a readable kubeconfig") from err
    try:
        await kube.load_kube_config(  # type: ignore[no-untyped-call]
            config_file=str(path), client_configuration=configuration
        )
    except Exception as err:
        # The client's parser lets through whatever a malformed file causes (TypeError, yaml
        # errors, binascii.Error, ConfigException); each means the same to the user.
        raise StartupError(
            f"{where} is not a usable kubeconfig: {err}; check it with `kubectl --kubeconfig {path} version`"
        ) from err
    if not configuration.host:
        raise StartupError(f"{where} names no API server: its current context's cluster has no server")
