"""The user-facing example manifests under docs/examples, applied the way a user applies them.

Tests create exactly what the documentation shows, so an example that stops working fails a test.
"""

from __future__ import annotations

import contextlib
import copy
import subprocess
from collections.abc import Iterable, Iterator
from pathlib import Path

import yaml

from e2e.cluster import JsonObject, RestClient
from e2e.cluster.binaries import REPO_ROOT, build_outputs

EXAMPLES = REPO_ROOT / "docs" / "examples"
DEMO = EXAMPLES / "demo"

# kind -> (API path prefix, plural, namespaced) for the kinds the examples use.
_KINDS: dict[str, tuple[str, str, bool]] = {
    "DeviceClass": ("/apis/resource.k8s.io/v1", "deviceclasses", False),
    "ResourceClaim": ("/apis/resource.k8s.io/v1", "resourceclaims", True),
    "ResourceClaimTemplate": ("/apis/resource.k8s.io/v1", "resourceclaimtemplates", True),
    "ResourceSlice": ("/apis/resource.k8s.io/v1", "resourceslices", False),
    "Pod": ("/api/v1", "pods", True),
    "ValidatingAdmissionPolicy": (
        "/apis/admissionregistration.k8s.io/v1",
        "validatingadmissionpolicies",
        False,
    ),
    "ValidatingAdmissionPolicyBinding": (
        "/apis/admissionregistration.k8s.io/v1",
        "validatingadmissionpolicybindings",
        False,
    ),
}


def load(path: Path) -> list[JsonObject]:
    """The objects of a multi-document YAML file, in order."""
    with path.open() as stream:
        return [document for document in yaml.safe_load_all(stream) if document]


def collection(kind: str, namespace: str | None = None) -> str:
    prefix, plural, namespaced = _KINDS[kind]
    if not namespaced:
        return f"{prefix}/{plural}"
    if namespace is None:
        raise ValueError(f"a {kind} lives in a namespace; name one")
    return f"{prefix}/namespaces/{namespace}/{plural}"


def object_path(obj: JsonObject, namespace: str | None = None) -> str:
    return f"{collection(obj['kind'], namespace)}/{obj['metadata']['name']}"


def pinned(objects: Iterable[JsonObject], node_name: str) -> list[JsonObject]:
    """Copies in which every Pod may only be scheduled onto `node_name` (by its hostname label).

    Other tests' nodes publish devices of the same driver; a selector keeps each test's pods where it
    looks for them, and still lets the scheduler do the allocation (`nodeName` would bypass it).
    """
    result = []
    for obj in objects:
        obj = copy.deepcopy(obj)
        if obj["kind"] == "Pod":
            obj["spec"].setdefault("nodeSelector", {})["kubernetes.io/hostname"] = node_name
        result.append(obj)
    return result


@contextlib.contextmanager
def created(rest: RestClient, objects: list[JsonObject]) -> Iterator[None]:
    """Cluster-scoped ``objects`` (DeviceClasses, say) created for the block, then deleted."""
    for item in objects:
        rest.create(collection(item["kind"]), item)
    try:
        yield
    finally:
        for item in objects:
            rest.delete(object_path(item))


def apply(rest: RestClient, objects: Iterable[JsonObject], namespace: str) -> list[JsonObject]:
    """Creates the objects (namespaced ones in `namespace`) in order; returns them as stored."""
    return [rest.create(collection(obj["kind"], namespace), obj) for obj in objects]


def of_kind(objects: Iterable[JsonObject], kind: str) -> list[JsonObject]:
    return [obj for obj in objects if obj["kind"] == kind]


def apply_example(rest: RestClient, path: Path, namespace: str, *, node_name: str) -> list[JsonObject]:
    """Applies an example file into `namespace` with its Pods kept to `node_name` (see `pinned`)."""
    return apply(rest, pinned(load(path), node_name), namespace)


CRDS = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"


def wait_established(rest: RestClient, crd: str) -> None:
    """Until the CustomResourceDefinition ``crd`` is Established (its ``status.conditions`` are
    null, not absent, for a moment after its creation)."""
    rest.wait_for(
        CRDS,
        crd,
        lambda o: any(
            c["type"] == "Established" and c["status"] == "True"
            for c in (o.get("status") or {}).get("conditions") or []
        ),
    )


def rendered_chart(release: str, namespace: str, *values: str) -> list[JsonObject]:
    """The chart's objects as ``helm template <release> --namespace <namespace> --set <value>...``
    renders them (the release names the objects)."""
    helm = Path(build_outputs("helm")["HELM_BIN_DIR"]) / "helm"
    chart = REPO_ROOT / "charts" / "dra-driver-gpu"
    argv = [str(helm), "template", release, str(chart), "--namespace", namespace]
    for value in values:
        argv += ["--set", value]
    rendered = subprocess.run(argv, check=True, capture_output=True, text=True, timeout=120).stdout
    return [obj for obj in yaml.safe_load_all(rendered) if obj]
