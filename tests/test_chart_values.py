"""The Helm chart against the daemon it deploys: every setting of the daemon is a value of the chart or
set by the chart on purpose, every value changes what is deployed, and what the chart renders is a
configuration the daemon accepts. The chart is rendered by the real helm (hack/build-kube.sh helm);
no cluster is needed."""

from __future__ import annotations

import copy
import importlib.util
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import jsonschema
import pytest
import yaml
from pydantic import ValidationError

from dra_driver.cli import env_name
from dra_driver.settings import LogFormat, Settings
from dra_driver.simulated.nodes import NODE_PROFILES
from e2e.cluster.binaries import REPO_ROOT, build_outputs

CHART = REPO_ROOT / "charts" / "dra-driver-gpu"
CI_VALUES = sorted((CHART / "ci").glob("*-values.yaml"))
EXAMPLES = REPO_ROOT / "docs" / "examples"
NAMESPACE = "gpu-system"
Manifest = dict[str, Any]


def _load_generator() -> ModuleType:
    """hack/gen-config-docs.py, which holds the settings the chart sets itself (CHART_SETS)."""
    path = REPO_ROOT / "hack" / "gen-config-docs.py"
    spec = importlib.util.spec_from_file_location("gen_config_docs", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


docs = _load_generator()
DEFAULTS, SCHEMA = docs.load_chart()
LEAVES: dict[str, dict[str, Any]] = dict(docs.schema_leaves(SCHEMA))
SETTING_OF_VALUE = {docs.value_key(name): name for name in Settings.model_fields}


@pytest.fixture(scope="module")
def helm() -> Path:
    return Path(build_outputs("helm")["HELM_BIN_DIR"]) / "helm"


def render(
    helm: Path, values: dict[str, Any] | None = None, values_file: Path | None = None
) -> list[Manifest]:
    """`helm template` of the chart with `values` (and `values_file`) over the defaults."""
    argv = [str(helm), "template", "gpu", str(CHART), "--namespace", NAMESPACE]
    if values_file is not None:
        argv += ["--values", str(values_file)]
    argv += ["--values", "-"]
    result = subprocess.run(
        argv, input=yaml.safe_dump(values or {}), capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def render_error(helm: Path, values: dict[str, Any], namespace: str = NAMESPACE) -> str:
    result = subprocess.run(
        [str(helm), "template", "gpu", str(CHART), "--namespace", namespace, "--values", "-"],
        input=yaml.safe_dump(values),
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode != 0, "the chart rendered values it should refuse"
    return result.stderr


def of_kind(manifests: list[Manifest], kind: str) -> list[Manifest]:
    return [m for m in manifests if m["kind"] == kind]


def pod_spec(manifests: list[Manifest]) -> dict[str, Any]:
    (daemonset,) = of_kind(manifests, "DaemonSet")
    spec: dict[str, Any] = daemonset["spec"]["template"]["spec"]
    return spec


def plugin_env(manifests: list[Manifest]) -> dict[str, dict[str, Any]]:
    (container,) = pod_spec(manifests)["containers"]
    return {entry["name"]: entry for entry in container["env"]}


def settings_from_env(
    env: dict[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch, **downward: str
) -> Settings:
    """The settings the daemon reads from this environment; `downward` fills fieldRef variables."""
    for name, entry in env.items():
        if "value" in entry:
            monkeypatch.setenv(name, entry["value"])
        else:
            monkeypatch.setenv(name, downward[entry["valueFrom"]["fieldRef"]["fieldPath"]])
    return Settings()


def with_value(values: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    changed = copy.deepcopy(values)
    *parents, last = path.split(".")
    node = changed
    for key in parents:
        node = node[key]
    node[last] = value
    return changed


DOWNWARD = {
    "spec.nodeName": "gpu-node-1",
    "metadata.uid": "4f7c7a2e-4c55-4d8f-9f3a-6c4a1f2b3c4d",
    "metadata.namespace": "dra-driver",
}
VALUES_FILES = [None, *CI_VALUES]
VALUES_IDS = ["defaults", *(path.stem for path in CI_VALUES)]


# --- settings <-> values ------------------------------------------------------------------------------


def test_every_setting_is_a_value_or_set_by_the_chart() -> None:
    for name in Settings.model_fields:
        is_value = docs.value_key(name) in SCHEMA["properties"]
        set_by_chart = name in docs.CHART_SETS
        assert is_value or set_by_chart, (
            f"setting {name} has no chart value: add {docs.value_key(name)} to values.yaml, "
            "values.schema.json and the DaemonSet, or explain in CHART_SETS (hack/gen-config-docs.py) "
            "why the chart sets it itself"
        )
        assert not (is_value and set_by_chart), f"setting {name} is both a value and set by the chart"
    assert set(docs.CHART_SETS) <= set(Settings.model_fields), "CHART_SETS names a setting that is gone"


@pytest.mark.parametrize("values_file", VALUES_FILES, ids=VALUES_IDS)
def test_the_plugin_gets_one_variable_per_setting_and_no_other(helm: Path, values_file: Path | None) -> None:
    env = plugin_env(render(helm, values_file=values_file))
    left_to_daemon = {name for name, chart in docs.CHART_SETS.items() if chart.left_to_daemon}
    assert set(env) == {env_name(name) for name in Settings.model_fields if name not in left_to_daemon}
    for name, chart in docs.CHART_SETS.items():
        if chart.field_path is not None:
            assert env[env_name(name)]["valueFrom"]["fieldRef"]["fieldPath"] == chart.field_path
        if chart.value is not None:
            assert env[env_name(name)]["value"] == chart.value


@pytest.mark.parametrize("values_file", VALUES_FILES, ids=VALUES_IDS)
def test_the_daemon_accepts_the_rendered_configuration(
    helm: Path, values_file: Path | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    given = yaml.safe_load(values_file.read_text()) if values_file else {}
    settings = settings_from_env(plugin_env(render(helm, values_file=values_file)), monkeypatch, **DOWNWARD)
    assert settings.node_name == DOWNWARD["spec.nodeName"]
    assert settings.pod_uid == DOWNWARD["metadata.uid"]
    for key, value in given.items():
        if key in SETTING_OF_VALUE:
            name = SETTING_OF_VALUE[key]
            assert getattr(settings, name) == getattr(Settings(**{name: value}), name)


def test_default_values_are_the_daemons_defaults(helm: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rendered = settings_from_env(plugin_env(render(helm)), monkeypatch, **DOWNWARD)
    monkeypatch.delenv(env_name("node_name"))
    monkeypatch.delenv(env_name("pod_uid"))
    assert rendered.model_dump(exclude={"node_name", "pod_uid"}) == Settings().model_dump(
        exclude={"node_name", "pod_uid"}
    )


# --- every value has an effect ------------------------------------------------------------------------


def _switched_on(values: dict[str, Any]) -> dict[str, Any]:
    """The defaults with every boolean value true, so that what a switch enables is rendered."""
    result = copy.deepcopy(values)
    for path, schema in LEAVES.items():
        if schema.get("type") == "boolean":
            result = with_value(result, path, True)
    return result


@pytest.fixture(scope="module")
def switched_on(helm: Path) -> tuple[dict[str, Any], list[Manifest]]:
    values = _switched_on(DEFAULTS)
    return values, render(helm, values)


# Values whose effect shows only in another release namespace, or that cannot be switched off alone
# while every switch is on; each has a test of its own.
NAMESPACE_DEPENDENT = {"allowDefaultNamespace": "test_the_default_namespace_is_refused_unless_allowed"}
OWN_TEST = {"metricsPublic": "test_metrics_leave_the_pod_only_when_asked_and_then_behind_a_network_policy"}


@pytest.mark.parametrize("path", [path for path in LEAVES if path not in {**NAMESPACE_DEPENDENT, **OWN_TEST}])
def test_every_value_changes_what_is_deployed(
    helm: Path, path: str, switched_on: tuple[dict[str, Any], list[Manifest]]
) -> None:
    base_values, base = switched_on
    examples = LEAVES[path].get("examples")
    assert examples, f"give {path} an example in values.schema.json: the value this test sets"
    example = False if LEAVES[path]["type"] == "boolean" else examples[0]  # every switch is on in base
    changed_values = with_value(base_values, path, example)
    assert docs.lookup(base_values, path) != example, f"the example of {path} is its default"
    jsonschema.validate(changed_values, SCHEMA)

    changed = render(helm, changed_values)

    assert changed != base, f"value {path} has no effect on the rendered chart: use it or remove it"
    if path in SETTING_OF_VALUE:
        name = SETTING_OF_VALUE[path]
        expected = str(example).lower() if isinstance(example, bool) else str(example)  # as helm prints it
        assert plugin_env(changed)[env_name(name)]["value"] == expected


def test_every_value_of_the_schema_has_a_default_and_a_description() -> None:
    for path, schema in LEAVES.items():
        docs.lookup(DEFAULTS, path)  # KeyError: missing from values.yaml
        if path not in SETTING_OF_VALUE:  # the settings' own descriptions document those
            assert schema.get("description"), f"{path} needs a description in values.schema.json"
    jsonschema.validate(DEFAULTS, SCHEMA)


def test_schema_offers_what_the_daemon_accepts() -> None:
    properties = SCHEMA["properties"]
    assert set(properties["simulate"]["enum"]) == {"", *NODE_PROFILES}
    assert properties["logFormat"]["enum"] == [member.value for member in LogFormat]
    for level in properties["logLevel"]["enum"]:
        Settings(log_level=level)
    with pytest.raises(ValidationError):
        Settings(log_level="trace")


def test_configuration_docs_are_current() -> None:
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "hack" / "gen-config-docs.py"), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr


# --- what the chart deploys ---------------------------------------------------------------------------


@pytest.mark.parametrize("values_file", VALUES_FILES, ids=VALUES_IDS)
def test_chart_passes_helm_lint_strict(helm: Path, values_file: Path | None) -> None:
    argv = [str(helm), "lint", "--strict", str(CHART)]
    if values_file is not None:
        argv += ["--values", str(values_file)]
    result = subprocess.run(argv, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def _compute_domain_object(manifest: Manifest) -> bool:
    """Part of ComputeDomains (compute-domains.yaml), not of the kubelet plugin."""
    return "compute-domain" in manifest["metadata"]["name"] or manifest["kind"] == "CustomResourceDefinition"


def test_compute_domains_use_nvidias_names_when_deployed_as_nvidia(helm: Path) -> None:
    manifests = render(helm, {"driverName": "gpu.nvidia.com"})
    crds = of_kind(manifests, "CustomResourceDefinition")
    assert sorted(c["metadata"]["name"] for c in crds) == [
        "computedomaincliques.resource.nvidia.com",
        "computedomains.resource.nvidia.com",
    ]
    assert all([v["name"] for v in c["spec"]["versions"]] == ["v1beta1"] for c in crds)
    classes = {m["metadata"]["name"] for m in of_kind(manifests, "DeviceClass")}
    assert {"compute-domain-default-channel.nvidia.com", "compute-domain-daemon.nvidia.com"} <= classes
    (deployment,) = of_kind(manifests, "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["dra-driver", "compute-domain-controller"]
    ours = render(helm, {})
    assert sorted(c["metadata"]["name"] for c in of_kind(ours, "CustomResourceDefinition")) == [
        "computedomaincliques.resource.dra-driver.dev",
        "computedomains.resource.dra-driver.dev",
    ]


@pytest.mark.parametrize(
    ("values", "may_set"),
    [
        ({}, ["resource.dra-driver.dev/computeDomain"]),  # the defaults: ComputeDomains on, GFD labels off
        ({"nodeLabels": True}, ['k.startsWith("nvidia.com/")', "resource.dra-driver.dev/computeDomain"]),
        ({"nodeLabels": True, "computeDomains": False}, ['k.startsWith("nvidia.com/")']),
        ({"computeDomains": False}, None),
    ],
    ids=["defaults", "node-labels", "node-labels-only", "neither"],
)
def test_a_plugin_that_may_patch_nodes_is_held_to_its_own_nodes_labels(
    helm: Path, values: dict[str, Any], may_set: list[str] | None
) -> None:
    # RBAC cannot narrow a Node patch to one node or to some labels: the node policy must be there
    # whenever the plugin's role grants the patch, and allow only the labels the plugin sets.
    manifests = [m for m in render(helm, values) if not _compute_domain_object(m)]
    (role,) = of_kind(manifests, "ClusterRole")
    patches_nodes = any(
        "nodes" in rule.get("resources", []) and "patch" in rule["verbs"] for rule in role["rules"]
    )
    policies = [
        p
        for p in of_kind(manifests, "ValidatingAdmissionPolicy")
        if p["metadata"]["name"].endswith("-node-labels")
    ]
    bindings = [
        b
        for b in of_kind(manifests, "ValidatingAdmissionPolicyBinding")
        if b["spec"]["policyName"].endswith("-node-labels")
    ]
    assert patches_nodes == (may_set is not None)
    if may_set is None:
        assert not policies
        assert not bindings
        return
    (policy,) = policies
    assert [b["spec"]["validationActions"] for b in bindings] == [["Deny"]]
    labels_rule = policy["spec"]["validations"][1]["expression"]
    for allowed in may_set:
        assert allowed in labels_rule
    assert ('k.startsWith("nvidia.com/")' in labels_rule) == ("nodeLabels" in values)


def test_compute_domains_can_be_left_out(helm: Path) -> None:
    manifests = render(helm, {"computeDomainController": {"enabled": False}})
    assert not [m for m in manifests if _compute_domain_object(m)]


@pytest.mark.parametrize("values_file", VALUES_FILES, ids=VALUES_IDS)
def test_the_account_the_pods_run_as_is_the_one_bound_and_policed(
    helm: Path, values_file: Path | None
) -> None:
    manifests = [
        m
        for m in render(helm, values_file=values_file)
        # The ComputeDomain controller and the webhook run as accounts of their own.
        if not _compute_domain_object(m) and not m["metadata"]["name"].endswith("-webhook")
    ]
    given = yaml.safe_load(values_file.read_text()) if values_file else {}
    account = pod_spec(manifests)["serviceAccountName"]

    (binding,) = of_kind(manifests, "ClusterRoleBinding")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE}]
    (policy,) = [
        p
        for p in of_kind(manifests, "ValidatingAdmissionPolicy")
        if p["metadata"]["name"].endswith("-resourceslices")
    ]
    (condition,) = policy["spec"]["matchConditions"]
    assert condition["expression"] == (
        f'request.userInfo.username == "system:serviceaccount:{NAMESPACE}:{account}"'
    )
    created = [m["metadata"]["name"] for m in of_kind(manifests, "ServiceAccount")]
    assert created == ([account] if given.get("serviceAccount", {}).get("create", True) else [])


def test_device_classes_follow_the_driver_name(helm: Path) -> None:
    def classes(driver: str | None) -> dict[str, str]:
        manifests = [
            m for m in render(helm, {"driverName": driver} if driver else {}) if not _compute_domain_object(m)
        ]
        return {
            m["metadata"]["name"]: m["spec"]["selectors"][0]["cel"]["expression"]
            for m in of_kind(manifests, "DeviceClass")
        }

    assert set(classes(None)) == {"gpu.dra-driver.dev", "mig.dra-driver.dev", "maintenance.dra-driver.dev"}
    nvidia = classes("gpu.nvidia.com")
    # The names NVIDIA's driver uses, and the maintenance devices' class (not NVIDIA's).
    assert set(nvidia) == {"gpu.nvidia.com", "mig.nvidia.com", "maintenance.nvidia.com"}
    assert nvidia["gpu.nvidia.com"] == (
        'device.driver == "gpu.nvidia.com" && device.attributes["gpu.nvidia.com"].type == "gpu"'
    )
    assert nvidia["mig.nvidia.com"].endswith('.type == "mig"')
    assert set(classes("accel.example.com")) == {
        "accel.example.com",
        "mig.accel.example.com",
        "maintenance.accel.example.com",
    }


def test_nvidias_extended_resource_on_its_gpu_class_is_opt_in(helm: Path) -> None:
    """NVIDIA's chart sets extendedResourceName nvidia.com/gpu on gpu.nvidia.com; here a value asks for it,
    since pods asking for nvidia.com/gpu would otherwise also match a device plugin's resource."""

    def extended(values: dict[str, Any]) -> dict[str, str | None]:
        classes = of_kind(render(helm, {"driverName": "gpu.nvidia.com", **values}), "DeviceClass")
        return {m["metadata"]["name"]: m["spec"].get("extendedResourceName") for m in classes}

    assert set(extended({}).values()) == {None}
    opted_in = extended({"deviceClasses": {"gpu": {"extendedResourceName": "nvidia.com/gpu"}}})
    assert opted_in.pop("gpu.nvidia.com") == "nvidia.com/gpu"
    assert set(opted_in.values()) == {None}  # mig.nvidia.com, maintenance, compute domains: none


def test_one_extended_resource_is_served_by_one_class(helm: Path) -> None:
    both = {"deviceClasses": {"gpu": {"extendedResourceName": "nvidia.com/gpu"}}}
    both["deviceClasses"]["mig"] = {"extendedResourceName": "nvidia.com/gpu"}
    assert "give it to one class only" in render_error(helm, both)


def test_upgrades_never_leave_a_node_without_a_plugin(helm: Path) -> None:
    manifests = render(helm)
    (daemonset,) = of_kind(manifests, "DaemonSet")
    assert daemonset["spec"]["updateStrategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    spec = pod_spec(manifests)
    # Old and new pod side by side: sockets named per pod UID, and no host port for them to share.
    assert plugin_env(manifests)["DRA_POD_UID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.uid"
    assert not spec.get("hostNetwork")
    assert all("hostPort" not in port for port in spec["containers"][0]["ports"])
    assert spec["priorityClassName"] == "system-node-critical"


@pytest.mark.parametrize("values_file", VALUES_FILES, ids=VALUES_IDS)
def test_probes_ask_the_daemons_health_endpoint(helm: Path, values_file: Path | None) -> None:
    manifests = render(helm, values_file=values_file)
    (container,) = pod_spec(manifests)["containers"]
    address = plugin_env(manifests)["DRA_HTTP_ADDRESS"]["value"]
    (port,) = container["ports"]
    assert address.endswith(f":{port['containerPort']}")
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": port["name"]}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": port["name"]}
    for service in of_kind(manifests, "Service"):
        if service["metadata"]["name"].endswith("-webhook"):
            continue  # the webhook's own Service (test_the_webhook_service_reaches_its_pods)
        assert service["spec"]["ports"][0]["targetPort"] == port["name"]


def test_the_webhook_service_reaches_its_pods_with_the_certificate_it_names(helm: Path) -> None:
    manifests = render(helm, {"webhook": {"enabled": True}})
    deployments = of_kind(manifests, "Deployment")
    (deployment,) = [d for d in deployments if d["metadata"]["name"].endswith("-webhook")]
    (configuration,) = of_kind(manifests, "ValidatingWebhookConfiguration")
    (service,) = [s for s in of_kind(manifests, "Service") if s["metadata"]["name"].endswith("-webhook")]
    pod = deployment["spec"]["template"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert deployment["spec"]["selector"]["matchLabels"] == service["spec"]["selector"]
    (daemonset,) = of_kind(manifests, "DaemonSet")  # the plugin's selectors do not take the webhook's pods
    assert not daemonset["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    (hook,) = configuration["webhooks"]
    assert hook["clientConfig"]["service"] == {
        "name": service["metadata"]["name"],
        "namespace": NAMESPACE,
        "path": "/validate",
    }
    assert pod["spec"]["containers"][0]["command"] == ["dra-driver", "webhook"]


@pytest.mark.parametrize("values_file", VALUES_FILES, ids=VALUES_IDS)
def test_host_directories_appear_at_their_host_paths(
    helm: Path, values_file: Path | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    manifests = render(helm, values_file=values_file)
    spec = pod_spec(manifests)
    host_paths = {
        volume["name"]: volume["hostPath"]["path"] for volume in spec["volumes"] if "hostPath" in volume
    }
    mounts = {
        mount["mountPath"]: mount["name"]
        for mount in spec["containers"][0]["volumeMounts"]
        if mount["name"] in host_paths
    }
    settings = settings_from_env(plugin_env(manifests), monkeypatch, **DOWNWARD)
    # The driver root is the one exception: the host's / cannot appear at / in a container, so
    # it is mounted where DRA_DRIVER_ROOT_MOUNT tells the daemon to look.
    assert settings.driver_root_mount is not None
    assert host_paths.pop(mounts.pop(str(settings.driver_root_mount))) == str(settings.driver_root)
    assert {mounts[path]: path for path in mounts} == host_paths  # each at its own path, nothing else

    for directory in (settings.state_dir, settings.registry_dir, settings.cdi_dir):
        assert str(directory) in mounts, f"{directory} is not mounted from the host"
    assert spec["containers"][0]["securityContext"] == {
        "privileged": True,
        "readOnlyRootFilesystem": True,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def test_the_plugin_writes_only_its_own_host_directories_and_propagates_the_mps_tmpfs(helm: Path) -> None:
    """A read-only root; writable host paths: its own directory, the kubelet's registry (its
    registration socket) and the CDI directory (its specs); the MPS daemons' /dev/shm tmpfs,
    mounted under its own directory, reaches the host (issue 21: else clients bind the disk)."""
    manifests = render(helm, {"mpsShmSize": "2Gi"})
    spec = pod_spec(manifests)
    volumes = {volume["name"]: volume for volume in spec["volumes"]}
    (container,) = spec["containers"]
    writable = {
        volumes[mount["name"]]["hostPath"]["path"]
        for mount in container["volumeMounts"]
        if "hostPath" in volumes[mount["name"]] and not mount.get("readOnly")
    }
    assert writable == {
        "/var/lib/kubelet/plugins/gpu.dra-driver.dev",
        "/var/lib/kubelet/plugins/compute-domain.dra-driver.dev",
        "/var/lib/kubelet/plugins_registry",
        "/var/run/cdi",
    }
    by_path = {mount["mountPath"]: mount for mount in container["volumeMounts"]}
    assert by_path["/var/lib/kubelet/plugins/gpu.dra-driver.dev"]["mountPropagation"] == "Bidirectional"
    assert volumes[by_path["/tmp"]["name"]]["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Mi"}
    assert plugin_env(manifests)["DRA_MPS_SHM_SIZE"]["value"] == "2Gi"

    unprivileged = pod_spec(render(helm, {"securityContext": {"privileged": False}}))
    (mount,) = [m for m in unprivileged["containers"][0]["volumeMounts"] if m["name"] == "plugin-dir"]
    assert "mountPropagation" not in mount  # refused by the API server without privileged


# --- the documentation's examples ---------------------------------------------------------------------


def _example_documents() -> Iterator[tuple[Path, Manifest]]:
    for path in sorted(EXAMPLES.rglob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            if document:
                yield path, document


def _class_names(document: Any) -> Iterator[str]:
    if isinstance(document, dict):
        for key, value in document.items():
            if key == "deviceClassName":
                yield value
            else:
                yield from _class_names(value)
    elif isinstance(document, list):
        for item in document:
            yield from _class_names(item)


# Classes another driver installs: docs/examples/topology/gpu-and-nic.yaml pairs our GPU with a NIC
# driver's device (e2e/test_topology.py installs it with a fake NIC driver of its own).
OTHER_DRIVERS_CLASSES = {"nic.example.com"}


def test_examples_use_the_device_classes_the_chart_installs(helm: Path) -> None:
    ours = {m["metadata"]["name"]: m for m in of_kind(render(helm), "DeviceClass")}
    # What examples/nvidia/ are written for: NVIDIA's names, nvidia.com/gpu as NVIDIA's chart sets it,
    # and its PassthroughSupport gate (passthrough.yaml).
    as_nvidia = render(
        helm,
        {
            "driverName": "gpu.nvidia.com",
            "deviceClasses": {"gpu": {"extendedResourceName": "nvidia.com/gpu"}},
            "featureGates": {"PassthroughSupport": True},
        },
    )
    nvidias = {m["metadata"]["name"]: m for m in of_kind(as_nvidia, "DeviceClass")}
    documents = list(_example_documents())
    assert documents, f"no examples under {EXAMPLES}"
    for path, document in documents:
        installed = nvidias if path.parent.name == "nvidia" else ours
        for name in set(_class_names(document)) - OTHER_DRIVERS_CLASSES:
            assert name in installed, f"{path.relative_to(REPO_ROOT)} asks for DeviceClass {name}"
        if document["kind"] == "DeviceClass":  # for clusters without the chart: the same class
            name = document["metadata"]["name"]
            assert json.loads(json.dumps(document["spec"])) == installed[name]["spec"], path


def test_the_plugins_selector_takes_no_other_pod_of_the_chart(helm: Path) -> None:
    manifests = render(helm, {"webhook": {"enabled": True}})
    (daemonset,) = of_kind(manifests, "DaemonSet")
    plugin = daemonset["spec"]["selector"]["matchLabels"].items()
    deployments = of_kind(manifests, "Deployment")
    assert len(deployments) == 2  # the webhook and the ComputeDomain controller
    for deployment in deployments:
        labels = deployment["spec"]["template"]["metadata"]["labels"].items()
        assert not plugin <= labels, deployment["metadata"]["name"]


def test_the_default_namespace_is_refused_unless_allowed(helm: Path) -> None:
    assert "refusing to install into the namespace default" in render_error(helm, {}, namespace="default")
    argv = [str(helm), "template", "gpu", str(CHART), "--namespace", "default"]
    allowed = subprocess.run(
        [*argv, "--set", "allowDefaultNamespace=true"], capture_output=True, text=True, check=False
    )
    assert allowed.returncode == 0, allowed.stderr
    elsewhere = subprocess.run(
        [*argv, "--set", "namespaceOverride=gpu-operator"], capture_output=True, text=True, check=False
    )
    assert elsewhere.returncode == 0, elsewhere.stderr
    rendered = [d for d in yaml.safe_load_all(elsewhere.stdout) if d]
    namespaces = {d["metadata"].get("namespace") for d in rendered}
    assert namespaces == {"gpu-operator", "default", None}  # cluster-scoped objects have none
    # The one exception: the plugin's right to post Events about its Node, which the API server
    # keeps only in default (or kube-system).
    in_default = {
        (d["kind"], d["metadata"]["name"]) for d in rendered if d["metadata"].get("namespace") == "default"
    }
    assert in_default == {
        ("Role", "gpu-dra-driver-gpu-node-events"),
        ("RoleBinding", "gpu-dra-driver-gpu-node-events"),
    }


def test_name_overrides_rename_every_object_and_keep_the_selector_consistent(helm: Path) -> None:
    manifests = render(helm, {"fullnameOverride": "gpu-driver"})
    (daemonset,) = of_kind(manifests, "DaemonSet")
    assert daemonset["metadata"]["name"] == "gpu-driver"
    assert pod_spec(manifests)["serviceAccountName"] == "gpu-driver"
    renamed = render(helm, {"nameOverride": "nvidia-dra"})
    (daemonset,) = of_kind(renamed, "DaemonSet")
    labels = daemonset["spec"]["template"]["metadata"]["labels"]
    assert labels["app.kubernetes.io/name"] == "nvidia-dra"
    assert daemonset["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_the_compute_domain_drivers_socket_directory_is_the_hosts(helm: Path) -> None:
    """The second driver serves the kubelet from <pluginsDir>/compute-domain.<domain>: a host path."""
    for values, directory in (
        ({"driverName": "gpu.nvidia.com"}, "/var/lib/kubelet/plugins/compute-domain.nvidia.com"),
        ({}, "/var/lib/kubelet/plugins/compute-domain.dra-driver.dev"),
    ):
        spec = pod_spec(render(helm, values))
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes["compute-domain-plugin-dir"]["hostPath"]["path"] == directory
        (container,) = spec["containers"]
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        assert mounts["compute-domain-plugin-dir"] == directory
    spec = pod_spec(render(helm, {"computeDomains": False}))
    assert "compute-domain-plugin-dir" not in {v["name"] for v in spec["volumes"]}


# --- featureGates -------------------------------------------------------------------------------------

# The chart's own gates, each named after the value (and so the setting) it switches.
GATED_VALUES = {
    "ComputeDomains": "computeDomains",
    "MaintenanceDevices": "maintenanceDevices",
    "NodeLabels": "nodeLabels",
    "DeviceMetadata": "deviceMetadata",
}
# NVIDIA's gates for what this driver always does: true is accepted, false refused.
ALWAYS_ON = ("TimeSlicingSettings", "NVMLDeviceHealthCheck", "ComputeDomainCliques")


def test_feature_gates_are_named_after_settings_or_are_nvidias() -> None:
    gates = set(LEAVES["featureGates"]["propertyNames"]["enum"])
    nvidias = {
        "DynamicMIG",
        "MPSSupport",
        "PassthroughSupport",
        "IMEXDaemonsWithDNSNames",
        "HostManagedIMEXDaemon",
    }
    assert gates == {*GATED_VALUES, *nvidias, *ALWAYS_ON}
    for gate, value in GATED_VALUES.items():
        assert gate == value[0].upper() + value[1:]
        assert value in SETTING_OF_VALUE, f"{gate} switches {value}, which is no setting of the daemon"


@pytest.mark.parametrize("enabled", [True, False])
@pytest.mark.parametrize(("gate", "value"), GATED_VALUES.items())
def test_a_feature_gate_does_what_its_value_does_and_wins_over_it(
    helm: Path, gate: str, value: str, enabled: bool
) -> None:
    by_gate = render(helm, {value: not enabled, "featureGates": {gate: enabled}})

    assert by_gate == render(helm, {value: enabled})
    assert plugin_env(by_gate)[env_name(SETTING_OF_VALUE[value])]["value"] == str(enabled).lower()


@pytest.mark.parametrize(
    ("values", "mig_partitions"),
    [
        ({"featureGates": {"DynamicMIG": False}}, "none"),
        ({"migPartitions": "none", "featureGates": {"DynamicMIG": True}}, "all"),
        ({"migPartitions": "0,1", "featureGates": {"DynamicMIG": True}}, "0,1"),
    ],
)
def test_nvidias_dynamic_mig_gate_sets_mig_partitions(
    helm: Path, values: dict[str, Any], mig_partitions: str
) -> None:
    by_gate = render(helm, values)

    assert plugin_env(by_gate)["DRA_MIG_PARTITIONS"]["value"] == mig_partitions
    assert by_gate == render(helm, {"migPartitions": mig_partitions})


def test_under_nvidias_name_dynamic_mig_true_means_every_gpu(helm: Path) -> None:
    """The default, auto, is mig-mode under gpu.nvidia.com (docs/maintenance.md); the gate asks for all."""
    as_nvidia = {"driverName": "gpu.nvidia.com"}
    assert plugin_env(render(helm, as_nvidia))["DRA_MIG_PARTITIONS"]["value"] == "auto"
    by_gate = render(helm, {**as_nvidia, "featureGates": {"DynamicMIG": True}})
    assert plugin_env(by_gate)["DRA_MIG_PARTITIONS"]["value"] == "all"


def test_nvidias_gates_for_what_the_driver_always_does_are_accepted(helm: Path) -> None:
    gates = {
        **dict.fromkeys(ALWAYS_ON, True),
        "MPSSupport": True,
        "PassthroughSupport": False,
        "IMEXDaemonsWithDNSNames": True,
        "HostManagedIMEXDaemon": False,  # the default: driver-managed IMEX daemons
    }
    assert render(helm, {"featureGates": gates}) == render(helm)


def test_without_nvidias_mps_gate_the_plugin_may_create_no_deployments(helm: Path) -> None:
    # As NVIDIA's chart: Deployments (the MPS control daemons) only with MPS; the daemon then
    # gets no MPS image, and refuses MPS claims on a real node.
    def deployment_rules(manifests: list[Manifest]) -> list[dict[str, Any]]:
        return [
            rule
            for role in of_kind(manifests, "Role") + of_kind(manifests, "ClusterRole")
            if not _compute_domain_object(role)
            for rule in role["rules"]
            if "deployments" in rule.get("resources", [])
        ]

    with_mps, without = render(helm), render(helm, {"featureGates": {"MPSSupport": False}})
    assert deployment_rules(with_mps)
    assert plugin_env(with_mps)["DRA_MPS_DAEMON_IMAGE"]["value"]
    assert _policy(with_mps, "-mps-daemons")
    assert not deployment_rules(without)
    assert plugin_env(without)["DRA_MPS_DAEMON_IMAGE"]["value"] == ""
    assert not [
        p
        for p in of_kind(without, "ValidatingAdmissionPolicy")
        if p["metadata"]["name"].endswith("-mps-daemons")
    ]
    assert not [b for b in of_kind(without, "RoleBinding") if b["metadata"]["name"].endswith("-mps")]


@pytest.mark.parametrize("gate", ALWAYS_ON)
def test_switching_off_what_the_driver_always_does_is_refused_with_the_reason(helm: Path, gate: str) -> None:
    error = render_error(helm, {"featureGates": {gate: False}})
    assert f"featureGates.{gate}=false: this driver always serves" in error


@pytest.mark.parametrize("enabled", [True, False])
def test_nvidias_passthrough_gate_sets_passthrough_and_brings_nvidias_class(
    helm: Path, enabled: bool
) -> None:
    as_nvidia = {"driverName": "gpu.nvidia.com"}
    by_gate = render(
        helm, {**as_nvidia, "passthrough": not enabled, "featureGates": {"PassthroughSupport": enabled}}
    )

    assert by_gate == render(helm, {**as_nvidia, "passthrough": enabled})
    assert plugin_env(by_gate)["DRA_PASSTHROUGH"]["value"] == str(enabled).lower()
    classes = {c["metadata"]["name"]: c for c in of_kind(by_gate, "DeviceClass")}
    assert ("vfio.gpu.nvidia.com" in classes) is enabled
    if enabled:
        (selector,) = classes["vfio.gpu.nvidia.com"]["spec"]["selectors"]
        assert selector["cel"]["expression"] == (
            'device.driver == "gpu.nvidia.com" && device.attributes["gpu.nvidia.com"].type == "vfio"'
        )


def controller_env(manifests: list[Manifest]) -> dict[str, Any]:
    (deployment,) = [
        d for d in of_kind(manifests, "Deployment") if d["metadata"]["name"].endswith("-controller")
    ]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e for e in container["env"]}


def test_nvidias_dns_names_gate_wins_over_its_value_and_reaches_the_controller(helm: Path) -> None:
    assert controller_env(render(helm))["DRA_IMEX_DAEMONS_WITH_DNS_NAMES"]["value"] == "true"
    off = {"computeDomainController": {"imexDaemonsWithDNSNames": False}}
    assert controller_env(render(helm, off))["DRA_IMEX_DAEMONS_WITH_DNS_NAMES"]["value"] == "false"
    by_gate = render(helm, {**off, "featureGates": {"IMEXDaemonsWithDNSNames": True}})
    assert by_gate == render(helm)
    assert render(helm, {"featureGates": {"IMEXDaemonsWithDNSNames": False}}) == render(helm, off)


@pytest.mark.parametrize("enabled", [True, False])
def test_nvidias_host_managed_imex_gate_wins_over_its_value_and_reaches_plugin_and_controller(
    helm: Path, enabled: bool
) -> None:
    by_gate = render(
        helm, {"hostManagedImex": not enabled, "featureGates": {"HostManagedIMEXDaemon": enabled}}
    )

    assert by_gate == render(helm, {"hostManagedImex": enabled})
    assert plugin_env(by_gate)["DRA_HOST_MANAGED_IMEX"]["value"] == str(enabled).lower()
    assert controller_env(by_gate)["DRA_HOST_MANAGED_IMEX"]["value"] == str(enabled).lower()


def test_with_host_managed_imex_no_daemon_may_run_and_the_controller_may_create_no_daemonsets(
    helm: Path,
) -> None:
    def granted(manifests: list[Manifest]) -> set[str]:
        """What the chart's Roles and ClusterRoles grant on, by resource."""
        return {
            resource
            for role in of_kind(manifests, "Role") + of_kind(manifests, "ClusterRole")
            for rule in role["rules"]
            for resource in rule.get("resources", [])
        }

    def names(manifests: list[Manifest]) -> set[str]:
        return {m["metadata"]["name"] for m in manifests}

    driver_managed = render(helm)
    host_managed = render(helm, {"featureGates": {"HostManagedIMEXDaemon": True}})

    assert {"daemonsets", "computedomaincliques"} <= granted(driver_managed)
    assert not {"daemonsets", "computedomaincliques"} & granted(host_managed)
    assert "compute-domain-daemon" in names(of_kind(driver_managed, "ServiceAccount"))
    assert "compute-domain-daemon" not in names(of_kind(host_managed, "ServiceAccount"))
    gone = names(driver_managed) - names(host_managed)
    assert gone == {
        "compute-domain-daemon",
        "compute-domain-daemon.dra-driver.dev",
        "gpu-dra-driver-gpu-compute-domain-daemon",
        # The policies of writes no account may make then (the DaemonSets, the clique entries).
        "gpu-dra-driver-gpu-cd-daemonsets",
        "gpu-dra-driver-gpu-cd-cliques",
    }
    # The controller's templates ask for the channel alone: no daemon is claimed.
    assert "compute-domain-daemon." in _cel(_policy(driver_managed, "-cd-templates"))
    assert "compute-domain-daemon." not in _cel(_policy(host_managed, "-cd-templates"))
    # What stays: the CRDs, the channel's DeviceClass and the controller with its Lease.
    assert "compute-domain-default-channel.dra-driver.dev" in names(of_kind(host_managed, "DeviceClass"))
    assert "leases" in granted(host_managed)


def test_an_unknown_feature_gate_is_refused(helm: Path) -> None:
    error = render_error(helm, {"featureGates": {"NoSuchGate": True}})
    assert "invalid propertyName 'NoSuchGate'" in error
    assert "value must be one of 'ComputeDomains', 'MaintenanceDevices', 'NodeLabels'" in error


def test_the_webhook_may_only_read_slices_and_classes_with_an_account_of_its_own(helm: Path) -> None:
    manifests = render(helm, {"webhook": {"enabled": True}})
    (deployment,) = [
        d for d in of_kind(manifests, "Deployment") if d["metadata"]["name"].endswith("-webhook")
    ]
    pod = deployment["spec"]["template"]["spec"]
    account = pod["serviceAccountName"]
    assert pod.get("automountServiceAccountToken", True) is True  # it lists and watches
    (binding,) = [b for b in of_kind(manifests, "ClusterRoleBinding") if b["subjects"][0]["name"] == account]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE}]
    (role,) = [
        r for r in of_kind(manifests, "ClusterRole") if r["metadata"]["name"] == binding["roleRef"]["name"]
    ]
    assert role["rules"] == [
        {
            "apiGroups": ["resource.k8s.io"],
            "resources": ["resourceslices", "deviceclasses"],
            "verbs": ["list", "watch"],
        }
    ]
    # No other role names the webhook's account.
    bound = [
        s
        for kind in ("ClusterRoleBinding", "RoleBinding")
        for b in of_kind(manifests, kind)
        for s in b["subjects"]
    ]
    assert sum(s["name"] == account for s in bound) == 1


def test_an_image_digest_pins_every_container_of_the_driver(helm: Path) -> None:
    """image.digest set: the plugin, the webhook, the compute-domain controller and the MPS daemons
    (the plugin's own image by default) all run repository@digest; the tag is not used."""
    digest = "sha256:" + "ab" * 32
    values = {
        "image": {"repository": "registry.example.com/gpu", "tag": "moved", "digest": digest},
        "webhook": {"enabled": True},
    }
    manifests = render(helm, values)
    images = {
        container["image"]
        for manifest in manifests
        if manifest["kind"] in ("DaemonSet", "Deployment")
        for container in manifest["spec"]["template"]["spec"]["containers"]
    }
    mps_image = plugin_env(manifests)["DRA_MPS_DAEMON_IMAGE"]["value"]
    assert images | {mps_image} == {f"registry.example.com/gpu@{digest}"}
    assert len(of_kind(manifests, "Deployment")) == 2  # the webhook and the compute-domain controller
    with_tag = render(helm, {"image": {"repository": "registry.example.com/gpu", "tag": "moved"}})
    assert pod_spec(with_tag)["containers"][0]["image"] == "registry.example.com/gpu:moved"


def test_an_image_digest_that_is_not_sha256_is_refused(helm: Path) -> None:
    assert "digest" in render_error(helm, {"image": {"digest": "latest"}})


def test_metrics_leave_the_pod_only_when_asked_and_then_behind_a_network_policy(helm: Path) -> None:
    default = render(helm)
    assert plugin_env(default)["DRA_METRICS_PUBLIC"]["value"] == "false"
    assert of_kind(default, "NetworkPolicy") == []
    # The Service would send Prometheus to an endpoint that refuses it: said at install, not later.
    assert "needs metricsPublic=true" in render_error(helm, {"metricsService": {"enabled": True}})

    scrapers = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "observability"}}}]
    public = render(
        helm,
        {
            "metricsPublic": True,
            "httpAddress": "0.0.0.0:9400",
            "metricsService": {"enabled": True},
            "metricsNetworkPolicy": {"from": scrapers},
        },
    )
    assert plugin_env(public)["DRA_METRICS_PUBLIC"]["value"] == "true"
    (policy,) = of_kind(public, "NetworkPolicy")
    (daemonset,) = of_kind(public, "DaemonSet")
    assert policy["spec"]["podSelector"]["matchLabels"] == daemonset["spec"]["selector"]["matchLabels"]
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert policy["spec"]["ingress"] == [{"from": scrapers, "ports": [{"port": 9400, "protocol": "TCP"}]}]
    unguarded = render(helm, {"metricsPublic": True, "metricsNetworkPolicy": {"enabled": False}})
    assert of_kind(unguarded, "NetworkPolicy") == []


def _webhook_objects(manifests: list[Manifest], kind: str) -> list[Manifest]:
    return [
        m for m in of_kind(manifests, kind) if m["metadata"]["name"].startswith("gpu-dra-driver-gpu-webhook")
    ]


def test_an_enabled_webhook_fails_closed_with_two_replicas_and_a_disruption_budget(helm: Path) -> None:
    manifests = render(helm, {"webhook": {"enabled": True}})
    (configuration,) = of_kind(manifests, "ValidatingWebhookConfiguration")
    (hook,) = configuration["webhooks"]
    assert hook["failurePolicy"] == "Fail"
    (deployment,) = _webhook_objects(manifests, "Deployment")
    assert deployment["spec"]["replicas"] == 2
    (budget,) = of_kind(manifests, "PodDisruptionBudget")
    assert budget["spec"]["maxUnavailable"] == 1
    assert budget["spec"]["selector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    spread = deployment["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    assert spread["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"]["topologyKey"] == (
        "kubernetes.io/hostname"
    )
    # Installed together with the webhook, before its pods answer: the chart's own DeviceClasses
    # are not sent to it, so `helm install` does not fail closed on itself.
    (exempt,) = hook["objectSelector"]["matchExpressions"]
    assert exempt == {"key": "app.kubernetes.io/instance", "operator": "NotIn", "values": ["gpu"]}
    for device_class in of_kind(manifests, "DeviceClass"):
        assert device_class["metadata"]["labels"]["app.kubernetes.io/instance"] == "gpu"
    one = render(helm, {"webhook": {"enabled": True, "replicas": 1}})
    assert of_kind(one, "PodDisruptionBudget") == []  # a budget of one replica would block every drain


def test_the_webhooks_ca_is_the_charts_secret_or_cert_managers(helm: Path) -> None:
    own = render(helm, {"webhook": {"enabled": True}})
    (ca,) = [s for s in of_kind(own, "Secret") if s["metadata"]["name"] == "gpu-dra-driver-gpu-webhook-ca"]
    (hook,) = of_kind(own, "ValidatingWebhookConfiguration")[0]["webhooks"]
    assert hook["clientConfig"]["caBundle"] == ca["data"]["tls.crt"]
    assert of_kind(own, "Certificate") == []

    managed = render(helm, {"webhook": {"enabled": True, "certManager": {"enabled": True}}})
    assert [s for s in of_kind(managed, "Secret") if "webhook" in s["metadata"]["name"]] == []
    (configuration,) = of_kind(managed, "ValidatingWebhookConfiguration")
    assert "caBundle" not in configuration["webhooks"][0]["clientConfig"]
    assert configuration["metadata"]["annotations"] == {
        "cert-manager.io/inject-ca-from": f"{NAMESPACE}/gpu-dra-driver-gpu-webhook"
    }
    serving = [c for c in of_kind(managed, "Certificate") if not c["spec"].get("isCA")]
    assert [c["spec"]["issuerRef"] for c in serving] == [
        {"name": "gpu-dra-driver-gpu-webhook-ca", "kind": "Issuer"}
    ]
    assert serving[0]["spec"]["secretName"] == "gpu-dra-driver-gpu-webhook"

    issuer = {"name": "cluster-ca", "kind": "ClusterIssuer"}
    named = render(
        helm, {"webhook": {"enabled": True, "certManager": {"enabled": True, "issuerRef": issuer}}}
    )
    assert [c["spec"]["issuerRef"] for c in of_kind(named, "Certificate")] == [issuer]
    assert of_kind(named, "Issuer") == []


def _policy(manifests: list[Manifest], suffix: str) -> Manifest:
    (policy,) = [
        p for p in of_kind(manifests, "ValidatingAdmissionPolicy") if p["metadata"]["name"].endswith(suffix)
    ]
    return policy


def _cel(policy: Manifest) -> str:
    """Every expression of a policy, as one text."""
    spec = policy["spec"]
    parts = [*spec.get("matchConditions", []), *spec.get("variables", []), *spec["validations"]]
    return "\n".join(str(part.get("expression", "")) for part in parts)


@pytest.mark.parametrize(
    "values",
    [
        {},
        {
            "mpsDaemonImage": "registry.example/mps:1",
            "pluginsDir": "/k/plugins/",
            "driverRoot": "/run/nvidia/driver/",
        },
    ],
    ids=["defaults", "moved"],
)
def test_the_write_policies_admit_the_image_and_host_paths_the_chart_deploys(
    helm: Path, values: dict[str, Any]
) -> None:
    # The MPS daemons' and the IMEX daemons' policies name the image and host paths the chart hands
    # the plugin and the controller: were they to drift apart, the driver's own writes would be refused.
    manifests = render(helm, values)
    env = plugin_env(manifests)
    mps = _cel(_policy(manifests, "-mps-daemons"))
    assert f'"{env["DRA_MPS_DAEMON_IMAGE"]["value"]}"' in mps
    volumes = {v["name"]: v["hostPath"]["path"] for v in pod_spec(manifests)["volumes"] if "hostPath" in v}
    # As the daemon names them (dra_driver/node/sharing/mps_deployment.py: pathlib paths).
    assert f'"{Path(volumes["plugin-dir"])}/mps/" + variables.id + "/pipe"' in mps
    assert f'"driver-root": "{Path(volumes["driver-root"])}"' in mps

    (controller,) = [
        d for d in of_kind(manifests, "Deployment") if "compute-domain-controller" in d["metadata"]["name"]
    ]
    container = controller["spec"]["template"]["spec"]["containers"][0]
    daemon_image = next(e["value"] for e in container["env"] if e["name"] == "DRA_DAEMON_IMAGE")
    account = controller["spec"]["template"]["spec"]["serviceAccountName"]
    for suffix in ("-cd-daemonsets", "-cd-templates", "-cd-cliques"):
        assert f"system:serviceaccount:{NAMESPACE}:{account}" in _cel(_policy(manifests, suffix))
    assert f'"{daemon_image}"' in _cel(_policy(manifests, "-cd-daemonsets"))


def test_every_write_policy_is_bound_to_deny(helm: Path) -> None:
    manifests = render(helm, {"nodeLabels": True})
    policies = {p["metadata"]["name"] for p in of_kind(manifests, "ValidatingAdmissionPolicy")}
    bindings = {
        b["spec"]["policyName"]: b["spec"]["validationActions"]
        for b in of_kind(manifests, "ValidatingAdmissionPolicyBinding")
    }
    suffixes = ("-resourceslices", "-node-labels", "-mps-daemons", "-claim-status", "-cd-daemonsets")
    assert all(
        any(name.endswith(s) for name in policies) for s in (*suffixes, "-cd-templates", "-cd-cliques")
    )
    assert bindings == {name: ["Deny"] for name in policies}
    assert all(p["spec"]["failurePolicy"] == "Fail" for p in of_kind(manifests, "ValidatingAdmissionPolicy"))
    assert not [
        m
        for m in render(helm, {"admissionPolicy": {"enabled": False}})
        if "AdmissionPolicy" in m["kind"] and not m["metadata"]["name"].endswith("-maintenance")
    ]
