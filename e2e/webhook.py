"""`dra-driver webhook` as a process on 127.0.0.1, called by the real API server.

The webhook is registered by a ValidatingWebhookConfiguration as the chart's (webhook.enabled)
does, but with a certificate of the test's own and only for namespaces that carry the test's label,
so other tests' claims are not affected.
"""

from __future__ import annotations

import base64
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import yaml

from e2e.cluster import ClusterInfo, RestClient
from e2e.cluster.binaries import REPO_ROOT, build_outputs
from e2e.cluster.controlplane import free_ports
from e2e.cluster.credentials import write_kubeconfig
from e2e.cluster.tokens import mint_service_account_token
from e2e.daemon import Daemon

WEBHOOKS = "/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations"


def self_signed(directory: Path) -> tuple[Path, Path]:
    cert, key = directory / "tls.crt", directory / "tls.key"
    subprocess.run(
        [
            *("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"),
            *("-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"),
            *("-keyout", str(key), "-out", str(cert)),
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


@contextmanager
def running_webhook(
    cluster: ClusterInfo,
    directory: Path,
    *,
    driver: str,
    name: str,
    selector_label: str,
    extra_args: Sequence[str] = (),
    ready_line: str = "serving the validating webhook",
) -> Iterator[Daemon]:
    """The webhook for ``driver``, called for claims and templates in namespaces labelled
    ``selector_label=true``; ready once its log says ``ready_line``."""
    cert, key = self_signed(directory)
    (port,) = free_ports(1)
    daemon = Daemon("dra-driver webhook", directory / "webhook.log")
    argv = [sys.executable, "-m", "dra_driver", "webhook", f"--driver-name={driver}", "--log-format=console"]
    argv += [f"--webhook-address=127.0.0.1:{port}", f"--tls-cert-file={cert}", f"--tls-key-file={key}"]
    argv += extra_args
    daemon.start(argv, lambda offset: ready_line in daemon.log_since(offset), timeout_seconds=30)
    rest = cluster.rest()
    try:
        rest.create(WEBHOOKS, configuration(name, port, cert, selector_label))
        try:
            yield daemon
        finally:
            rest.delete(f"{WEBHOOKS}/{name}")
    finally:
        daemon.stop()


def configuration(name: str, port: int, cert: Path, selector_label: str) -> dict[str, object]:
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": name},
        "webhooks": [
            {
                "name": f"opaque-config.{name}.dra-driver.dev",
                "clientConfig": {
                    "url": f"https://127.0.0.1:{port}/validate",
                    "caBundle": base64.b64encode(cert.read_bytes()).decode(),
                },
                "rules": [
                    {
                        "apiGroups": ["resource.k8s.io"],
                        "apiVersions": ["*"],
                        "operations": ["CREATE", "UPDATE"],
                        "resources": ["resourceclaims", "resourceclaimtemplates"],
                    }
                ],
                "namespaceSelector": {"matchLabels": {selector_label: "true"}},
                "failurePolicy": "Fail",
                "sideEffects": "None",
                "admissionReviewVersions": ["v1"],
                "timeoutSeconds": 5,
            }
        ],
    }


def label_namespace(rest: RestClient, namespace: str, label: str) -> None:
    """Put ``namespace`` under the webhook registered for ``label``."""
    rest.request(
        "PATCH",
        f"/api/v1/namespaces/{namespace}",
        {"metadata": {"labels": {label: "true"}}},
        content_type="application/merge-patch+json",
    )


_ACCOUNT_OBJECTS = {
    "ServiceAccount": "/api/v1/namespaces/{namespace}/serviceaccounts",
    "ClusterRole": "/apis/rbac.authorization.k8s.io/v1/clusterroles",
    "ClusterRoleBinding": "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings",
}


@contextmanager
def chart_webhook_kubeconfig(cluster: ClusterInfo, namespace: str, driver: str, path: Path) -> Iterator[Path]:
    """A kubeconfig of the webhook's account as the chart makes it (webhook.enabled), with its role
    alone: the webhook is run with exactly the permissions the chart gives it, no more."""
    helm = Path(build_outputs("helm")["HELM_BIN_DIR"]) / "helm"
    chart = REPO_ROOT / "charts" / "dra-driver-gpu"
    argv = [str(helm), "template", "capwh", str(chart), "--namespace", namespace]
    argv += ["--set", "webhook.enabled=true", "--set", f"driverName={driver}"]
    rendered = subprocess.run(argv, check=True, capture_output=True, text=True).stdout
    objects = [
        obj
        for obj in yaml.safe_load_all(rendered)
        if obj and obj["kind"] in _ACCOUNT_OBJECTS and obj["metadata"]["name"].endswith("-webhook")
    ]
    rest = cluster.rest()
    created = []
    try:
        for obj in objects:
            collection = _ACCOUNT_OBJECTS[obj["kind"]].format(namespace=namespace)
            rest.create(collection, obj)
            created.append(f"{collection}/{obj['metadata']['name']}")
        (account,) = [obj["metadata"]["name"] for obj in objects if obj["kind"] == "ServiceAccount"]
        with cluster.api_client() as api:
            token = mint_service_account_token(api, namespace, account, expiration_seconds=7200)
        ca = cluster.ca_file.read_bytes()
        write_kubeconfig(path, server=cluster.server, ca_certificate=ca, user=account, token=token)
        yield path
    finally:
        for name in reversed(created):
            rest.delete(name)
