"""MPS control daemons as Deployments: how a real node runs them, as NVIDIA's driver does.

One Deployment per daemon, ``mps-control-daemon-<id>`` in the plugin's namespace, with one
privileged pod pinned to the node (``nodeName``, ``hostPID``) that runs
``nvidia-cuda-mps-control -d`` from the host's driver root (``chroot`` into it, as NVIDIA's
template does, so the daemon uses the driver's own libraries), gives it its default client limits
through ``nvidia-cuda-mps-control``, and writes ``startup.log`` once done: the pod's startup probe
reads that file, so the Deployment's ``readyReplicas`` says when the daemon serves clients.

Differences from NVIDIA's template, each for a reason:

* the Deployment is owned by the Node object (a cluster-scoped owner of a namespaced object is
  allowed): deleting the node deletes its daemons, and a rolling update of the plugin, which
  replaces the plugin's pod, does not;
* it carries labels naming the node and the claim (``resource.dra-driver.dev/mps-node``,
  ``.../mps-claim-uid``), so the plugin finds its own daemons (:meth:`running`) and an
  administrator sees which claim a daemon serves;
* its pod mounts no service account token (``automountServiceAccountToken: false``): the daemon
  never talks to the API server, and the chart's admission policy (``templates/
  admission-policy-mps.yaml``) admits from the plugin's account only a Deployment of exactly this
  shape, bound to the plugin's own node;
* a failed daemon is reported, not waited for: a container that terminated, restarts, or cannot
  pull its image fails the prepare with the pod's own reason.

The plugin mounts a tmpfs on the daemon's shm directory (``--mps-shm-size``, by default half the
node's memory, NVIDIA's size) before it creates the Deployment, and unmounts it when it stops the
daemon. The directory is under the plugin's own host directory, which the chart mounts with
``mountPropagation: Bidirectional`` (as NVIDIA mounts its plugin directory): only then does the
tmpfs reach the host, where the daemon's pod and the clients' CDI mounts bind it. Without it they
would bind the directory beneath, the kubelet's disk, unbounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import subprocess
import time
from pathlib import Path

import structlog

from dra_driver.apiserver.rest import ApiError, Json, JsonApi
from dra_driver.node.sharing.mps import (
    DEFAULT_READY_TIMEOUT_S,
    LOG_DIR,
    PIPE_DIR,
    READY_FILE,
    SHM_DIR,
    MpsDaemonError,
    MpsDaemonSpec,
    MpsPaths,
    control_commands,
)

log = structlog.get_logger(__name__)

NAME_PREFIX = "mps-control-daemon-"
NODE_LABEL = "resource.dra-driver.dev/mps-node"
CLAIM_LABEL = "resource.dra-driver.dev/mps-claim-uid"
DAEMON_LABEL = "resource.dra-driver.dev/mps-daemon"
DRIVER_ROOT_MOUNT = "/driver-root"
_POLL_S = 1.0
_FAILED_REASONS = {
    "CrashLoopBackOff",
    "ErrImagePull",
    "ImagePullBackOff",
    "InvalidImageName",
    "CreateContainerError",
}


def deployment_name(daemon_id: str) -> str:
    return f"{NAME_PREFIX}{daemon_id}"


def daemon_script(spec: MpsDaemonSpec) -> str:
    """The daemon container's shell script: start the daemon, set its limits, say it is ready."""
    run = "chroot /driver-root sh -c"
    lines = [
        "set -e",
        f"rm -f {DRIVER_ROOT_MOUNT}{LOG_DIR}/{READY_FILE}",
        f'{run} "nvidia-cuda-mps-control -d"',
        *(f'{run} "echo {command} | nvidia-cuda-mps-control"' for command in control_commands(spec)),
        f'echo "startup complete" > {DRIVER_ROOT_MOUNT}{LOG_DIR}/{READY_FILE}',
        f"tail -n +1 -f {DRIVER_ROOT_MOUNT}{LOG_DIR}/control.log",
    ]
    return "\n".join(lines)


def deployment_manifest(
    spec: MpsDaemonSpec,
    paths: MpsPaths,
    *,
    namespace: str,
    node_name: str,
    node_uid: str,
    image: str,
    driver_root: str,
) -> Json:
    """The Deployment that runs daemon ``spec`` on node ``node_name`` (see the module doc)."""
    name = deployment_name(spec.id)
    labels = {DAEMON_LABEL: spec.id[:63].rstrip("-_."), NODE_LABEL: node_name, CLAIM_LABEL: spec.claim_uid}
    host_dirs = {"mps-pipe": paths.pipe, "mps-log": paths.log, "mps-shm": paths.shm}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": labels,
            "annotations": {"resource.dra-driver.dev/mps-claim": spec.claim},
            "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": node_name, "uid": node_uid}],
        },
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {DAEMON_LABEL: labels[DAEMON_LABEL]}},
            "strategy": {"type": "Recreate"},  # never two servers on one GPU
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "nodeName": node_name,
                    # The daemon talks to no API server: it gets no token (the chart's admission
                    # policy refuses a daemon pod that would).
                    "automountServiceAccountToken": False,
                    "hostPID": True,
                    "priorityClassName": "system-node-critical",
                    "tolerations": [{"operator": "Exists"}],  # it serves pods already on the node
                    "containers": [
                        {
                            "name": "mps-control-daemon",
                            "image": image,
                            "securityContext": {"privileged": True},
                            "command": ["sh", "-c"],
                            "args": [daemon_script(spec)],
                            "env": [{"name": "CUDA_VISIBLE_DEVICES", "value": spec.visible_devices}],
                            "startupProbe": {
                                "exec": {"command": ["cat", f"{DRIVER_ROOT_MOUNT}{LOG_DIR}/{READY_FILE}"]},
                                "initialDelaySeconds": 1,
                                "periodSeconds": 1,
                                "failureThreshold": 60,
                            },
                            "volumeMounts": [
                                {"name": "driver-root", "mountPath": DRIVER_ROOT_MOUNT},
                                {"name": "mps-pipe", "mountPath": f"{DRIVER_ROOT_MOUNT}{PIPE_DIR}"},
                                {"name": "mps-log", "mountPath": f"{DRIVER_ROOT_MOUNT}{LOG_DIR}"},
                                {"name": "mps-shm", "mountPath": f"{DRIVER_ROOT_MOUNT}{SHM_DIR}"},
                            ],
                        }
                    ],
                    "volumes": [
                        {"name": "driver-root", "hostPath": {"path": driver_root, "type": "Directory"}},
                        *(
                            {"name": volume, "hostPath": {"path": str(path), "type": "Directory"}}
                            for volume, path in host_dirs.items()
                        ),
                    ],
                },
            },
        },
    }


class DeploymentMpsDaemons:
    """Daemons as Deployments in ``namespace`` for node ``node_name``; directories under ``root``.

    ``root`` must be the same path on the host and in the plugin (a hostPath mounted at its own
    path), because both the CDI spec and the Deployment name host paths. ``mount_shm`` mounts a
    tmpfs on each daemon's shm directory (needs a privileged plugin).
    """

    def __init__(
        self,
        api: JsonApi,
        *,
        namespace: str,
        node_name: str,
        image: str,
        driver_root: str,
        root: Path,
        mount_shm: bool = True,
        shm_size_bytes: int | None = None,
    ) -> None:
        self._api = api
        self._namespace = namespace
        self._node = node_name
        self._image = image
        self._driver_root = driver_root
        self._root = root
        self._mount_shm = mount_shm
        self._shm_size = f"{shm_size_bytes // 1024}k" if shm_size_bytes else _half_the_memory()
        self._node_uid: str | None = None

    def paths(self, daemon_id: str) -> MpsPaths:
        return MpsPaths(self._root / daemon_id)

    def _path(self, daemon_id: str = "") -> str:
        base = f"/apis/apps/v1/namespaces/{self._namespace}/deployments"
        return f"{base}/{deployment_name(daemon_id)}" if daemon_id else base

    async def start(self, spec: MpsDaemonSpec) -> MpsPaths:
        paths = self.paths(spec.id)
        try:
            if await self._api.get(self._path(spec.id)) is not None:
                return paths
            await asyncio.to_thread(self._make_dirs, paths)
            manifest = deployment_manifest(
                spec,
                paths,
                namespace=self._namespace,
                node_name=self._node,
                node_uid=await self._owner_uid(),
                image=self._image,
                driver_root=self._driver_root,
            )
            await self._api.create(self._path(), manifest)
        except ApiError as error:
            if error.status == 409:
                return paths  # created meanwhile (a retry of the same prepare)
            raise MpsDaemonError(f"cannot create the Deployment of MPS daemon {spec.id}: {error}") from None
        log.info("mps_daemon_deployment_created", daemon=spec.id, namespace=self._namespace)
        return paths

    async def wait_ready(self, spec: MpsDaemonSpec, timeout_s: float = DEFAULT_READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        name = deployment_name(spec.id)
        while True:
            try:
                deployment = await self._api.get(self._path(spec.id))
                if deployment is None:
                    raise MpsDaemonError(f"the Deployment {self._namespace}/{name} of the MPS daemon is gone")
                if int((deployment.get("status") or {}).get("readyReplicas") or 0) >= 1:
                    return
                failure = await self._pod_failure(spec.id)
            except ApiError as error:
                failure = None
                log.warning("mps_daemon_status_unreadable", daemon=spec.id, error=str(error))
            if failure:
                raise MpsDaemonError(f"MPS control daemon {self._namespace}/{name} failed: {failure}")
            if time.monotonic() >= deadline:
                raise MpsDaemonError(
                    f"MPS control daemon {self._namespace}/{name} was not ready within {timeout_s:g}s; "
                    f"see `kubectl -n {self._namespace} describe deployment {name}`"
                )
            await asyncio.sleep(_POLL_S)

    async def _pod_failure(self, daemon_id: str) -> str | None:
        """Why the daemon's pod cannot become ready, when it says so; None while it may."""
        selector = f"{DAEMON_LABEL}={daemon_id[:63].rstrip('-_.')}"
        pods = await self._api.list(f"/api/v1/namespaces/{self._namespace}/pods", labelSelector=selector)
        for pod in pods.get("items", []):
            for status in (pod.get("status") or {}).get("containerStatuses") or []:
                state = status.get("state") or {}
                waiting = state.get("waiting") or {}
                terminated = state.get("terminated") or (status.get("lastState") or {}).get("terminated")
                if waiting.get("reason") in _FAILED_REASONS:
                    return f"{waiting['reason']}: {waiting.get('message', '')}".strip(": ")
                if terminated:
                    return (
                        f"the daemon exited with code {terminated.get('exitCode')} "
                        f"({terminated.get('reason', '')}): {terminated.get('message', '')}".rstrip(": ")
                    )
        return None

    async def stop(self, daemon_id: str) -> None:
        try:
            await self._api.call("DELETE", self._path(daemon_id), body={"propagationPolicy": "Foreground"})
        except ApiError as error:
            if error.status != 404:
                raise MpsDaemonError(
                    f"cannot delete the Deployment of MPS daemon {daemon_id}: {error}"
                ) from None
        await asyncio.to_thread(self._remove_dirs, self.paths(daemon_id))
        log.info("mps_daemon_deployment_deleted", daemon=daemon_id)

    async def running(self) -> set[str]:
        listed = await self._api.list(self._path(), labelSelector=f"{NODE_LABEL}={self._node}")
        return {
            item["metadata"]["name"].removeprefix(NAME_PREFIX)
            for item in listed.get("items", [])
            if item["metadata"]["name"].startswith(NAME_PREFIX)
        }

    async def _owner_uid(self) -> str:
        if self._node_uid is None:
            node = await self._api.get(f"/api/v1/nodes/{self._node}")
            if node is None:
                raise MpsDaemonError(
                    f"node {self._node} does not exist; the MPS daemon needs it as its owner"
                )
            self._node_uid = str(node["metadata"]["uid"])
        return self._node_uid

    def _make_dirs(self, paths: MpsPaths) -> None:
        for directory in (paths.pipe, paths.log, paths.shm):
            directory.mkdir(parents=True, exist_ok=True)
        if self._mount_shm and not paths.shm.is_mount():
            _run(
                [
                    "mount",
                    "-t",
                    "tmpfs",
                    "-o",
                    f"rw,nosuid,nodev,noexec,size={self._shm_size}",
                    "shm",
                    str(paths.shm),
                ]
            )

    def _remove_dirs(self, paths: MpsPaths) -> None:
        if self._mount_shm and paths.shm.is_mount():
            _run(["umount", str(paths.shm)])
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(paths.root)


def _run(command: list[str]) -> None:
    try:
        subprocess.run(command, check=True, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as error:
        detail = getattr(error, "stderr", "") or error
        raise MpsDaemonError(f"{' '.join(command)} failed: {str(detail).strip()}") from None


def _half_the_memory(meminfo: Path = Path("/proc/meminfo")) -> str:
    """Half the node's memory, as NVIDIA sizes the daemon's tmpfs; 64 MiB when unknown."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemTotal:"):
                return f"{int(line.split()[1]) // 2}k"
    return "65536k"
