"""One simulated GPU node: its kubelet (the harness) and the driver daemon, side by side on one
registration directory, as on a real node. Everything on the node lives under one directory."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path

from e2e.cluster import GPU_NODE_LABELS, ApiError, ClusterInfo, JsonObject, RestClient
from e2e.daemon import Daemon, wait_until
from e2e.driver import DRIVER_NAME, DriverPaths, DriverProcess
from e2e.harness import KubeletHarness

RESOURCE_V1 = "/apis/resource.k8s.io/v1"
SLICES = f"{RESOURCE_V1}/resourceslices"


def node_slices_query(node_name: str, driver_name: str = DRIVER_NAME) -> dict[str, str]:
    return {"fieldSelector": f"spec.nodeName={node_name},spec.driver={driver_name}"}


def published_slices(rest: RestClient, node_name: str, driver_name: str = DRIVER_NAME) -> list[JsonObject]:
    """Our driver's ResourceSlices of the node, as the API server stores them."""
    query = node_slices_query(node_name, driver_name)
    items: list[JsonObject] = rest.request("GET", SLICES, query=query)["items"]
    return items


def published_devices(
    rest: RestClient, node_name: str, driver_name: str = DRIVER_NAME
) -> dict[str, JsonObject]:
    """The devices in the node's pool by name, as the scheduler sees them."""
    return {
        device["name"]: device
        for item in published_slices(rest, node_name, driver_name)
        for device in item["spec"].get("devices") or []
    }


class GpuNode:
    """A node whose kubelet and driver can be started, stopped and restarted independently."""

    def __init__(
        self,
        cluster: ClusterInfo,
        harness_binary: Path,
        base_dir: Path,
        name: str,
        *,
        profile: str = "dgx-h100",
        driver_args: Sequence[str] = (),
        mock_nvml: str | None = None,
        driver_name: str = DRIVER_NAME,
        driver_wrapper: Sequence[str] = (),
    ) -> None:
        self.name = name
        self.driver_name = driver_name
        self.rest = cluster.rest()
        registry = base_dir / "plugins_registry"
        self.harness = KubeletHarness(
            harness_binary,
            kubeconfig=cluster.kubeconfig,
            node_name=name,
            registry_dir=registry,
            state_dir=base_dir / "kubelet",
            log=base_dir / "kubelet-harness.log",
            labels=GPU_NODE_LABELS,
        )
        self.driver = DriverProcess(
            kubeconfig=cluster.kubeconfig,
            node_name=name,
            paths=DriverPaths.under(base_dir / "driver", registry),
            log=base_dir / "dra-driver.log",
            profile=profile,
            extra_args=driver_args,
            mock_nvml=mock_nvml,
            driver_name=driver_name,
            wrapper=driver_wrapper,
        )

    @property
    def daemons(self) -> tuple[Daemon, ...]:
        return (self.harness.daemon, self.driver.daemon)

    def start(self) -> None:
        """Starts whatever is not running, the kubelet first as on a booting node: the driver is ready
        only once the kubelet registered it. Idempotent, for after a test that stopped one of them."""
        if not self.harness.running:
            self.harness.start()
        if not self.driver.running:
            self.driver.start()

    def stop(self) -> None:
        self.driver.stop()
        self.harness.stop()

    @contextlib.contextmanager
    def running(self) -> Iterator[GpuNode]:
        """The node started for the block (a module's fixture), removed after it, or after a start
        that failed half-way."""
        try:
            self.start()
            yield self
        finally:
            self.remove()

    def remove(self) -> None:
        """Stops both and deletes the Node and its slices from the API server."""
        self.stop()
        try:
            self.rest.delete(f"/api/v1/nodes/{self.name}")
        except ApiError as error:
            if error.status != 404:
                raise
        self.rest.request("DELETE", SLICES, query=node_slices_query(self.name, self.driver_name))

    def wait_idle(self, timeout_seconds: float = 60.0) -> None:
        """Waits until no claim is prepared on the node any more: no CDI spec is left."""
        try:
            wait_until(
                lambda: not self.driver.prepared_claim_uids(),
                timeout_seconds=timeout_seconds,
                waiting_for=f"node {self.name} to unprepare every claim",
            )
        except TimeoutError as error:
            left = sorted(self.driver.prepared_claim_uids())
            raise TimeoutError(f"{error}; claims with a CDI spec left: {left}") from None
