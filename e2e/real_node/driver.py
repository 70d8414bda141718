"""The chart on the real node: `helm install` with the image `make image` built, as a user would."""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubernetes import client

from e2e.cluster import ClusterInfo
from e2e.cluster.binaries import REPO_ROOT
from e2e.realnode import config
from e2e.realnode.images import IMAGES
from e2e.realnode.node import RealNode

CHART = REPO_ROOT / "charts" / "dra-driver-gpu"
RELEASE = "dra-driver-gpu"
NAMESPACE = "dra-driver-gpu"
DRIVER_NAME = "gpu.dra-driver.dev"
PROFILE = "dgx-h100"
ADMIN_GPU = "gpu-3"
NO_MIG_ON_GPU_3 = "0\\,1\\,2\\,4\\,5\\,6\\,7"  # helm --set: commas escaped
POD_SELECTOR = "app.kubernetes.io/name=dra-driver-gpu,app.kubernetes.io/instance=dra-driver-gpu"


@dataclass
class DriverRelease:
    cluster: ClusterInfo
    node: RealNode
    helm: Path
    tag: str
    installed: bool = True

    def helm_run(self, *args: str, timeout: float = 180) -> str:
        result = subprocess.run(
            [str(self.helm), *args, "--kubeconfig", str(self.cluster.kubeconfig)],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if result.returncode != 0:
            raise RuntimeError(f"helm {' '.join(args)} failed: {result.stderr.strip()}")
        return result.stdout

    def values(self, tag: str | None = None) -> list[str]:
        assert self.node.layout is not None
        return [
            "--set", f"image.repository={IMAGES['driver']}",
            "--set", f"image.tag={tag or self.tag}",
            # Imported into the node's containerd; nothing is ever pulled.
            "--set", "image.pullPolicy=Never",
            "--set", f"simulate={PROFILE}",
            "--set", f"driverRoot={self.node.layout.driver_root}",
            "--set", "logFormat=json",
            # GPU 3 offers no MIG partitions: the 1.37 scheduler counts an admin-access claim against
            # a partitionable GPU's counters, which its workload holds (kubernetes/kubernetes#140729).
            "--set", f"migPartitions={NO_MIG_ON_GPU_3}",
        ]  # fmt: skip

    def plugin_pods(self) -> list[client.V1Pod]:
        with self.cluster.api_client() as api:
            pods = client.CoreV1Api(api).list_namespaced_pod(NAMESPACE, label_selector=POD_SELECTOR)
        return list(pods.items)

    def wait_ready(self, timeout: float = 180, image_tag: str | None = None) -> client.V1Pod:
        """The one plugin pod once it is Ready (registered, slices published), of `image_tag` if given."""
        deadline = time.monotonic() + timeout
        while True:
            pods = [p for p in self.plugin_pods() if p.metadata.deletion_timestamp is None]
            ready = [
                p
                for p in pods
                if _ready(p) and (image_tag is None or p.spec.containers[0].image.endswith(f":{image_tag}"))
            ]
            if len(ready) == 1 and len(pods) == 1:
                return ready[0]
            if time.monotonic() > deadline:
                states = [(p.metadata.name, p.status.phase, _ready(p)) for p in pods]
                raise TimeoutError(f"the plugin pod is not ready: {states}\n{self.node.failure_summary()}")
            time.sleep(0.5)

    def slices(self) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = self.cluster.rest().get("/apis/resource.k8s.io/v1/resourceslices")[
            "items"
        ]
        return [s for s in items if s["spec"]["driver"] == DRIVER_NAME]

    def wait_published(self, timeout: float = 60) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while not (found := self.slices()):
            if time.monotonic() > deadline:
                raise TimeoutError("the driver published no ResourceSlice")
            time.sleep(0.5)
        return found

    def uninstall(self) -> None:
        if not self.installed:
            return
        self.installed = False
        # --wait includes the chart's CRDs. The API server's CRD finalizer may meet the resource's
        # storage still being set up (a module that installs and uninstalls within seconds) and then
        # retries with a growing backoff: CI saw a ComputeDomainClique CRD go 2.5 minutes after its
        # deletion ("storage is (re)initializing"). The next install needs it gone, so wait it out.
        self.helm_run(
            "uninstall", RELEASE, "--namespace", NAMESPACE, "--wait", "--timeout", "300s", timeout=330
        )

    # --- what the driver leaves on the node -----------------------------------------------------

    def cdi_specs(self) -> list[Path]:
        assert self.node.layout is not None
        directory = self.node.layout.host_path(config.CDI_DIR)
        return sorted(directory.glob("*.json")) if directory.exists() else []

    def sockets(self) -> list[Path]:
        assert self.node.layout is not None
        found = []
        for inside in (f"{config.KUBELET_ROOT}/plugins", f"{config.KUBELET_ROOT}/plugins_registry"):
            directory = self.node.layout.host_path(inside)
            if directory.exists():
                found += [p for p in directory.rglob("*") if p.is_socket()]
        return sorted(found)


def _ready(pod: client.V1Pod) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in (pod.status.conditions or []))


def install_driver(
    cluster: ClusterInfo,
    node: RealNode,
    helm: Path,
    tag: str | None = None,
    replace: dict[str, str] | None = None,
    extra: tuple[str, ...] = (),
) -> DriverRelease:
    """``replace``: `--set` values swapped for others (``{"simulate=dgx-h100": "simulate="}``);
    ``extra``: further `--set` values (``("deviceMetadata=true",)``)."""
    from e2e.realnode.images import chart_app_version

    release = DriverRelease(cluster, node, helm, tag or chart_app_version())
    values = [(replace or {}).get(value, value) for value in release.values()]
    values += [argument for value in extra for argument in ("--set", value)]
    release.helm_run("install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--create-namespace", *values)
    release.wait_ready()
    release.wait_published()
    return release
