"""The attempts, the positive controls, and how each is judged.

Every attack is sent twice, as the stolen credential would be used: with a real token of the
chart's account (TokenRequest, bound to a Pod on node A where the account runs in one), and by the
admin impersonating that account with the node-name extra a pod-bound token carries. Both must get
the same verdict (``mismatches``). Attacks are dry runs (``dryRun=All``): the API server
authenticates, authorizes and admits them exactly as real writes, stores nothing, and the next
attempt finds the cluster unchanged. A 403 is "refused"; a 2xx "succeeded" (the goal is 0 for
every kind); anything else is an "error" of the suite itself (an attack the server refused for a
reason other than permission tests nothing). Each refusal names who refused it: RBAC or a policy;
an attempt that names the policy it is for must be refused by that policy.

The positive controls are real writes, with the pod-bound tokens, of exactly what the driver writes
(built by the driver's own functions): they must succeed, so the policies refuse only the attacks.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import re
import subprocess
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml
from kubernetes.aio.client import ApiClient, Configuration

from dra_driver.computedomain.api import Names, parse_compute_domain
from dra_driver.computedomain.controller.objects import channel_template, daemon_object_name, daemon_set
from dra_driver.node.binding import WaitingDevice, condition_entries
from dra_driver.node.claim_status import ApiServerClaimStatus
from dra_driver.node.sharing.mps import MpsDaemonSpec, MpsDevice, MpsPaths
from dra_driver.node.sharing.mps_deployment import deployment_manifest
from dra_driver.node.types import ClaimRef
from e2e import manifests
from e2e.cluster import ApiError, ClusterInfo, JsonObject, RestClient, create_fake_node
from e2e.cluster.binaries import REPO_ROOT, build_outputs
from e2e.cluster.tokens import mint_service_account_token
from e2e.security import tenant

CHART = REPO_ROOT / "charts" / "dra-driver-gpu"
RELEASE = "sec"
NAMESPACE = "dra-security"
TENANT = "sec-tenant"
ADMIN_NAMESPACE = "sec-tenant-admin"  # labelled for admin access by the administrator
DRIVER = "gpu.security-e2e.dra-driver.dev"
NAMES = Names(DRIVER)
FULLNAME = f"{RELEASE}-dra-driver-gpu"
PLUGIN_ACCOUNT = FULLNAME
CONTROLLER_ACCOUNT = f"{FULLNAME}-compute-domain-controller"
DAEMON_ACCOUNT = "compute-domain-daemon"
WEBHOOK_ACCOUNT = f"{FULLNAME}-webhook"
NODE_A = "sec-node-a"
NODE_B = "sec-node-b"
PLUGINS_DIR = "/var/lib/kubelet/plugins"
IMAGE = "localhost/dra-driver-gpu:0.1.0"  # replaced by the chart's image at setup
NODE_NAME_EXTRA = "authentication.kubernetes.io/node-name"

RESOURCE = "/apis/resource.k8s.io/v1"
SLICES = f"{RESOURCE}/resourceslices"
DEPLOYMENTS = f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments"
DAEMONSETS = f"/apis/apps/v1/namespaces/{NAMESPACE}/daemonsets"
CLIQUES = f"/apis/{NAMES.api_version}/namespaces/{NAMESPACE}/computedomaincliques"
MERGE = "application/merge-patch+json"
DRY_RUN = {"dryRun": "All"}
# Kubernetes 1.36+ refuse a plugin's claim status writes beyond its node themselves (associated-node,
# resourceclaims/binding) before any policy runs; on 1.34/1.35 the chart's policy must.
CLAIM_STATUS = "claim-status|api-server"
GOALS = ("succeeded", "errors", "mismatches", "wrong_refuser")  # each must be 0


@dataclass(frozen=True)
class Attempt:
    kind: str  # e.g. plugin.deployments: whose account, which resource
    what: str
    call: Callable[[RestClient], object]
    # Who must refuse it: a policy's name suffix, "rbac" or "api-server" (alternatives split by
    # "|"); "": anyone may.
    policy: str = ""
    # An attempt the API server's validation must refuse (422 Invalid, e.g. a field over its limit).
    invalid_is_refused: bool = False


@dataclass(frozen=True)
class Control:
    kind: str
    what: str
    call: Callable[[], object]


@dataclass
class Figures:
    kinds: dict[str, dict[str, int]] = field(default_factory=dict)
    attempts: list[JsonObject] = field(default_factory=list)
    controls: list[JsonObject] = field(default_factory=list)
    policies: dict[str, JsonObject] = field(default_factory=dict)

    def as_json(self) -> JsonObject:
        totals = {
            key: sum(kind[key] for kind in self.kinds.values()) for key in ("attempts", "refused", *GOALS)
        }
        return {
            "totals": totals,
            "kinds": self.kinds,
            "controls": {
                "passed": sum(1 for c in self.controls if c["ok"]),
                "failed": sum(1 for c in self.controls if not c["ok"]),
                "list": self.controls,
            },
            "policies": self.policies,
            "attempts": self.attempts,
        }


def missed_goals(report: JsonObject) -> list[str]:
    """Every goal missed: an attack not refused, an attack refused by the wrong check, a credential
    judged differently from the other, a failed positive control, a policy unbound or ill-typed."""
    missed = [f"{key}: {report['totals'][key]} (goal 0)" for key in GOALS if report["totals"][key]]
    for attempt in report["attempts"]:
        if set(attempt["verdicts"].values()) != {"refused"}:
            missed.append(f"{attempt['kind']}: {attempt['what']}: {attempt['verdicts']} {attempt['details']}")
        elif attempt["wrong_refuser"]:
            missed.append(f"{attempt['kind']}: {attempt['what']}: refused by {attempt['refusers']}")
    missed += [
        f"control failed: {c['kind']}: {c['what']}: {c['error']}"
        for c in report["controls"]["list"]
        if not c["ok"]
    ]
    for name, policy in report["policies"].items():
        if not policy["bound"] or policy["warnings"]:
            missed.append(f"policy {name}: bound={policy['bound']} warnings={policy['warnings']}")
    return missed


# --- verdicts -------------------------------------------------------------------------------------

_POLICY = re.compile(r"ValidatingAdmissionPolicy '([^']+)'")


def verdict(
    call: Callable[[RestClient], object], client: RestClient, invalid_is_refused: bool = False
) -> tuple[str, str, str]:
    """(refused | succeeded | error, who refused: a policy's name or "rbac", the server's message)."""
    try:
        call(client)
    except ApiError as error:
        if error.status == 403:
            match = _POLICY.search(error.message)
            return "refused", match.group(1) if match else "rbac", error.message
        if error.status == 422 and ("Forbidden: " in error.message or invalid_is_refused):
            # The API server's own permission checks of a field (1.36+: a claim's status, which
            # needs resourceclaims/binding or resourceclaims/driver; admin access, which needs the
            # namespace label) answer 422 with a Forbidden cause.
            return "refused", "api-server", error.message
        return "error", "", f"HTTP {error.status}: {error.message}"
    return "succeeded", "", ""


def refused_by(attempt: Attempt, refuser: str) -> bool:
    """Whether `refuser` (a policy's name, "rbac" or "api-server") is one the attempt is for."""
    return any(refuser.endswith(wanted) for wanted in attempt.policy.split("|"))


def run_attempts(
    identities: dict[str, dict[str, RestClient]], attempts: list[tuple[str, Attempt]]
) -> Figures:
    figures = Figures()
    for identity, attempt in attempts:
        results = {
            how: verdict(attempt.call, client, attempt.invalid_is_refused)
            for how, client in identities[identity].items()
        }
        verdicts = {how: result[0] for how, result in results.items()}
        refusers = {how: result[1] for how, result in results.items() if result[0] == "refused"}
        wrong = bool(attempt.policy) and not all(refused_by(attempt, r) for r in refusers.values())
        kind = figures.kinds.setdefault(
            attempt.kind,
            {"attempts": 0, "refused": 0, "succeeded": 0, "errors": 0, "mismatches": 0, "wrong_refuser": 0},
        )
        kind["attempts"] += 1
        # One attempt is one verdict: succeeded if any credential got through.
        if "succeeded" in verdicts.values():
            kind["succeeded"] += 1
        elif "error" in verdicts.values():
            kind["errors"] += 1
        else:
            kind["refused"] += 1
        kind["mismatches"] += len(set(verdicts.values())) > 1
        kind["wrong_refuser"] += wrong
        figures.attempts.append(
            {
                "kind": attempt.kind,
                "identity": identity,
                "what": attempt.what,
                "verdicts": verdicts,
                "refusers": refusers,
                "wrong_refuser": wrong,
                "details": {how: result[2][:300] for how, result in results.items() if result[0] == "error"},
            }
        )
    return figures


def run_controls(figures: Figures, controls: list[Control]) -> None:
    for control in controls:
        try:
            control.call()
        except Exception as error:  # any failure of a control is reported as such
            figures.controls.append(
                {"kind": control.kind, "what": control.what, "ok": False, "error": str(error)}
            )
        else:
            figures.controls.append({"kind": control.kind, "what": control.what, "ok": True, "error": ""})


# --- the cluster the attacks run in --------------------------------------------------------------


@dataclass
class Setup:
    cluster: ClusterInfo
    admin: RestClient
    image: str
    plugin_pod: JsonObject
    daemon_pod: JsonObject
    domain: JsonObject
    tokens: dict[str, str]  # account -> real token (pod-bound where the account runs in a pod)

    def impersonating(self, account: str, node: str | None, namespace: str = NAMESPACE) -> RestClient:
        headers = {"Impersonate-User": f"system:serviceaccount:{namespace}:{account}"}
        if node:
            headers["Impersonate-Extra-" + urllib.parse.quote(NODE_NAME_EXTRA, safe="")] = node
        return RestClient(
            self.cluster.server, self.cluster.admin_token, self.cluster.ca_file, headers=headers
        )

    def identities(self) -> dict[str, dict[str, RestClient]]:
        def both(account: str, node: str | None) -> dict[str, RestClient]:
            return {
                "token": self.cluster.rest(self.tokens[account]),
                "impersonation": self.impersonating(account, node),
            }

        return {
            "plugin@node-a": both(PLUGIN_ACCOUNT, NODE_A),
            "plugin-unbound": {"token": self.cluster.rest(self.tokens["plugin-unbound"])},
            "controller": both(CONTROLLER_ACCOUNT, None),
            "imex-daemon@node-a": both(DAEMON_ACCOUNT, NODE_A),
            "webhook": both(WEBHOOK_ACCOUNT, None),
            "tenant": {
                "token": self.cluster.rest(self.tokens["tenant"]),
                "impersonation": self.impersonating(tenant.ACCOUNT, None, TENANT),
            },
        }


def helm() -> list[str]:
    return [str(Path(build_outputs("helm")["HELM_BIN_DIR"]) / "helm")]


def _run(argv: list[str], stdin: str | None = None) -> str:
    result = subprocess.run(argv, input=stdin, capture_output=True, text=True, check=False, timeout=300)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:3])} failed:\n{result.stdout}\n{result.stderr}")
    return result.stdout


VALUES: JsonObject = {
    "driverName": DRIVER,
    "pluginsDir": PLUGINS_DIR,
    "nodeLabels": True,
    "computeDomains": True,
    "webhook": {"enabled": True, "failurePolicy": "Ignore"},
}


@contextlib.contextmanager
def installed(cluster: ClusterInfo) -> Iterator[Setup]:
    """The chart installed for real, nodes A and B, the accounts' pods on node A and their tokens, and
    the objects the attacks aim at; all removed afterwards."""
    admin = cluster.rest()
    kubeconfig = ["--kubeconfig", str(cluster.kubeconfig)]
    for namespace in (NAMESPACE, TENANT, ADMIN_NAMESPACE):
        labels = {tenant.ADMIN_LABEL: "true"} if namespace == ADMIN_NAMESPACE else {}
        admin.create("/api/v1/namespaces", {"metadata": {"name": namespace, "labels": labels}})
    try:
        _run(
            [*helm(), *kubeconfig, "install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--values", "-"],
            stdin=yaml.safe_dump(VALUES),
        )
        try:
            with cluster.api_client() as api:
                for node in (NODE_A, NODE_B):
                    create_fake_node(api, node)
            yield _prepare(cluster, admin)
        finally:
            _run([*helm(), *kubeconfig, "uninstall", RELEASE, "--namespace", NAMESPACE, "--wait"])
            for node in (NODE_A, NODE_B):
                with contextlib.suppress(ApiError):
                    admin.delete(f"/api/v1/nodes/{node}")
    finally:
        for namespace in (NAMESPACE, TENANT, ADMIN_NAMESPACE):
            with contextlib.suppress(ApiError):
                admin.request(
                    "DELETE", f"/api/v1/namespaces/{namespace}/pods", query={"gracePeriodSeconds": "0"}
                )
            with contextlib.suppress(ApiError):
                admin.delete(f"/api/v1/namespaces/{namespace}")
        with contextlib.suppress(ApiError):
            admin.delete(f"{SLICES}/sec-b-slice")
        _wait_gone(
            admin, [f"/api/v1/namespaces/{namespace}" for namespace in (NAMESPACE, TENANT, ADMIN_NAMESPACE)]
        )


def _wait_gone(admin: RestClient, paths: list[str], timeout_s: float = 120) -> None:
    """The namespace controller empties a deleted namespace a moment later: the next run can start.
    No kubelet confirms a pod's graceful deletion here, so the pods (of the MPS daemon's ReplicaSet)
    are deleted at once, again while they come."""
    deadline = time.monotonic() + timeout_s
    for path in paths:
        while time.monotonic() < deadline:
            try:
                admin.get(path)
                admin.request("DELETE", f"{path}/pods", query={"gracePeriodSeconds": "0"})
            except ApiError as error:
                if error.status == 404:
                    break
                raise
            time.sleep(0.5)


def _prepare(cluster: ClusterInfo, admin: RestClient) -> Setup:
    daemonset = admin.get(f"{DAEMONSETS}/{FULLNAME}")
    template = daemonset["spec"]["template"]
    image = template["spec"]["containers"][0]["image"]
    pods = f"/api/v1/namespaces/{NAMESPACE}/pods"
    plugin_pod = admin.create(
        pods,
        {
            "metadata": {"name": "plugin-a", "labels": template["metadata"]["labels"]},
            "spec": {**template["spec"], "nodeName": NODE_A},
        },
    )
    daemon_pod = admin.create(
        pods,
        {
            "metadata": {"name": "imex-a"},
            "spec": {
                "serviceAccountName": DAEMON_ACCOUNT,
                "nodeName": NODE_A,
                "containers": [{"name": "daemon", "image": image}],
            },
        },
    )
    admin.create(f"/api/v1/namespaces/{TENANT}/serviceaccounts", {"metadata": {"name": tenant.ACCOUNT}})
    for namespace in (TENANT, ADMIN_NAMESPACE):
        for collection, body in tenant.rbac(namespace, TENANT):
            admin.create(collection, body)
    with cluster.api_client() as api:
        tokens = {
            "tenant": mint_service_account_token(api, TENANT, tenant.ACCOUNT),
            PLUGIN_ACCOUNT: mint_service_account_token(api, NAMESPACE, PLUGIN_ACCOUNT, bound_pod="plugin-a"),
            "plugin-unbound": mint_service_account_token(api, NAMESPACE, PLUGIN_ACCOUNT),
            DAEMON_ACCOUNT: mint_service_account_token(api, NAMESPACE, DAEMON_ACCOUNT, bound_pod="imex-a"),
            CONTROLLER_ACCOUNT: mint_service_account_token(api, NAMESPACE, CONTROLLER_ACCOUNT),
            WEBHOOK_ACCOUNT: mint_service_account_token(api, NAMESPACE, WEBHOOK_ACCOUNT),
        }
    _wait_established(admin, f"computedomaincliques.{NAMES.group}")
    _wait_established(admin, f"computedomains.{NAMES.group}")
    domain = admin.create(
        f"/apis/{NAMES.api_version}/namespaces/{TENANT}/computedomains",
        {
            "apiVersion": NAMES.api_version,
            "kind": "ComputeDomain",
            "metadata": {"name": "domain"},
            "spec": {"numNodes": 2, "channel": {"resourceClaimTemplate": {"name": "domain-channel"}}},
        },
    )
    setup = Setup(cluster, admin, image, plugin_pod, daemon_pod, domain, tokens)
    _targets(setup)
    return setup


def _wait_established(admin: RestClient, crd: str) -> None:
    manifests.wait_established(admin, crd)
    deadline = time.monotonic() + 30
    while True:  # served a moment after it is established
        try:
            admin.get(f"/apis/{NAMES.api_version}")
            return
        except ApiError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


# --- what the attacks aim at (made by the admin) ----------------------------------------------------


def mps_manifest(setup: Setup, node: str, node_uid: str, claim_uid: str | None = None) -> JsonObject:
    """The Deployment the driver writes for an MPS daemon on `node` (its own function)."""
    claim_uid = claim_uid or str(uuid.uuid4())
    daemon = f"{claim_uid}-abcde"
    spec = MpsDaemonSpec(id=daemon, claim_uid=claim_uid, claim=f"{TENANT}/c", devices=(MpsDevice("GPU-1"),))
    paths = MpsPaths(Path(PLUGINS_DIR) / DRIVER / "mps" / daemon)
    return deployment_manifest(
        spec,
        paths,
        namespace=NAMESPACE,
        node_name=node,
        node_uid=node_uid,
        image=setup.image,
        driver_root="/",
    )


def node_uid(setup: Setup, node: str) -> str:
    return str(setup.admin.get(f"/api/v1/nodes/{node}")["metadata"]["uid"])


def slice_of(name: str, node: str, pool: str | None = None, driver: str = DRIVER) -> JsonObject:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": name},
        "spec": {
            "driver": driver,
            "nodeName": node,
            "pool": {"name": pool or node, "generation": 1, "resourceSliceCount": 1},
            "devices": [{"name": "gpu-0"}],
        },
    }


def claims(namespace: str = TENANT) -> str:
    return f"{RESOURCE}/namespaces/{namespace}/resourceclaims"


def allocation(node: str) -> JsonObject:
    """A GPU of the driver, its compute-domain driver's channel and a NIC of another driver on `node`,
    as the scheduler would allocate them."""
    results = [
        {"request": "gpu", "driver": DRIVER, "pool": node, "device": "gpu-0"},
        {"request": "gpu", "driver": NAMES.driver, "pool": node, "device": "channel-0"},
        {"request": "gpu", "driver": "nic.example.com", "pool": node, "device": "nic-0"},
    ]
    return {
        "devices": {"results": results},
        "nodeSelector": {
            "nodeSelectorTerms": [
                {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
            ]
        },
    }


def _claim(setup: Setup, name: str, node: str | None) -> JsonObject:
    """A claim; with `node`, allocated there and reserved for a pod of the claim bound to that node
    (the resourceclaim controller drops a reservation for a pod that does not exist)."""
    requests = [{"name": "gpu", "exactly": {"deviceClassName": DRIVER}}]
    claim = setup.admin.create(
        claims(), {"metadata": {"name": name}, "spec": {"devices": {"requests": requests}}}
    )
    if not node:
        return claim
    pod = setup.admin.create(
        f"/api/v1/namespaces/{TENANT}/pods",
        {
            "metadata": {"name": f"{name}-workload"},
            "spec": {
                "nodeName": node,
                "resourceClaims": [{"name": "gpu", "resourceClaimName": name}],
                "containers": [{"name": "c", "image": "busybox", "resources": {"claims": [{"name": "gpu"}]}}],
            },
        },
    )
    reserved = [{"resource": "pods", "name": pod["metadata"]["name"], "uid": pod["metadata"]["uid"]}]
    status = {"allocation": allocation(node), "reservedFor": reserved}
    setup.admin.request("PATCH", f"{claims()}/{name}/status", {"status": status}, content_type=MERGE)
    time.sleep(1)  # what the resourceclaim controller would drop, it drops at once
    claim = setup.admin.get(f"{claims()}/{name}")
    if claim["status"].get("reservedFor") != reserved:
        raise RuntimeError(f"claim {name}: the reservation did not stay: {claim['status']}")
    return claim


def _condition(kind: str) -> JsonObject:
    """A True device condition, as the binding watcher writes it (dra_driver.node.binding)."""
    return {
        "type": kind,
        "status": "True",
        "reason": "Prepared",
        "message": "the device is prepared on the node",
        "lastTransitionTime": "2026-01-01T00:00:00Z",
    }


def _targets(setup: Setup) -> None:
    admin = setup.admin
    admin.create(SLICES, slice_of("sec-b-slice", NODE_B))
    admin.create(
        DEPLOYMENTS,
        mps_manifest(setup, NODE_B, node_uid(setup, NODE_B), "b0000000-0000-4000-8000-000000000000"),
    )
    _claim(setup, "claim-b", NODE_B)
    _claim(setup, "claim-a", NODE_A)
    _claim(setup, "claim-pending", None)
    admin.create(
        f"{RESOURCE}/namespaces/{TENANT}/resourceclaimtemplates",
        {
            "metadata": {"name": "tenant-template"},
            "spec": {
                "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER}}]}}
            },
        },
    )
    uid = setup.domain["metadata"]["uid"]
    admin.create(
        CLIQUES,
        {
            "apiVersion": NAMES.api_version,
            "kind": "ComputeDomainClique",
            "metadata": {
                "name": f"{uid}.clique",
                "labels": {NAMES.label: uid, NAMES.clique_label: "clique"},
            },
            "daemons": [
                {
                    "nodeName": NODE_A,
                    "ipAddress": "10.0.0.1",
                    "cliqueID": "clique",
                    "index": 0,
                    "status": "Ready",
                },
                {
                    "nodeName": NODE_B,
                    "ipAddress": "10.0.0.2",
                    "cliqueID": "clique",
                    "index": 1,
                    "status": "Ready",
                },
            ],
        },
    )


# --- the attempts ------------------------------------------------------------------------------------


def _create(path: str, body: JsonObject) -> Callable[[RestClient], object]:
    return lambda client: client.request("POST", path, body, query=DRY_RUN)


def _create_a_pod() -> Callable[[RestClient], object]:
    """A bare Pod in the driver's namespace: no account of the chart may create one."""
    pod = {"metadata": {"name": "p"}, "spec": {"containers": [{"name": "c", "image": "busybox"}]}}
    return _create(f"/api/v1/namespaces/{NAMESPACE}/pods", pod)


def _delete(path: str) -> Callable[[RestClient], object]:
    return lambda client: client.request("DELETE", path, query=DRY_RUN)


def _patch(path: str, body: JsonObject) -> Callable[[RestClient], object]:
    return lambda client: client.request("PATCH", path, body, query=DRY_RUN, content_type=MERGE)


def _replace(path: str, change: Callable[[JsonObject], None], setup: Setup) -> Callable[[RestClient], object]:
    """PUT of the object as stored, changed by `change` (read fresh at each try)."""

    def call(client: RestClient) -> object:
        body = setup.admin.get(path)
        change(body)
        return client.request("PUT", path, body, query=DRY_RUN)

    return call


def _pod(deployment: JsonObject) -> JsonObject:
    pod: JsonObject = deployment["spec"]["template"]["spec"]
    return pod


def plugin_attempts(setup: Setup) -> list[Attempt]:
    """Node A's plugin token: every write of its role, beyond node A."""
    uid_a, uid_b = node_uid(setup, NODE_A), node_uid(setup, NODE_B)
    own = mps_manifest(setup, NODE_A, uid_a)

    def mps(change: Callable[[JsonObject], None], node: str = NODE_A) -> JsonObject:
        manifest = copy.deepcopy(own if node == NODE_A else mps_manifest(setup, NODE_B, uid_b))
        change(manifest)
        return manifest

    def root_on(node_field: Callable[[JsonObject], None]) -> Callable[[JsonObject], None]:
        def change(d: JsonObject) -> None:
            pod = _pod(d)
            pod.pop("nodeName")
            node_field(pod)
            pod["hostPID"] = True
            pod["volumes"] = [{"name": "root", "hostPath": {"path": "/"}}]
            pod["containers"] = [
                {
                    "name": "x",
                    "image": "busybox",
                    "securityContext": {"privileged": True},
                    "volumeMounts": [{"name": "root", "mountPath": "/host"}],
                }
            ]

        return change

    def set_pod(key: str, value: Any) -> Callable[[JsonObject], None]:
        return lambda d: _pod(d).__setitem__(key, value)

    def set_container(key: str, value: Any) -> Callable[[JsonObject], None]:
        return lambda d: _pod(d)["containers"][0].__setitem__(key, value)

    def add_volume(d: JsonObject) -> None:
        _pod(d)["volumes"].append({"name": "etc", "hostPath": {"path": "/etc"}})
        _pod(d)["containers"][0]["volumeMounts"].append({"name": "etc", "mountPath": "/host-etc"})

    def retarget_volume(d: JsonObject) -> None:
        _pod(d)["volumes"][1]["hostPath"]["path"] = "/var/lib/kubelet"

    def pin_b_by_name(pod: JsonObject) -> None:
        pod["nodeName"] = NODE_B

    def pin_b_by_selector(pod: JsonObject) -> None:
        pod["nodeSelector"] = {"kubernetes.io/hostname": NODE_B}

    b_daemon = f"{DEPLOYMENTS}/mps-control-daemon-b0000000-0000-4000-8000-000000000000-abcde"
    kind = "plugin.deployments"
    policy = "mps-daemons"
    deployments = [
        Attempt(
            kind,
            "privileged hostPath / hostPID pod pinned to node B by nodeName",
            _create(DEPLOYMENTS, mps(root_on(pin_b_by_name))),
            policy,
        ),
        Attempt(
            kind,
            "privileged hostPath / hostPID pod pinned to node B by nodeSelector",
            _create(DEPLOYMENTS, mps(root_on(pin_b_by_selector))),
            policy,
        ),
        Attempt(
            kind,
            "the driver's daemon, but for node B",
            _create(DEPLOYMENTS, mps(lambda d: None, NODE_B)),
            policy,
        ),
        Attempt(
            kind,
            "daemon on node A with a nodeSelector added",
            _create(DEPLOYMENTS, mps(set_pod("nodeSelector", {"kubernetes.io/hostname": NODE_B}))),
            policy,
        ),
        Attempt(
            kind,
            "daemon on node A with a node affinity added",
            _create(
                DEPLOYMENTS,
                mps(
                    set_pod(
                        "affinity",
                        {
                            "nodeAffinity": {
                                "requiredDuringSchedulingIgnoredDuringExecution": {
                                    "nodeSelectorTerms": [
                                        {
                                            "matchExpressions": [
                                                {
                                                    "key": "kubernetes.io/hostname",
                                                    "operator": "In",
                                                    "values": [NODE_A],
                                                }
                                            ]
                                        }
                                    ]
                                }
                            }
                        },
                    )
                ),
            ),
            policy,
        ),
        Attempt(
            kind,
            "daemon with a toleration of its own",
            _create(
                DEPLOYMENTS, mps(set_pod("tolerations", [{"key": "x", "operator": "Equal", "value": "y"}]))
            ),
            policy,
        ),
        Attempt(
            kind,
            "daemon with any image",
            _create(DEPLOYMENTS, mps(set_container("image", "attacker.example/root:latest"))),
            policy,
        ),
        Attempt(
            kind,
            "daemon running as the compute-domain controller's account",
            _create(DEPLOYMENTS, mps(set_pod("serviceAccountName", CONTROLLER_ACCOUNT))),
            policy,
        ),
        Attempt(
            kind,
            "daemon running as the plugin's own account",
            _create(DEPLOYMENTS, mps(set_pod("serviceAccountName", PLUGIN_ACCOUNT))),
            policy,
        ),
        Attempt(
            kind,
            "daemon with the service account token mounted",
            _create(DEPLOYMENTS, mps(lambda d: _pod(d).pop("automountServiceAccountToken"))),
            policy,
        ),
        Attempt(
            kind, "daemon with hostNetwork", _create(DEPLOYMENTS, mps(set_pod("hostNetwork", True))), policy
        ),
        Attempt(kind, "daemon with hostIPC", _create(DEPLOYMENTS, mps(set_pod("hostIPC", True))), policy),
        Attempt(
            kind,
            "daemon with an init container",
            _create(DEPLOYMENTS, mps(set_pod("initContainers", [{"name": "i", "image": "busybox"}]))),
            policy,
        ),
        Attempt(
            kind,
            "daemon with a second container",
            _create(
                DEPLOYMENTS, mps(lambda d: _pod(d)["containers"].append({"name": "y", "image": "busybox"}))
            ),
            policy,
        ),
        Attempt(
            kind,
            "daemon with capabilities added",
            _create(
                DEPLOYMENTS,
                mps(
                    set_container(
                        "securityContext", {"privileged": True, "capabilities": {"add": ["SYS_ADMIN"]}}
                    )
                ),
            ),
            policy,
        ),
        Attempt(
            kind,
            "daemon with a Secret in its environment",
            _create(
                DEPLOYMENTS,
                mps(
                    set_container(
                        "env",
                        [
                            {
                                "name": "S",
                                "valueFrom": {
                                    "secretKeyRef": {"name": f"{FULLNAME}-webhook", "key": "tls.key"}
                                },
                            }
                        ],
                    )
                ),
            ),
            policy,
        ),
        Attempt(
            kind, "daemon with another host directory (/etc)", _create(DEPLOYMENTS, mps(add_volume)), policy
        ),
        Attempt(
            kind,
            "daemon with its pipe directory pointed elsewhere",
            _create(DEPLOYMENTS, mps(retarget_volume)),
            policy,
        ),
        Attempt(
            kind,
            "daemon owned by node B",
            _create(
                DEPLOYMENTS,
                mps(
                    lambda d: d["metadata"].__setitem__(
                        "ownerReferences",
                        [{"apiVersion": "v1", "kind": "Node", "name": NODE_B, "uid": uid_b}],
                    )
                ),
            ),
            policy,
        ),
        Attempt(
            kind,
            "a Deployment under another name",
            _create(DEPLOYMENTS, mps(lambda d: d["metadata"].__setitem__("name", "not-mps"))),
        ),
        Attempt(kind, "deleting node B's MPS daemon", _delete(b_daemon), policy),
        Attempt(
            kind,
            "deleting the compute-domain controller",
            _delete(f"{DEPLOYMENTS}/{CONTROLLER_ACCOUNT}"),
            policy,
        ),
        Attempt(kind, "changing node B's MPS daemon (patch)", _patch(b_daemon, {"spec": {"replicas": 2}})),
        Attempt(
            kind,
            "a Deployment in a tenant namespace",
            _create(
                f"/apis/apps/v1/namespaces/{TENANT}/deployments",
                mps(lambda d: d["metadata"].__setitem__("namespace", TENANT)),
            ),
            "rbac",
        ),
    ]
    slices = [
        Attempt(
            "plugin.slices",
            "a slice of node B",
            _create(SLICES, slice_of("sec-x1", NODE_B)),
            "resourceslices",
        ),
        Attempt(
            "plugin.slices",
            "node A's slice in node B's pool",
            _create(SLICES, slice_of("sec-x2", NODE_A, pool=NODE_B)),
            "resourceslices",
        ),
        Attempt(
            "plugin.slices",
            "a slice of another driver",
            _create(SLICES, slice_of("sec-x3", NODE_A, driver="x.example.com")),
            "resourceslices",
        ),
        Attempt(
            "plugin.slices",
            "a slice for all nodes",
            _create(
                SLICES,
                {
                    **slice_of("sec-x4", NODE_A),
                    "spec": {**slice_of("sec-x4", NODE_A)["spec"], "nodeName": None, "allNodes": True},
                },
            ),
            "resourceslices",
        ),
        Attempt(
            "plugin.slices",
            "changing node B's slice",
            _patch(f"{SLICES}/sec-b-slice", {"spec": {"devices": [{"name": "gpu-0"}, {"name": "gpu-1"}]}}),
            "resourceslices",
        ),
        Attempt(
            "plugin.slices", "deleting node B's slice", _delete(f"{SLICES}/sec-b-slice"), "resourceslices"
        ),
    ]
    nodes = [
        Attempt(
            "plugin.nodes",
            "a label on node B",
            _patch(f"/api/v1/nodes/{NODE_B}", {"metadata": {"labels": {"nvidia.com/gpu.product": "x"}}}),
            "node-labels",
        ),
        Attempt(
            "plugin.nodes",
            "a label of others on node A",
            _patch(
                f"/api/v1/nodes/{NODE_A}", {"metadata": {"labels": {"kubernetes.io/hostname": "elsewhere"}}}
            ),
            "node-labels",
        ),
        Attempt(
            "plugin.nodes",
            "node A unschedulable",
            _patch(f"/api/v1/nodes/{NODE_A}", {"spec": {"unschedulable": True}}),
            "node-labels",
        ),
        Attempt(
            "plugin.nodes",
            "a taint on node B",
            _patch(f"/api/v1/nodes/{NODE_B}", {"spec": {"taints": [{"key": "x", "effect": "NoExecute"}]}}),
            "node-labels",
        ),
        Attempt(
            "plugin.nodes",
            "node B's status",
            _patch(f"/api/v1/nodes/{NODE_B}/status", {"status": {"capacity": {"pods": "0"}}}),
            "rbac",
        ),
    ]
    b_entry = {"driver": DRIVER, "pool": NODE_B, "device": "gpu-0", "data": {"uuid": "GPU-X"}}
    a_entry = {"driver": DRIVER, "pool": NODE_A, "device": "gpu-0", "data": {"uuid": "GPU-X"}}
    claim_status = [
        Attempt(
            "plugin.claim_status",
            "status.devices of a claim on node B",
            _patch(f"{claims()}/claim-b/status", {"status": {"devices": [b_entry]}}),
            CLAIM_STATUS,
        ),
        Attempt(
            "plugin.claim_status",
            "a binding condition on a claim of node B (releasing or failing its pod's binding)",
            _patch(
                f"{claims()}/claim-b/status",
                {"status": {"devices": [{**b_entry, "conditions": [_condition("Ready")]}]}},
            ),
            CLAIM_STATUS,
        ),
        Attempt(
            "plugin.claim_status",
            "a ComputeDomain channel's binding condition on a claim of node B",
            _patch(
                f"{claims()}/claim-b/status",
                {
                    "status": {
                        "devices": [
                            {
                                "driver": NAMES.driver,
                                "pool": NODE_B,
                                "device": "channel-0",
                                "conditions": [_condition("Ready")],
                            }
                        ]
                    }
                },
            ),
            CLAIM_STATUS,
        ),
        Attempt(
            "plugin.claim_status",
            "allocating a pending claim",
            _patch(f"{claims()}/claim-pending/status", {"status": {"allocation": allocation(NODE_A)}}),
            CLAIM_STATUS,
        ),
        Attempt(
            "plugin.claim_status",
            "removing a claim's reservedFor",
            _patch(f"{claims()}/claim-b/status", {"status": {"reservedFor": None}}),
            CLAIM_STATUS,
        ),
        Attempt(
            "plugin.claim_status",
            "removing reservedFor of its own node's claim",
            _patch(f"{claims()}/claim-a/status", {"status": {"reservedFor": None}}),
            CLAIM_STATUS,
        ),
        Attempt(
            "plugin.claim_status",
            "status.devices of another driver on its own claim",
            _patch(
                f"{claims()}/claim-a/status",
                {"status": {"devices": [{**a_entry, "driver": "nic.example.com", "device": "nic-0"}]}},
            ),
            CLAIM_STATUS,
        ),
    ]
    other = [
        Attempt(
            "plugin.other",
            "a bare Pod on node B",
            _create(
                f"/api/v1/namespaces/{NAMESPACE}/pods",
                {
                    "metadata": {"name": "p"},
                    "spec": {"nodeName": NODE_B, "containers": [{"name": "c", "image": "busybox"}]},
                },
            ),
            "rbac",
        ),
        Attempt(
            "plugin.other",
            "reading the webhook's Secret",
            lambda c: c.get(f"/api/v1/namespaces/{NAMESPACE}/secrets/{FULLNAME}-webhook"),
            "rbac",
        ),
        Attempt(
            "plugin.other",
            "a DaemonSet",
            _create(
                DAEMONSETS, daemon_set(NAMES, parse_compute_domain(setup.domain), NAMESPACE, setup.image)
            ),
            "rbac",
        ),
    ]
    own_events = "/api/v1/namespaces/default/events"  # where an Event about a Node must be
    events = [
        Attempt(
            "plugin.events", "an Event about node B", _create(own_events, node_event(NODE_B)), "node-events"
        ),
        Attempt(
            "plugin.events",
            "an Event about a tenant's claim",
            _create(
                own_events,
                node_event(
                    NODE_A,
                    regarding={
                        "apiVersion": "resource.k8s.io/v1",
                        "kind": "ResourceClaim",
                        "name": "claim-b",
                    },
                ),
            ),
            "node-events",
        ),
        Attempt(
            "plugin.events",
            "an Event about its Node naming node B as related",
            _create(
                own_events,
                {**node_event(NODE_A), "related": {"apiVersion": "v1", "kind": "Node", "name": NODE_B}},
            ),
            "node-events",
        ),
        Attempt(
            "plugin.events",
            "an Event about its Node reported from node B",
            _create(own_events, {**node_event(NODE_A), "source": {"component": DRIVER, "host": NODE_B}}),
            "node-events",
        ),
        Attempt(
            "plugin.events",
            "an Event in a tenant namespace",
            _create(
                f"/api/v1/namespaces/{TENANT}/events",
                {**node_event(NODE_A), "metadata": {"generateName": "sec.", "namespace": TENANT}},
            ),
            "rbac",
        ),
    ]
    return deployments + slices + nodes + claim_status + other + events


def node_event(node: str, regarding: JsonObject | None = None) -> JsonObject:
    """A Warning Event as dra_driver/node/events.py posts it, about ``node`` (or ``regarding``)."""
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": "sec.", "namespace": "default"},
        "involvedObject": regarding or {"apiVersion": "v1", "kind": "Node", "name": node},
        "reason": "PreparedClaimsConflict",
        "message": "a security suite's attempt",
        "type": "Warning",
        "source": {"component": DRIVER, "host": node},
    }


def controller_attempts(setup: Setup) -> list[Attempt]:
    domain = parse_compute_domain(setup.domain)
    own = daemon_set(NAMES, domain, NAMESPACE, setup.image)

    def ds(change: Callable[[JsonObject], None]) -> JsonObject:
        manifest = copy.deepcopy(own)
        change(manifest)
        return manifest

    def set_pod(key: str, value: Any) -> Callable[[JsonObject], None]:
        return lambda d: _pod(d).__setitem__(key, value)

    def set_container(key: str, value: Any) -> Callable[[JsonObject], None]:
        return lambda d: _pod(d)["containers"][0].__setitem__(key, value)

    def host_root(d: JsonObject) -> None:
        _pod(d)["volumes"] = [{"name": "root", "hostPath": {"path": "/"}}]
        _pod(d)["containers"][0]["volumeMounts"] = [{"name": "root", "mountPath": "/host"}]

    kind, policy = "controller.daemonsets", "cd-daemonsets"
    template = channel_template(NAMES, domain, "clique")
    templates = f"{RESOURCE}/namespaces/{TENANT}/resourceclaimtemplates"

    def rct(change: Callable[[JsonObject], None]) -> JsonObject:
        manifest = copy.deepcopy(template)
        manifest["metadata"]["name"] = "sec-template"
        change(manifest)
        return manifest

    def request(d: JsonObject) -> JsonObject:
        item: JsonObject = d["spec"]["spec"]["devices"]["requests"][0]["exactly"]
        return item

    uid = setup.domain["metadata"]["uid"]
    clique = f"{CLIQUES}/{uid}.clique"

    def add_entry(body: JsonObject) -> None:
        body["daemons"].append(
            {"nodeName": "sec-node-c", "ipAddress": "10.0.0.3", "cliqueID": "clique", "index": 2}
        )

    def change_b(body: JsonObject) -> None:
        body["daemons"][1]["ipAddress"] = "10.6.6.6"

    return [
        Attempt(
            kind,
            "a privileged IMEX DaemonSet",
            _create(DAEMONSETS, ds(set_container("securityContext", {"privileged": True}))),
            policy,
        ),
        Attempt(kind, "an IMEX DaemonSet mounting the host's /", _create(DAEMONSETS, ds(host_root)), policy),
        Attempt(
            kind,
            "a DaemonSet running as the plugin's account",
            _create(DAEMONSETS, ds(set_pod("serviceAccountName", PLUGIN_ACCOUNT))),
            policy,
        ),
        Attempt(
            kind,
            "a DaemonSet of another image",
            _create(DAEMONSETS, ds(set_container("image", "attacker.example/x"))),
            policy,
        ),
        Attempt(
            kind,
            "a DaemonSet with hostNetwork",
            _create(DAEMONSETS, ds(set_pod("hostNetwork", True))),
            policy,
        ),
        Attempt(
            kind,
            "a DaemonSet on every node (no nodeSelector)",
            _create(DAEMONSETS, ds(lambda d: _pod(d).pop("nodeSelector"))),
            policy,
        ),
        Attempt(
            kind,
            "a DaemonSet with a Secret in its environment",
            _create(
                DAEMONSETS,
                ds(
                    set_container(
                        "env",
                        [
                            {
                                "name": "S",
                                "valueFrom": {
                                    "secretKeyRef": {"name": f"{FULLNAME}-webhook", "key": "tls.key"}
                                },
                            }
                        ],
                    )
                ),
            ),
            policy,
        ),
        Attempt(
            kind,
            "a DaemonSet under another name",
            _create(DAEMONSETS, ds(lambda d: d["metadata"].__setitem__("name", "other"))),
            policy,
        ),
        Attempt(kind, "deleting the plugin's DaemonSet", _delete(f"{DAEMONSETS}/{FULLNAME}"), policy),
        Attempt(
            kind,
            "a DaemonSet in a tenant namespace",
            _create(
                f"/apis/apps/v1/namespaces/{TENANT}/daemonsets",
                ds(lambda d: d["metadata"].__setitem__("namespace", TENANT)),
            ),
            "rbac",
        ),
        Attempt(
            "controller.templates",
            "deleting a tenant's own ResourceClaimTemplate",
            _delete(f"{templates}/tenant-template"),
            "cd-templates",
        ),
        Attempt(
            "controller.templates",
            "a template without the domain label",
            _create(templates, rct(lambda d: d["metadata"].pop("labels"))),
            "cd-templates",
        ),
        Attempt(
            "controller.templates",
            "a template asking for a GPU",
            _create(templates, rct(lambda d: request(d).__setitem__("deviceClassName", DRIVER))),
            "cd-templates",
        ),
        Attempt(
            "controller.templates",
            "a template asking for admin access",
            _create(templates, rct(lambda d: request(d).__setitem__("adminAccess", True))),
            "",
        ),
        Attempt(
            "controller.cliques", "adding a clique entry", _replace(clique, add_entry, setup), "cd-cliques"
        ),
        Attempt(
            "controller.cliques",
            "changing node B's clique entry",
            _replace(clique, change_b, setup),
            "cd-cliques",
        ),
        Attempt(
            "controller.other",
            "a Pod",
            _create_a_pod(),
            "rbac",
        ),
        Attempt("controller.other", "a ResourceSlice", _create(SLICES, slice_of("sec-x5", NODE_A)), "rbac"),
    ]


def daemon_attempts(setup: Setup) -> list[Attempt]:
    uid = setup.domain["metadata"]["uid"]
    clique = f"{CLIQUES}/{uid}.clique"

    def change_b(body: JsonObject) -> None:
        body["daemons"][1]["ipAddress"] = "10.6.6.6"

    def remove_b(body: JsonObject) -> None:
        body["daemons"] = body["daemons"][:1]

    def add_c(body: JsonObject) -> None:
        body["daemons"].append(
            {"nodeName": "sec-node-c", "ipAddress": "10.0.0.3", "cliqueID": "clique", "index": 2}
        )

    def relabel(body: JsonObject) -> None:
        body["metadata"]["labels"][NAMES.label] = "another-domain"

    def new_clique(entries: list[JsonObject]) -> JsonObject:
        return {
            "apiVersion": NAMES.api_version,
            "kind": "ComputeDomainClique",
            "metadata": {"name": f"{uid}.other", "labels": {NAMES.label: uid}},
            "daemons": entries,
        }

    kind, policy = "imex-daemon.cliques", "cd-cliques"
    b_entry = {"nodeName": NODE_B, "ipAddress": "10.6.6.6", "cliqueID": "other", "index": 0}
    return [
        Attempt(kind, "rewriting node B's ipAddress", _replace(clique, change_b, setup), policy),
        Attempt(kind, "removing node B's entry", _replace(clique, remove_b, setup), policy),
        Attempt(kind, "adding another node's entry", _replace(clique, add_c, setup), policy),
        Attempt(
            kind, "moving the clique to another domain (labels)", _replace(clique, relabel, setup), policy
        ),
        Attempt(kind, "a new clique with node B's entry", _create(CLIQUES, new_clique([b_entry])), policy),
        Attempt(kind, "deleting a clique", _delete(clique), "rbac"),
        Attempt("imex-daemon.other", "a ResourceSlice", _create(SLICES, slice_of("sec-x6", NODE_A)), "rbac"),
        Attempt(
            "imex-daemon.other",
            "a Pod",
            _create_a_pod(),
            "rbac",
        ),
    ]


def webhook_attempts(setup: Setup) -> list[Attempt]:
    kind = "webhook"
    return [
        Attempt(kind, "a ResourceSlice", _create(SLICES, slice_of("sec-x7", NODE_A)), "rbac"),
        Attempt(
            kind,
            "a claim's status",
            _patch(f"{claims()}/claim-b/status", {"status": {"reservedFor": None}}),
            "rbac",
        ),
        Attempt(
            kind,
            "a Secret",
            _create(f"/api/v1/namespaces/{NAMESPACE}/secrets", {"metadata": {"name": "s"}}),
            "rbac",
        ),
        Attempt(
            kind,
            "reading its own Secret back through the API",
            lambda c: c.get(f"/api/v1/namespaces/{NAMESPACE}/secrets/{FULLNAME}-webhook"),
            "rbac",
        ),
        Attempt(
            kind,
            "a DeviceClass",
            _create(f"{RESOURCE}/deviceclasses", {"metadata": {"name": "sec-class"}}),
            "rbac",
        ),
        Attempt(
            kind,
            "a Pod",
            _create_a_pod(),
            "rbac",
        ),
    ]


def unbound_attempts(setup: Setup) -> list[Attempt]:
    """The plugin's account with a token bound to no pod names no node: every policed write is refused."""
    kind = "plugin-unbound"
    return [
        Attempt(kind, "its 'own' slice", _create(SLICES, slice_of("sec-x8", NODE_A)), "resourceslices"),
        Attempt(
            kind,
            "an MPS daemon of node A",
            _create(DEPLOYMENTS, mps_manifest(setup, NODE_A, node_uid(setup, NODE_A))),
            "mps-daemons",
        ),
        Attempt(
            kind,
            "a label on node A",
            _patch(f"/api/v1/nodes/{NODE_A}", {"metadata": {"labels": {"nvidia.com/gpu.product": "x"}}}),
            "node-labels",
        ),
    ]


def tenant_attempts(setup: Setup) -> list[Attempt]:
    """A tenant who may create claims and templates in its own namespace (see e2e/security/tenant.py)."""
    kind = "tenant.admin_access"
    return [
        Attempt(
            kind,
            "a claim with admin access in a namespace without the admin-access label",
            _create(claims(), tenant.claim_body("admin", DRIVER, admin=True)),
            "api-server",
        ),
        Attempt(
            kind,
            "a claim template with admin access in a namespace without the label",
            _create(
                f"{RESOURCE}/namespaces/{TENANT}/resourceclaimtemplates",
                tenant.template_body("admin", DRIVER),
            ),
            "api-server",
        ),
        Attempt(
            kind,
            "labelling its own namespace for admin access",
            _patch(f"/api/v1/namespaces/{TENANT}", {"metadata": {"labels": {tenant.ADMIN_LABEL: "true"}}}),
            "rbac",
        ),
        Attempt(
            "tenant.configs",
            f"a claim whose config is over the API server's {tenant.OPAQUE_LIMIT // 1024} KiB",
            _create(claims(), tenant.claim_body("big", DRIVER, config=tenant.oversized_config())),
            "api-server",
            invalid_is_refused=True,
        ),
    ]


# --- the positive controls -------------------------------------------------------------------------


def controls(setup: Setup) -> list[Control]:
    cluster = setup.cluster
    plugin = cluster.rest(setup.tokens[PLUGIN_ACCOUNT])
    controller = cluster.rest(setup.tokens[CONTROLLER_ACCOUNT])
    daemon = cluster.rest(setup.tokens[DAEMON_ACCOUNT])
    domain = parse_compute_domain(setup.domain)
    uid = setup.domain["metadata"]["uid"]

    def mps_daemon() -> None:
        manifest = mps_manifest(setup, NODE_A, node_uid(setup, NODE_A))
        plugin.create(DEPLOYMENTS, manifest)
        plugin.request(
            "DELETE", f"{DEPLOYMENTS}/{manifest['metadata']['name']}", {"propagationPolicy": "Foreground"}
        )

    def own_slice() -> None:
        plugin.create(SLICES, slice_of("sec-a-slice", NODE_A))
        plugin.request(
            "PATCH",
            f"{SLICES}/sec-a-slice",
            {"spec": {"devices": [{"name": "gpu-0"}, {"name": "gpu-1"}]}},
            content_type=MERGE,
        )
        plugin.delete(f"{SLICES}/sec-a-slice")

    def own_label() -> None:
        for value in ("NVIDIA-H100-80GB-HBM3", None):
            plugin.request(
                "PATCH",
                f"/api/v1/nodes/{NODE_A}",
                {"metadata": {"labels": {"nvidia.com/gpu.product": value}}},
                content_type=MERGE,
            )

    def own_node_event() -> None:
        plugin.create("/api/v1/namespaces/default/events", node_event(NODE_A))

    def own_claim_status() -> None:
        claim = setup.admin.get(f"{claims()}/claim-a")
        ref = ClaimRef(TENANT, "claim-a", claim["metadata"]["uid"])
        entry = {"driver": DRIVER, "pool": NODE_A, "device": "gpu-0", "data": {"uuid": "GPU-1"}}

        async def write() -> None:
            configuration = Configuration(
                host=cluster.server,
                api_key={"BearerToken": setup.tokens[PLUGIN_ACCOUNT]},
                api_key_prefix={"BearerToken": "Bearer"},
                ssl_ca_cert=str(cluster.ca_file),
            )
            async with ApiClient(configuration) as client:
                await ApiServerClaimStatus(client).apply_status(ref, [entry], DRIVER)
                await ApiServerClaimStatus(client).apply_status(ref, [], DRIVER)

        asyncio.run(write())

    def own_binding_condition(driver: str = DRIVER, device_name: str = "gpu-0") -> None:
        claim = setup.admin.get(f"{claims()}/claim-a")
        ref = ClaimRef(TENANT, "claim-a", claim["metadata"]["uid"])
        device = WaitingDevice(NODE_A, device_name, None, ("Ready",), ("PrepareFailed",))
        entries = condition_entries(driver, [device], (), datetime.now(UTC))

        async def write() -> None:
            configuration = Configuration(
                host=cluster.server,
                api_key={"BearerToken": setup.tokens[PLUGIN_ACCOUNT]},
                api_key_prefix={"BearerToken": "Bearer"},
                ssl_ca_cert=str(cluster.ca_file),
            )
            async with ApiClient(configuration) as client:
                await ApiServerClaimStatus(client).apply_status(ref, entries, f"{driver}/binding")
                await ApiServerClaimStatus(client).apply_status(ref, [], f"{driver}/binding")

        asyncio.run(write())

    def own_channel_binding_condition() -> None:
        own_binding_condition(NAMES.driver, "channel-0")

    def daemon_set_and_templates() -> None:
        name = daemon_object_name(domain)
        controller.create(DAEMONSETS, daemon_set(NAMES, domain, NAMESPACE, setup.image))
        controller.delete(f"{DAEMONSETS}/{name}")
        templates = f"{RESOURCE}/namespaces/{TENANT}/resourceclaimtemplates"
        created = controller.create(templates, channel_template(NAMES, domain, "clique"))
        controller.delete(f"{templates}/{created['metadata']['name']}")

    def own_clique_entry() -> None:
        # As dra_driver/simulated/imex_daemon.py writes it: create the clique, upsert its own entry.
        collection = CLIQUES
        body = {
            "apiVersion": NAMES.api_version,
            "kind": "ComputeDomainClique",
            "metadata": {"name": f"{uid}.own", "labels": {NAMES.label: uid, NAMES.clique_label: "own"}},
            "daemons": [],
        }
        daemon.create(collection, body)
        stored = daemon.get(f"{collection}/{uid}.own")
        stored["daemons"] = [
            {"nodeName": NODE_A, "ipAddress": "10.0.0.1", "cliqueID": "own", "index": 0, "status": "Ready"}
        ]
        stored["metadata"]["ownerReferences"] = [
            {"apiVersion": "v1", "kind": "Pod", "name": "imex-a", "uid": setup.daemon_pod["metadata"]["uid"]}
        ]
        daemon.request("PUT", f"{collection}/{uid}.own", stored)
        # The controller then prunes it (the node left the domain): removal only. It lists (RBAC
        # grants it no get) and replaces, as dra_driver/computedomain/controller/reconciler.py does.
        listed = controller.request("GET", collection, query={"labelSelector": f"{NAMES.clique_label}=own"})
        (stored,) = listed["items"]
        stored["daemons"] = []
        controller.request("PUT", f"{collection}/{uid}.own", stored)
        controller.delete(f"{collection}/{uid}.own")

    def admin_access_where_labelled() -> None:
        tenant_client = cluster.rest(setup.tokens["tenant"])
        body = tenant.claim_body("admin", DRIVER, admin=True)
        tenant_client.request("POST", claims(ADMIN_NAMESPACE), body, query=DRY_RUN)

    return [
        Control(
            "tenant.admin_access",
            "the tenant's admin-access claim in the namespace its administrator labelled",
            admin_access_where_labelled,
        ),
        Control(
            "plugin.deployments",
            "the driver's MPS daemon Deployment for node A, created and deleted",
            mps_daemon,
        ),
        Control("plugin.slices", "node A's own slice, created, changed and deleted", own_slice),
        Control("plugin.nodes", "an nvidia.com/ label on node A, set and removed", own_label),
        Control("plugin.events", "a Warning Event about node A, as the driver posts it", own_node_event),
        Control(
            "plugin.claim_status",
            "status.devices of node A's claim, by the driver's writer",
            own_claim_status,
        ),
        Control(
            "plugin.claim_status",
            "the Ready binding condition of node A's claim, by the driver's binding watcher",
            own_binding_condition,
        ),
        Control(
            "plugin.claim_status",
            "the Ready binding condition of node A's ComputeDomain channel, by the compute-domain "
            "driver's binding watcher",
            own_channel_binding_condition,
        ),
        Control(
            "controller.daemonsets",
            "the controller's IMEX DaemonSet and channel template, created and deleted",
            daemon_set_and_templates,
        ),
        Control(
            "imex-daemon.cliques",
            "an IMEX daemon's own clique entry; the controller prunes it",
            own_clique_entry,
        ),
    ]


# --- the policies are there and active ---------------------------------------------------------------


def policies(setup: Setup) -> dict[str, JsonObject]:
    """Each policy of the release: bound, and its expressions type-checked without warnings."""
    base = "/apis/admissionregistration.k8s.io/v1"
    found: dict[str, JsonObject] = {}
    bindings = {
        b["spec"]["policyName"] for b in setup.admin.get(f"{base}/validatingadmissionpolicybindings")["items"]
    }
    deadline = time.monotonic() + 30
    for policy in setup.admin.get(f"{base}/validatingadmissionpolicies")["items"]:
        name = policy["metadata"]["name"]
        if policy["metadata"].get("labels", {}).get("app.kubernetes.io/instance") != RELEASE:
            continue
        # The API server type-checks a policy a moment after it is written.
        while "typeChecking" not in policy.get("status", {}) and time.monotonic() < deadline:
            time.sleep(0.5)
            policy = setup.admin.get(f"{base}/validatingadmissionpolicies/{name}")
        warnings = policy.get("status", {}).get("typeChecking", {}).get("expressionWarnings", [])
        found[name] = {"bound": name in bindings, "warnings": warnings}
    return found


def wait_enforced(setup: Setup, attempts: list[tuple[str, Attempt]], timeout_s: float = 60) -> None:
    """Returns once every policy an attempt names refuses it (policies load a moment after they are
    written): each probe is the attempt itself, with the real token."""
    identities = setup.identities()
    pending: dict[str, tuple[str, Attempt]] = {}
    for identity, attempt in attempts:
        if attempt.policy and attempt.policy != "rbac":
            pending.setdefault(attempt.policy, (identity, attempt))
    deadline = time.monotonic() + timeout_s
    last: dict[str, str] = {}
    while pending:
        for name, (identity, attempt) in list(pending.items()):
            result, refuser, message = verdict(attempt.call, identities[identity]["token"])
            if result == "refused" and refused_by(attempt, refuser):
                del pending[name]
            last[name] = f"{attempt.what!r}: {result} {refuser} {message}".strip()
        if pending and time.monotonic() > deadline:
            seen = "; ".join(last[name] for name in sorted(pending))
            raise TimeoutError(f"policies not enforced after {timeout_s:.0f}s: {sorted(pending)} ({seen})")
        time.sleep(0.5)


def all_attempts(setup: Setup) -> list[tuple[str, Attempt]]:
    """Every attempt, with the identity that makes it (a key of :meth:`Setup.identities`)."""
    return (
        [("plugin@node-a", a) for a in plugin_attempts(setup)]
        + [("plugin-unbound", a) for a in unbound_attempts(setup)]
        + [("controller", a) for a in controller_attempts(setup)]
        + [("imex-daemon@node-a", a) for a in daemon_attempts(setup)]
        + [("webhook", a) for a in webhook_attempts(setup)]
        + [("tenant", a) for a in tenant_attempts(setup)]
    )


def run(cluster: ClusterInfo) -> JsonObject:
    """Installs the chart, runs every attempt and control, and returns the report (see the module doc)."""
    started = time.monotonic()
    version = cluster.rest().get("/version")["gitVersion"]
    with installed(cluster) as setup:
        attempts = all_attempts(setup)
        wait_enforced(setup, attempts)
        figures = run_attempts(setup.identities(), attempts)
        run_controls(figures, controls(setup))
        figures.policies = policies(setup)
        run_tenant_node(setup, figures)
    report = figures.as_json()
    report["kubernetes"] = version
    report["duration_s"] = round(time.monotonic() - started, 1)
    report["missed_goals"] = missed_goals(report)
    return report


def run_tenant_node(setup: Setup, figures: Figures) -> None:
    """The tenant's attempts on a node (:mod:`e2e.security.tenant`), added to `figures`."""
    tenant_client = setup.cluster.rest(setup.tokens["tenant"])
    with tenant.tenant_node(
        setup.cluster, setup.admin, tenant_client, driver=DRIVER, node=NODE_A, namespace=TENANT
    ) as node:
        attempts, node_controls = tenant.run_node(node)
    for record in tenant.as_records(attempts):
        verdict_ = record["verdicts"]["node"]
        kind = figures.kinds.setdefault(
            record["kind"],
            {"attempts": 0, "refused": 0, "succeeded": 0, "errors": 0, "mismatches": 0, "wrong_refuser": 0},
        )
        kind["attempts"] += 1
        kind[{"refused": "refused", "succeeded": "succeeded"}.get(verdict_, "errors")] += 1
        figures.attempts.append(record)
    figures.controls += [
        {"kind": c.kind, "what": c.what, "ok": c.ok, "error": c.error} for c in node_controls
    ]


def table(report: JsonObject) -> str:
    """Attempts, refused, succeeded, errors and mismatches per kind; the controls; missed goals."""
    columns = ("attempts", "refused", "succeeded", "errors", "mismatches")

    def row(name: str, figures: dict[str, int]) -> str:
        return f"{name:24}" + "".join(f"{figures[c]:>11}" for c in columns)

    lines = [f"{'kind':24}" + "".join(f"{c:>11}" for c in columns)]
    lines += [row(kind, figures) for kind, figures in sorted(report["kinds"].items())]
    lines.append(row("total", report["totals"]))
    controls = report["controls"]
    lines.append(
        f"positive controls: {controls['passed']} passed, {controls['failed']} failed; "
        f"policies checked: {len(report['policies'])}"
    )
    lines += [f"MISSED: {goal}" for goal in report["missed_goals"]]
    return "\n".join(lines)


def dumps(report: JsonObject) -> str:
    return json.dumps(report, indent=2) + "\n"
