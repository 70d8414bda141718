"""Who may talk to the local API server, and the files that say so.

Static bearer tokens (--token-auth-file) give each client an identity without a certificate
authority: the admin (system:masters) and kube-scheduler, which runs as the `system:kube-scheduler`
user that the API server's bootstrap RBAC policy grants exactly the scheduler's permissions, so a
missing DRA permission shows up here as it would in a real cluster.
"""

from __future__ import annotations

import base64
import secrets
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import yaml


@dataclass(frozen=True)
class StaticToken:
    token: str
    user: str
    groups: tuple[str, ...] = ()


def new_token(user: str, *groups: str) -> StaticToken:
    return StaticToken(token=secrets.token_urlsafe(32), user=user, groups=groups)


def write_token_file(path: Path, tokens: list[StaticToken]) -> None:
    """Writes the CSV that --token-auth-file reads: token,user,uid,"group1,group2"."""
    lines = [f'{t.token},{t.user},{t.user},"{",".join(t.groups)}"' for t in tokens]
    path.write_text("\n".join(lines) + "\n")
    path.chmod(0o600)


def write_service_account_key(path: Path) -> None:
    """Writes one RSA private key; the API server signs service-account tokens with it and verifies
    them with its public half (both flags accept the private key file)."""
    openssl = shutil.which("openssl")
    if openssl is None:
        raise RuntimeError(
            "openssl is needed to create the service-account signing key; "
            "install it (apt-get install openssl) and run again"
        )
    subprocess.run(
        [openssl, "genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048", "-out", str(path)],
        check=True,
        capture_output=True,
    )
    path.chmod(0o600)


def write_kubelet_client_certificate(directory: Path) -> None:
    """A CA and the client certificate the API server presents to kubelets (logs, exec, port-forward).

    A kubelet trusts the CA (authentication.x509.clientCAFile) and asks the API server whether the
    certificate's user may do what it asks (webhook authorization); the user is in system:masters.
    """
    openssl = shutil.which("openssl")
    if openssl is None:
        raise RuntimeError(
            "openssl is needed to create the kubelet client certificate; install it and run again"
        )
    directory.mkdir(parents=True, exist_ok=True)

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], check=True, capture_output=True, cwd=directory)

    run(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-days",
        "2",
        "-subj",
        "/CN=dra-driver-kubelet-client-ca",
    )
    run(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "client.key",
        "-out",
        "client.csr",
        "-subj",
        "/O=system:masters/CN=kube-apiserver-kubelet-client",
    )
    run(
        "x509",
        "-req",
        "-in",
        "client.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "client.crt",
        "-days",
        "2",
    )
    for key in ("ca.key", "client.key"):
        (directory / key).chmod(0o600)


def write_kubeconfig(path: Path, *, server: str, ca_certificate: bytes, user: str, token: str) -> None:
    """Writes a self-contained kubeconfig (the CA is embedded) for one token identity."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "local",
                "cluster": {
                    "server": server,
                    "certificate-authority-data": base64.b64encode(ca_certificate).decode(),
                },
            }
        ],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": "local", "context": {"cluster": "local", "user": user}}],
        "current-context": "local",
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    path.chmod(0o600)
