"""The Helm chart on the real API server: what it renders passes the server's own validation, it
installs, upgrades and uninstalls for real, its admission policy confines each plugin pod to its node,
and the driver -- installed from its wheel exactly as the image installs it, started with the chart's
environment and the token of the chart's service account -- serves a node with only the chart's
permissions.

No DaemonSet controller runs here, so the chart's DaemonSet never makes pods: the tests create the
plugin's pod from the DaemonSet's own pod template, bound to a node, and run the daemon as that pod
would, next to the kubelet harness of the node.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from dra_driver.cdi.spec import cdi_device_id
from dra_driver.devices.driver_root import REQUIRED_LIBRARIES
from dra_driver.resources.server_rules import rules_for
from dra_driver.simulated.gpus import DRIVER_VERSION
from e2e.cluster import (
    GPU_NODE_LABELS,
    ApiError,
    ClusterInfo,
    ControlPlaneBinaries,
    FakeNodeFactory,
    JsonObject,
    RestClient,
    mint_service_account_token,
)
from e2e.cluster.binaries import REPO_ROOT, build_outputs
from e2e.cluster.controlplane import free_ports
from e2e.cluster.credentials import write_kubeconfig
from e2e.daemon import Daemon, wait_until
from e2e.harness import KubeletHarness
from e2e.manifests import EXAMPLES, load
from e2e.workloads import CDI_DEVICES_ANNOTATION, cdi_devices, delete_pod, pod_claim, wait_running

pytestmark = pytest.mark.cluster

CHART = REPO_ROOT / "charts" / "dra-driver-gpu"
CI_VALUES = sorted((CHART / "ci").glob("*-values.yaml"))
DOCKERFILE = REPO_ROOT / "hack" / "image" / "Dockerfile"
# A driver name of this module's own: DeviceClasses and ResourceSlices are cluster-wide, and other
# modules publish and claim devices of the default driver.
DRIVER = "gpu.chart-e2e.dra-driver.dev"
GPU_CLASS = DRIVER
EXTENDED_RESOURCE = "chart-e2e.dra-driver.dev/gpu"
RELEASE = "gpu"
RELEASE_NAMESPACE = "dra-driver-gpu"
NODE = "chart-node"
RESOURCE_V1 = "/apis/resource.k8s.io/v1"
SLICES = f"{RESOURCE_V1}/resourceslices"


def run(argv: list[str], *, stdin: str | None = None) -> str:
    result = subprocess.run(argv, input=stdin, capture_output=True, text=True, check=False)
    assert result.returncode == 0, f"{' '.join(argv[:3])} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout


@pytest.fixture(scope="module")
def helm(cluster: ClusterInfo) -> list[str]:
    """helm, talking to the test's API server as the admin."""
    binary = Path(build_outputs("helm")["HELM_BIN_DIR"]) / "helm"
    return [str(binary), "--kubeconfig", str(cluster.kubeconfig)]


@pytest.fixture(scope="module")
def kubectl(cluster: ClusterInfo, control_plane_binaries: ControlPlaneBinaries) -> list[str]:
    return [str(control_plane_binaries.kubectl), "--kubeconfig", str(cluster.kubeconfig)]


@pytest.fixture(scope="module")
def host() -> Iterator[Path]:
    """The node's "host" directories. Short on purpose: unix socket paths are limited to 107 bytes and
    the registration socket's name carries the driver name and the pod UID."""
    base = Path(tempfile.mkdtemp(prefix="chart-", dir="/tmp"))
    yield base
    shutil.rmtree(base, ignore_errors=True)


# --- validation by the API server ---------------------------------------------------------------------


@pytest.mark.parametrize("values_file", [None, *CI_VALUES], ids=["defaults", *(p.stem for p in CI_VALUES)])
def test_rendered_chart_passes_the_api_servers_strict_validation(
    helm: list[str], kubectl: list[str], namespace: str, values_file: Path | None
) -> None:
    argv = [*helm, "template", "dry-run", str(CHART), "--namespace", namespace]
    rendered = run([*argv, "--values", str(values_file)] if values_file else argv)
    kinds = {document["kind"] for document in yaml.safe_load_all(rendered) if document}
    assert {"DaemonSet", "ClusterRole", "ClusterRoleBinding"} <= kinds

    # Every namespaced object names its namespace: the release's, and default for the one Role that
    # lets the plugin post Events about its Node (kubectl's --namespace would refuse that one).
    apply = [*kubectl, "apply", "--dry-run=server", "--validate=strict", "-f", "-"]
    run(apply, stdin=rendered)

    # The same check refuses what the schema does not know: the pass above means something.
    broken = rendered.replace("maxSurge: 1", "maxSurge: 1\n      maxSurplus: 1", 1)
    refused = subprocess.run(apply, input=broken, capture_output=True, text=True, check=False)
    assert refused.returncode != 0
    assert 'unknown field "spec.updateStrategy.rollingUpdate.maxSurplus"' in refused.stderr


def test_install_upgrade_and_uninstall(helm: list[str], rest: RestClient, namespace: str) -> None:
    driver = "gpu.upgrade-check.example.com"
    release = ["upgrade-check", str(CHART), "--namespace", namespace]
    notes = run([*helm, "install", *release, "--set", f"driverName={driver}"])
    assert f"deviceClassName: {driver}" in notes

    name = "upgrade-check-dra-driver-gpu"
    cluster_scoped = [
        f"/apis/rbac.authorization.k8s.io/v1/clusterroles/{name}",
        f"/apis/rbac.authorization.k8s.io/v1/clusterrolebindings/{name}",
        f"/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicies/{name}-resourceslices",
        f"/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicybindings/{name}-resourceslices",
        f"{RESOURCE_V1}/deviceclasses/{driver}",
        f"{RESOURCE_V1}/deviceclasses/mig.upgrade-check.example.com",
    ]
    namespaced = [
        f"/apis/apps/v1/namespaces/{namespace}/daemonsets/{name}",
        f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}",
    ]
    for path in cluster_scoped + namespaced:
        rest.get(path)

    run(
        [
            *helm,
            "upgrade",
            *release,
            "--reuse-values",
            "--set",
            "image.tag=0.2.0",
            "--set",
            "deviceClasses.gpu.extendedResourceName=upgrade-check.example.com/gpu",
            "--set",
            "deviceClasses.mig.enabled=false",
        ]
    )
    daemonset = rest.get(namespaced[0])
    assert daemonset["spec"]["template"]["spec"]["containers"][0]["image"].endswith(":0.2.0")
    assert rest.get(cluster_scoped[4])["spec"]["extendedResourceName"] == "upgrade-check.example.com/gpu"
    assert_gone(rest, cluster_scoped[5])

    run([*helm, "uninstall", "upgrade-check", "--namespace", namespace])
    for path in cluster_scoped + namespaced:
        assert_gone(rest, path)


def test_the_webhooks_ca_and_certificate_outlive_an_upgrade(
    helm: list[str], rest: RestClient, namespace: str
) -> None:
    """failurePolicy Fail (the default) while no webhook pod answers: the install still writes the
    chart's own DeviceClasses (not sent to the webhook), and `helm upgrade` keeps the CA the API server
    trusts and the pods' certificate (lookup), so a running webhook is never cut off."""
    driver = "gpu.webhook-ca.example.com"
    release = ["webhook-ca", str(CHART), "--namespace", namespace]
    run([*helm, "install", *release, "--set", f"driverName={driver}", "--set", "webhook.enabled=true"])
    name = "webhook-ca-dra-driver-gpu-webhook"
    configuration = f"/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations/{name}"
    secret = f"/api/v1/namespaces/{namespace}/secrets/{name}"
    try:
        (hook,) = rest.get(configuration)["webhooks"]
        assert hook["failurePolicy"] == "Fail"
        rest.get(f"{RESOURCE_V1}/deviceclasses/{driver}")
        before = (hook["clientConfig"]["caBundle"], rest.get(secret)["data"])

        run([*helm, "upgrade", *release, "--reuse-values", "--set", "image.tag=0.2.0"])

        (hook,) = rest.get(configuration)["webhooks"]
        assert (hook["clientConfig"]["caBundle"], rest.get(secret)["data"]) == before
    finally:
        run([*helm, "uninstall", "webhook-ca", "--namespace", namespace])


def assert_gone(rest: RestClient, path: str) -> None:
    with pytest.raises(ApiError) as missing:
        rest.get(path)
    assert missing.value.status == 404, path


# --- the release the remaining tests share ------------------------------------------------------------


@dataclass(frozen=True)
class Release:
    values: dict[str, Any]
    daemonset: JsonObject  # as the API server stores it

    @property
    def pod_template(self) -> JsonObject:
        template: JsonObject = self.daemonset["spec"]["template"]
        return template

    @property
    def service_account(self) -> str:
        return str(self.pod_template["spec"]["serviceAccountName"])


@pytest.fixture(scope="module")
def release(helm: list[str], cluster: ClusterInfo, host: Path) -> Iterator[Release]:
    """The chart installed for real: simulated DGX H100s whose host directories are under `host`."""
    rest = cluster.rest()
    rest.create("/api/v1/namespaces", {"metadata": {"name": RELEASE_NAMESPACE}})
    (port,) = free_ports(1)
    values = {
        "driverName": DRIVER,
        "simulate": "dgx-h100",
        "pluginsDir": str(host / "plugins"),
        "registryDir": str(host / "registry"),
        "cdiDir": str(host / "cdi"),
        "driverRoot": str(host / "driver-root"),
        "httpAddress": f"127.0.0.1:{port}",
        "logFormat": "console",
        "deviceClasses": {"gpu": {"extendedResourceName": EXTENDED_RESOURCE}, "migProfiles": ["1g.10gb"]},
        "nodeLabels": True,
    }
    run(
        [*helm, "install", RELEASE, str(CHART), "--namespace", RELEASE_NAMESPACE, "--values", "-"],
        stdin=yaml.safe_dump(values),
    )
    try:
        daemonset = rest.get(
            f"/apis/apps/v1/namespaces/{RELEASE_NAMESPACE}/daemonsets/{RELEASE}-dra-driver-gpu"
        )
        installed = Release(values, daemonset)
        wait_for_admission_policy(cluster, installed)
        yield installed
    finally:
        run([*helm, "uninstall", RELEASE, "--namespace", RELEASE_NAMESPACE])
        rest.request(
            "DELETE", f"/api/v1/namespaces/{RELEASE_NAMESPACE}/pods", query={"gracePeriodSeconds": "0"}
        )
        rest.delete(f"/api/v1/namespaces/{RELEASE_NAMESPACE}")


def wait_for_admission_policy(cluster: ClusterInfo, release: Release) -> None:
    """Returns once the API server enforces the new policy: it loads policies a moment after they are
    created. The probe is a dry-run write the policy refuses (a token bound to no pod names no node)
    and RBAC allows."""
    with cluster.api_client() as api:
        plugin = cluster.rest(mint_service_account_token(api, RELEASE_NAMESPACE, release.service_account))

    def enforced() -> bool:
        try:
            plugin.request("POST", SLICES, resource_slice("policy-probe", NODE), query={"dryRun": "All"})
        except ApiError as error:
            if error.status == 403 and "ValidatingAdmissionPolicy" in error.message:
                return True
            raise
        return False

    wait_until(enforced, timeout_seconds=30, waiting_for="the API server to enforce the admission policy")


def create_plugin_pod(rest: RestClient, release: Release, node: str, name: str) -> JsonObject:
    """A pod as the DaemonSet controller makes it for `node`: the template, bound to the node."""
    template = release.pod_template
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": template["metadata"]["labels"]},
        "spec": {**template["spec"], "nodeName": node},
    }
    return rest.create(f"/api/v1/namespaces/{RELEASE_NAMESPACE}/pods", pod)


def as_plugin_of(cluster: ClusterInfo, release: Release, pod: JsonObject) -> str:
    """A token of the chart's service account bound to `pod`, as the kubelet projects it into the pod."""
    with cluster.api_client() as api:
        return mint_service_account_token(
            api, RELEASE_NAMESPACE, release.service_account, bound_pod=pod["metadata"]["name"]
        )


def resource_slice(name: str, node: str, driver: str = DRIVER) -> JsonObject:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": name},
        "spec": {
            "driver": driver,
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": [{"name": "gpu-0"}],
        },
    }


def refused(call: Callable[[], object]) -> ApiError:
    """The API server's 403 for `call`."""
    with pytest.raises(ApiError) as error:
        call()
    assert error.value.status == 403, error.value
    return error.value


def add_device(client: RestClient, name: str) -> None:
    patch = {"spec": {"devices": [{"name": "gpu-0"}, {"name": "gpu-1"}]}}
    client.request("PATCH", f"{SLICES}/{name}", patch, content_type="application/merge-patch+json")


# --- the admission policy -----------------------------------------------------------------------------


def test_admission_policy_lets_a_plugin_write_only_its_own_nodes_slices(
    cluster: ClusterInfo, rest: RestClient, release: Release, fake_node: FakeNodeFactory
) -> None:
    fake_node("policy-a")
    fake_node("policy-b")
    as_plugin = cluster.rest(
        as_plugin_of(cluster, release, create_plugin_pod(rest, release, "policy-a", "plugin-policy-a"))
    )
    cleanup = [f"{SLICES}/policy-a-own", f"{SLICES}/policy-b-other"]
    try:
        as_plugin.create(SLICES, resource_slice("policy-a-own", "policy-a"))  # its own node: allowed
        denied = refused(lambda: as_plugin.create(SLICES, resource_slice("policy-a-foreign", "policy-b")))
        assert "on node policy-a may write only ResourceSlices with spec.nodeName policy-a" in denied.message
        other_driver = resource_slice("policy-a-other-driver", "policy-a", driver="x.example.com")
        denied = refused(lambda: as_plugin.create(SLICES, other_driver))
        assert f"only ResourceSlices of its driver, {DRIVER}" in denied.message

        # Another node's slice, written by someone else, can neither be changed nor deleted.
        rest.create(SLICES, resource_slice("policy-b-other", "policy-b"))
        refused(lambda: add_device(as_plugin, "policy-b-other"))
        refused(lambda: as_plugin.delete(f"{SLICES}/policy-b-other"))

        add_device(as_plugin, "policy-a-own")
        as_plugin.delete(f"{SLICES}/policy-a-own")

        # The same account with a token that names no node (not bound to a pod) may write nothing.
        with cluster.api_client() as api:
            unbound = cluster.rest(
                mint_service_account_token(api, RELEASE_NAMESPACE, release.service_account)
            )
        denied = refused(lambda: unbound.create(SLICES, resource_slice("policy-unbound", "policy-a")))
        assert "this token names no node" in denied.message
    finally:
        for path in cleanup:
            try:
                rest.delete(path)
            except ApiError as error:
                if error.status != 404:
                    raise


def label(client: RestClient, node: str, labels: dict[str, str | None]) -> None:
    patch = {"metadata": {"labels": labels}}
    client.request("PATCH", f"/api/v1/nodes/{node}", patch, content_type="application/merge-patch+json")


def test_admission_policy_lets_a_plugin_change_only_its_own_nodes_nvidia_labels(
    cluster: ClusterInfo, rest: RestClient, release: Release, fake_node: FakeNodeFactory
) -> None:
    fake_node("labels-a")
    fake_node("labels-b")
    as_plugin = cluster.rest(
        as_plugin_of(cluster, release, create_plugin_pod(rest, release, "labels-a", "plugin-labels-a"))
    )

    label(as_plugin, "labels-a", {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"})  # allowed
    label(as_plugin, "labels-a", {"nvidia.com/gpu.product": None})  # and removed again

    denied = refused(lambda: label(as_plugin, "labels-b", {"nvidia.com/gpu.product": "x"}))
    assert "may change only its own Node (labels-a), not labels-b" in denied.message
    denied = refused(lambda: label(as_plugin, "labels-a", {"kubernetes.io/hostname": "elsewhere"}))
    assert "may change only the nvidia.com/ labels" in denied.message
    refused(lambda: label(as_plugin, "labels-a", {"node-role.kubernetes.io/control-plane": ""}))
    unschedulable = {"spec": {"unschedulable": True}}
    refused(
        lambda: as_plugin.request(
            "PATCH", "/api/v1/nodes/labels-a", unschedulable, content_type="application/merge-patch+json"
        )
    )
    assert rest.get("/api/v1/nodes/labels-a")["metadata"]["labels"]["kubernetes.io/hostname"] == "labels-a"


# --- the driver with the chart's permissions, installed as the image installs it ----------------------


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(instruction, arguments) of hack/image/Dockerfile, comments and blank lines left out."""
    instructions = []
    for line in DOCKERFILE.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            instruction, _, arguments = line.strip().partition(" ")
            instructions.append((instruction, arguments.strip()))
    return instructions


def build_inputs() -> list[str]:
    """What the Dockerfile's wheel stage copies from the build context (COPY without --from)."""
    sources: list[str] = []
    for instruction, arguments in dockerfile_instructions():
        if instruction == "COPY" and not arguments.startswith("--"):
            sources += arguments.split()[:-1]
    return sources


def entrypoint() -> list[str]:
    (arguments,) = [args for instruction, args in dockerfile_instructions() if instruction == "ENTRYPOINT"]
    command: list[str] = json.loads(arguments)
    return command


@pytest.fixture(scope="module")
def installed_entrypoint(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """The image's entry point, from the wheel built and installed into a clean virtualenv as the
    Dockerfile does it: only the files it copies, `pip wheel`, the lock's dependencies with their
    hashes required, then that wheel without dependencies."""
    base = tmp_path_factory.mktemp("image")
    context = base / "src"
    for source in build_inputs():
        origin = REPO_ROOT / source
        if origin.is_dir():
            shutil.copytree(origin, context / source, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            (context / source).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(origin, context / source)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--quiet"]
    run([*pip, "wheel", "--no-deps", "--wheel-dir", str(base / "wheels"), str(context)])
    (wheel,) = (base / "wheels").glob("*.whl")
    run([sys.executable, "-m", "venv", str(base / "venv")])
    venv_pip = [str(base / "venv" / "bin" / "python"), "-m", "pip", "--disable-pip-version-check", "--quiet"]
    (lock,) = [source for source in build_inputs() if source.startswith("requirements/")]
    run([*venv_pip, "install", "--require-hashes", "--no-deps", "-r", str(context / lock)])
    run([*venv_pip, "install", "--no-deps", str(wheel)])
    program, *arguments = entrypoint()
    return [str(base / "venv" / "bin" / program), *arguments]


def pod_environment(pod: JsonObject) -> dict[str, str]:
    """The plugin container's environment as the kubelet would set it: values, and the downward API."""
    (container,) = pod["spec"]["containers"]
    fields = {
        "spec.nodeName": pod["spec"]["nodeName"],
        "metadata.uid": pod["metadata"]["uid"],
        "metadata.namespace": pod["metadata"]["namespace"],
    }
    # The API server drops an empty value (omitempty): such an entry is the empty string.
    return {
        entry["name"]: fields[entry["valueFrom"]["fieldRef"]["fieldPath"]]
        if "valueFrom" in entry
        else entry.get("value", "")
        for entry in container["env"]
    }


class PluginPod:
    """A pod of the DaemonSet on node NODE, and its daemon, run as that pod would run it: the image's
    entry point with the pod's environment and nothing else. In the pod the daemon finds its token
    through the in-cluster configuration; here a kubeconfig (DRA_KUBECONFIG) carries the same token."""

    def __init__(
        self,
        cluster: ClusterInfo,
        release: Release,
        entrypoint: list[str],
        host: Path,
        name: str,
        *,
        http_address: str | None = None,
    ) -> None:
        self.pod = create_plugin_pod(cluster.rest(), release, NODE, name)
        kubeconfig = host / f"{name}.kubeconfig"
        write_kubeconfig(
            kubeconfig,
            server=cluster.server,
            ca_certificate=cluster.ca_file.read_bytes(),
            user=name,
            token=as_plugin_of(cluster, release, self.pod),
        )
        environment = {**pod_environment(self.pod), "DRA_KUBECONFIG": str(kubeconfig)}
        if http_address is not None:
            environment["DRA_HTTP_ADDRESS"] = http_address
        self.readyz = f"http://{environment['DRA_HTTP_ADDRESS']}/readyz"
        self.daemon = Daemon(f"dra-driver[{name}]", host / f"{name}.log")
        self._argv = ["env", "-i", *(f"{key}={value}" for key, value in environment.items()), *entrypoint]

    @property
    def uid(self) -> str:
        return str(self.pod["metadata"]["uid"])

    def start(self) -> None:
        """Returns once /readyz answers 200: registered with the kubelet, the node's slices published."""
        self.daemon.start(self._argv, lambda _: self.ready(), timeout_seconds=90)

    def ensure_running(self) -> None:
        if not self.daemon.running:
            self.start()

    def stop(self) -> int | None:
        return self.daemon.stop()

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.readyz, timeout=2) as response:
                return bool(response.status == 200)
        except (urllib.error.URLError, OSError):
            return False


@pytest.fixture(scope="module")
def kubelet(cluster: ClusterInfo, release: Release, host: Path) -> Iterator[KubeletHarness]:
    """The kubelet of node NODE, watching the chart's registration directory."""
    harness = KubeletHarness(
        Path(build_outputs("harness")["KUBE_BIN_DIR"]) / "kubelet-harness",
        kubeconfig=cluster.kubeconfig,
        node_name=NODE,
        registry_dir=Path(release.values["registryDir"]),
        state_dir=host / "kubelet",
        log=host / "kubelet-harness.log",
        labels=GPU_NODE_LABELS,
    )
    rest = cluster.rest()
    try:
        harness.start()
        yield harness
    finally:
        harness.stop()
        try:
            rest.delete(f"/api/v1/nodes/{NODE}")
        except ApiError as error:
            if error.status != 404:
                raise
        rest.request("DELETE", SLICES, query={"fieldSelector": f"spec.driver={DRIVER}"})


@pytest.fixture(scope="module")
def plugin_pod(
    cluster: ClusterInfo,
    release: Release,
    installed_entrypoint: list[str],
    host: Path,
    kubelet: KubeletHarness,
) -> Iterator[PluginPod]:
    """The plugin on node NODE, the driver's simulated files in place."""
    libraries = Path(release.values["driverRoot"]) / "usr" / "lib64"
    libraries.mkdir(parents=True)
    for library in REQUIRED_LIBRARIES:
        (libraries / f"{library}.so.{DRIVER_VERSION}").touch()
    plugin = PluginPod(cluster, release, installed_entrypoint, host, f"plugin-{NODE}")
    try:
        plugin.start()
        yield plugin
    finally:
        plugin.stop()


@pytest.fixture
def plugin(plugin_pod: PluginPod) -> PluginPod:
    """The module's plugin, running (again, after a test that stopped it)."""
    plugin_pod.ensure_running()
    return plugin_pod


def node_slices(rest: RestClient) -> list[JsonObject]:
    query = {"fieldSelector": f"spec.nodeName={NODE},spec.driver={DRIVER}"}
    items: list[JsonObject] = rest.request("GET", SLICES, query=query)["items"]
    return items


@pytest.mark.e2e
def test_driver_publishes_the_node_with_only_the_charts_permissions(
    rest: RestClient, plugin: PluginPod
) -> None:
    node_uid = rest.get(f"/api/v1/nodes/{NODE}")["metadata"]["uid"]
    slices = node_slices(rest)
    devices = [device["name"] for item in slices for device in item["spec"].get("devices") or []]
    assert {f"gpu-{minor}" for minor in range(8)} <= set(devices)
    assert any("-mig-" in name for name in devices)  # migPartitions: all, the default
    owner = {"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": node_uid}
    for item in slices:  # the Node was readable (get nodes)
        assert [{k: ref[k] for k in owner} for ref in item["metadata"]["ownerReferences"]] == [owner]

    # A slice left in the node's pool by someone else is noticed (watch) and removed (delete).
    pool = slices[0]["spec"]["pool"]
    stale_name = f"{DRIVER}-{NODE}-stale"
    stale = resource_slice(stale_name, NODE)
    stale["spec"]["pool"] = dict(pool)
    rest.create(SLICES, stale)
    wait_until(
        lambda: stale_name not in {item["metadata"]["name"] for item in node_slices(rest)},
        timeout_seconds=30,
        waiting_for="the daemon to delete the stale slice in its pool",
    )
    # nodeLabels: GFD's labels on its own node, under the node-labels admission policy.
    wait_until(
        lambda: (
            rest.get(f"/api/v1/nodes/{NODE}")["metadata"]["labels"].get("nvidia.com/gpu.product")
            == "NVIDIA-H100-80GB-HBM3"
        ),
        timeout_seconds=30,
        waiting_for="the daemon to label its node",
    )
    assert plugin.ready()
    assert not re.search(r"Forbidden|is forbidden", plugin.daemon.log_since(0))  # no call was refused


@pytest.mark.e2e
def test_claimed_gpu_is_prepared_with_only_the_charts_permissions(
    rest: RestClient, plugin: PluginPod, namespace: str
) -> None:
    claim_a_gpu(rest, namespace, "claims-a-gpu")

    pod = wait_running(rest, namespace, "claims-a-gpu")  # prepared: the claim was readable (get)

    claim = pod_claim(rest, pod, "gpu")
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    assert cdi_devices(pod)["app"] == [cdi_device_id(DRIVER, claim["metadata"]["uid"], result["device"])]


@pytest.mark.e2e
def test_pod_asking_for_the_extended_resource_gets_a_gpu_through_dra(
    rest: RestClient, plugin: PluginPod, namespace: str
) -> None:
    # The documented example, with the test's own resource name instead of nvidia.com/gpu.
    (example,) = load(EXAMPLES / "extended-resource.yaml")
    container = example["spec"]["containers"][0]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": "1"}
    container["resources"]["limits"] = {EXTENDED_RESOURCE: "1"}
    example["spec"]["nodeSelector"] = {"kubernetes.io/hostname": NODE}
    rest.create(f"/api/v1/namespaces/{namespace}/pods", example)

    pod = wait_running(rest, namespace, "asks-extended-resource")

    claim_status = pod["status"]["extendedResourceClaimStatus"]
    claim = rest.get(
        f"{RESOURCE_V1}/namespaces/{namespace}/resourceclaims/{claim_status['resourceClaimName']}"
    )
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    assert result["driver"] == DRIVER
    assert result["device"].startswith("gpu-")
    assert cdi_devices(pod)["app"] == [cdi_device_id(DRIVER, claim["metadata"]["uid"], result["device"])]
    assert CDI_DEVICES_ANNOTATION in pod["metadata"]["annotations"]


@pytest.mark.e2e
def test_device_plugin_era_pod_asking_for_a_mig_profile_gets_that_mig_device(
    rest: RestClient, cluster: ClusterInfo, plugin: PluginPod, namespace: str
) -> None:
    # docs/examples/extended-resource-mig.yaml, unchanged but for the node it is kept to.
    (example,) = load(EXAMPLES / "extended-resource-mig.yaml")
    assert example["spec"]["containers"][0]["resources"]["limits"] == {"nvidia.com/mig-1g.10gb": "1"}
    example["spec"]["nodeSelector"] = {"kubernetes.io/hostname": NODE}
    rest.create(f"/api/v1/namespaces/{namespace}/pods", example)

    pod = wait_running(rest, namespace, "asks-mig-extended-resource")

    claim_status = pod["status"]["extendedResourceClaimStatus"]
    claim = rest.get(
        f"{RESOURCE_V1}/namespaces/{namespace}/resourceclaims/{claim_status['resourceClaimName']}"
    )
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    assert result["driver"] == DRIVER
    assert re.fullmatch(r"gpu-[0-7]-mig-1g10gb-19-[0-6]", result["device"]), result["device"]
    assert cdi_devices(pod)["app"] == [cdi_device_id(DRIVER, claim["metadata"]["uid"], result["device"])]
    if rules_for(cluster.kube_version).binding_conditions:
        # The pod was bound once the plugin, with the chart's permissions alone (a watch of the claims,
        # the status write of its own node's devices), reported the MIG device made.
        assert result["bindingConditions"] == ["Ready"]
        (entry,) = [e for e in claim["status"]["devices"] if e["device"] == result["device"]]
        assert {c["type"]: c["status"] for c in entry["conditions"]}["Ready"] == "True"


def claim_a_gpu(rest: RestClient, namespace: str, name: str) -> None:
    """A pod on node NODE with a claim for one full GPU, made from a ResourceClaimTemplate."""
    template = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name},
        "spec": {
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": GPU_CLASS}}]}}
        },
    }
    rest.create(f"{RESOURCE_V1}/namespaces/{namespace}/resourceclaimtemplates", template)
    pod = workload_pod(
        name,
        resourceClaims=[{"name": "gpu", "resourceClaimTemplateName": name}],
        resources={"claims": [{"name": "gpu"}]},
    )
    rest.create(f"/api/v1/namespaces/{namespace}/pods", pod)


def workload_pod(
    name: str, *, resources: JsonObject, resourceClaims: list[JsonObject] | None = None
) -> JsonObject:
    spec: JsonObject = {
        "nodeSelector": {"kubernetes.io/hostname": NODE},
        "containers": [{"name": "app", "image": "registry.k8s.io/pause:3.10", "resources": resources}],
    }
    if resourceClaims:
        spec["resourceClaims"] = resourceClaims
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


@pytest.mark.e2e
def test_upgrade_starts_the_new_plugin_next_to_the_old_one(
    cluster: ClusterInfo,
    rest: RestClient,
    release: Release,
    installed_entrypoint: list[str],
    host: Path,
    plugin: PluginPod,
    namespace: str,
) -> None:
    # The DaemonSet's surge pod on the same node. In the cluster each pod listens in its own network
    # namespace; here both share the host's, so the new one gets a port of its own.
    (port,) = free_ports(1)
    new = PluginPod(
        cluster, release, installed_entrypoint, host, f"plugin-{NODE}-new", http_address=f"127.0.0.1:{port}"
    )
    registry = Path(release.values["registryDir"])
    try:
        new.start()  # ready, so registered with the kubelet, while the old plugin still serves
        assert plugin.ready()
        assert {path.name for path in registry.iterdir()} == {
            f"{DRIVER}-{plugin.uid}-reg.sock",
            f"{DRIVER}-{new.uid}-reg.sock",
        }

        assert plugin.stop() == 0  # maxUnavailable 0: the old pod goes once the new one is ready

        assert {path.name for path in registry.iterdir()} == {f"{DRIVER}-{new.uid}-reg.sock"}
        claim_a_gpu(rest, namespace, "after-upgrade")
        wait_running(rest, namespace, "after-upgrade")  # prepared by the new plugin
        delete_pod(rest, namespace, "after-upgrade")  # and unprepared by it
    finally:
        new.stop()
