"""make demo-real: the chart installed by Helm on a real node, and what real containers see.

A control plane on 127.0.0.1, one real node (kubelet + containerd + runc in namespaces of their
own, e2e/realnode), the chart with the image `make image` built and simulated DGX H100 GPUs; then
pods with one GPU, two GPUs and a MIG device print their GPU view. Everything is stopped at the end
(or on Ctrl-C), leaving no process, mount or cgroup. Needs root.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from kubernetes import client

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from e2e.cluster import BuildError, ControlPlane, ensure_control_plane_binaries
from e2e.cluster.binaries import build_outputs
from e2e.real_node.driver import install_driver
from e2e.real_node.gpu_view import (
    allocated_devices,
    container,
    create,
    gpu_claim_template,
    pod_manifest,
    view_of,
)
from e2e.realnode.node import RealNode, RealNodeError, ensure_real_node_binaries, preflight


def step(text: str) -> None:
    print(f"==> {text}", flush=True)


def show(api: client.ApiClient, namespace: str, pod: str, claim: str) -> None:
    view = view_of(api, namespace, pod, "app")
    devices = ", ".join(allocated_devices(api, namespace, pod)[claim])
    print(f"  pod {pod}: allocated {devices}")
    for path, (major, minor) in sorted(view.devices.items()):
        print(f"    {path:<34} char {major}:{minor}")
    for name, value in sorted(view.uuids.items()):
        print(f"    {name}={value}")
    print(f"    driver libraries: {', '.join(sorted(view.libraries))}")


def main() -> int:
    base = Path(tempfile.mkdtemp(prefix="dra-demo-real-"))
    started = time.monotonic()
    try:
        preflight(base / "node")
        binaries = ensure_control_plane_binaries()
        node_binaries = ensure_real_node_binaries()
        helm = Path(build_outputs("helm")["HELM_BIN_DIR"]) / "helm"
    except (RealNodeError, BuildError) as error:
        print(f"demo-real: {error}", file=sys.stderr)
        return 1
    with ControlPlane(binaries, base / "cluster", real_nodes=True) as control_plane:
        cluster = control_plane.info
        node = RealNode(cluster, node_binaries, base / "node")
        try:
            step("a real node: kubelet v1.37 + containerd + runc, registered as Node 127.0.0.1")
            node.start()
            step("helm install charts/dra-driver-gpu: image localhost/dra-driver-gpu, simulated DGX H100")
            release = install_driver(cluster, node, helm)
            devices = sum(len(s["spec"].get("devices", [])) for s in release.slices())
            print(f"  plugin pod ready in containerd; {devices} devices published")
            with cluster.api_client() as api:
                namespace = "demo"
                client.CoreV1Api(api).create_namespace(
                    client.V1Namespace(metadata=client.V1ObjectMeta(name=namespace))
                )
                _wait_for_default_account(api, namespace)
                create(api, namespace, gpu_claim_template("one-gpu"))
                create(api, namespace, gpu_claim_template("two-gpus", count=2))
                mig = gpu_claim_template("mig", device_class="mig.dra-driver.dev")
                mig["spec"]["spec"]["devices"]["requests"][0]["exactly"]["selectors"] = [
                    {"cel": {"expression": 'device.attributes["gpu.dra-driver.dev"].profile == "1g.10gb"'}}
                ]
                create(api, namespace, mig)
                for pod, template in (("one-gpu", "one-gpu"), ("two-gpus", "two-gpus"), ("mig", "mig")):
                    create(
                        api,
                        namespace,
                        pod_manifest(
                            pod, {"gpu": {"resourceClaimTemplateName": template}}, [container("app", ["gpu"])]
                        ),
                    )
                step("what each container sees (kubectl logs)")
                for pod in ("one-gpu", "two-gpus", "mig"):
                    show(api, namespace, pod, "gpu")
            print(f"==> done in {time.monotonic() - started:.0f}s; stopping the node and the control plane")
        except RealNodeError as error:
            print(f"demo-real: {error}", file=sys.stderr)
            return 1
        finally:
            node.stop()
    return 0


def _wait_for_default_account(api: client.ApiClient, namespace: str) -> None:
    core = client.CoreV1Api(api)
    for _ in range(300):
        try:
            core.read_namespaced_service_account("default", namespace)
            return
        except client.ApiException:
            time.sleep(0.1)


if __name__ == "__main__":
    sys.exit(main())
