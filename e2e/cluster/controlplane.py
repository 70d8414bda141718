"""A real Kubernetes control plane on 127.0.0.1: etcd, kube-apiserver, kube-scheduler and
kube-controller-manager, on free ports, with all state under one directory.

There is no kubelet: Nodes are API objects (see nodes.py) and the DRA controllers that matter to a
driver -- claim allocation in the scheduler, the resourceclaim, device-taint-eviction, garbage
collector and namespace controllers -- are the upstream ones. node-lifecycle and taint-eviction are
left out because they would mark heartbeat-less fake nodes NotReady and evict their pods.
"""

from __future__ import annotations

import json
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import yaml
from kubernetes import client

from e2e.cluster import credentials, features, processes
from e2e.cluster.binaries import ControlPlaneBinaries
from e2e.cluster.processes import ProcessRecord
from e2e.cluster.rest import RestClient

ADMIN_USER = "admin"
# A real kubelet registers as its host name; --hostname-override=127.0.0.1 also gives the Node the
# InternalIP the API server reaches it at (a loopback --node-ip is refused). See e2e/realnode.
SCHEDULER_USER = "system:kube-scheduler"
REAL_NODE_NAME = "127.0.0.1"
SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"
_CONTROLLERS = (
    "resourceclaim-controller",
    "device-taint-eviction-controller",
    "garbage-collector-controller",
    "namespace-controller",
)
# Deployments get ReplicaSets and pods: without kubelets a test plays the kubelet of the MPS control
# daemon's pod (e2e/test_mps_deployment.py); with real kubelets the chart's Deployments (the
# compute-domain controller, the webhook) and the plugin's MPS daemons run on the node.
_DEPLOYMENT_CONTROLLERS = ("deployment-controller", "replicaset-controller")
# With real kubelets (ControlPlane(real_nodes=True)): DaemonSets get pods, every namespace its
# `default` ServiceAccount, every pod the kube-root-ca.crt ConfigMap its token volume projects.
# EndpointSlices: the API server reaches a webhook's Service at its pods (--enable-aggregator-routing).
_REAL_NODE_CONTROLLERS = (
    *_DEPLOYMENT_CONTROLLERS,
    "endpointslice-controller",
    "daemonset-controller",
    "serviceaccount-controller",
    "root-ca-certificate-publisher-controller",
)
_KUBELETLESS_CONTROLLERS = _DEPLOYMENT_CONTROLLERS
_POLL_SECONDS = 0.1
_STOP_GRACE_SECONDS = 10.0


class StartupError(RuntimeError):
    """A component did not become healthy; the message carries the end of its log."""


@dataclass(frozen=True)
class Ports:
    etcd_client: int
    etcd_peer: int
    apiserver: int
    scheduler: int
    controller_manager: int


@dataclass(frozen=True)
class ClusterInfo:
    """What a client needs to use a running control plane, and what `cluster down` needs to stop it.

    It is also the JSON state file that `python -m e2e.cluster` keeps between `up` and `down`.
    """

    kube_version: str
    server: str  # https://127.0.0.1:<port>
    kubeconfig: Path  # admin (system:masters), CA embedded
    admin_token: str
    ca_file: Path  # the API server's self-signed serving certificate chain
    base_dir: Path
    ports: Ports
    processes: tuple[ProcessRecord, ...]
    # With real_nodes: the kubelets' identity, and the CA that signed the API server's client
    # certificate for kubelets (a kubelet's authentication.x509.clientCAFile).
    node_token: str | None = None
    kubelet_client_ca_file: Path | None = None
    # With real_nodes: the Unix socket the API server sends its `cluster` egress to (HTTP CONNECT:
    # webhooks behind Services, logs, exec); the real node's API proxy serves it (e2e/realnode).
    cluster_egress_socket: Path | None = None

    def api_client(self, token: str | None = None) -> client.ApiClient:
        """A client of the API server that authenticates with `token` (default: the admin's)."""
        configuration = client.Configuration(
            host=self.server,
            api_key={"BearerToken": token or self.admin_token},
            api_key_prefix={"BearerToken": "Bearer"},
            ssl_ca_cert=str(self.ca_file),
        )
        return client.ApiClient(configuration)

    def rest(self, token: str | None = None) -> RestClient:
        """Plain JSON access for checks on exactly what the API server stores and says."""
        return RestClient(self.server, token or self.admin_token, self.ca_file)

    def to_json(self) -> str:
        return json.dumps(asdict(self), default=str, indent=2)

    @classmethod
    def from_json(cls, text: str) -> ClusterInfo:
        data: dict[str, Any] = json.loads(text)
        return cls(
            kube_version=data["kube_version"],
            server=data["server"],
            kubeconfig=Path(data["kubeconfig"]),
            admin_token=data["admin_token"],
            ca_file=Path(data["ca_file"]),
            base_dir=Path(data["base_dir"]),
            ports=Ports(**data["ports"]),
            processes=tuple(
                ProcessRecord(name=p["name"], pid=p["pid"], start_time=p["start_time"], log=Path(p["log"]))
                for p in data["processes"]
            ),
            node_token=data.get("node_token"),
            kubelet_client_ca_file=Path(data["kubelet_client_ca_file"])
            if data.get("kubelet_client_ca_file")
            else None,
            cluster_egress_socket=Path(data["cluster_egress_socket"])
            if data.get("cluster_egress_socket")
            else None,
        )


def stop_processes(records: tuple[ProcessRecord, ...]) -> None:
    """Stops recorded components, last started first, so none outlives what it depends on."""
    for record in reversed(records):
        processes.stop(record, grace_seconds=_STOP_GRACE_SECONDS)


def free_ports(count: int) -> list[int]:
    """Ports the kernel picks as free on 127.0.0.1; all held open together so none repeats."""
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


@dataclass(frozen=True)
class _Running:
    record: ProcessRecord
    child: subprocess.Popen[bytes]


class ControlPlane:
    """Starts the four components in dependency order and stops every one of them again.

    Use it as a context manager, or call start() and stop(); stop() is idempotent and also stops
    what a failed start() left running. With die_with_parent=True (tests) the kernel kills the
    components if this process dies without stopping them; `cluster up` passes False so that they
    outlive the command that started them.

    real_nodes=True prepares it for real kubelets (e2e/realnode): a node identity
    (system:node:127.0.0.1 in system:nodes, under the Node authorizer and NodeRestriction), a client
    certificate the API server presents to kubelets (logs, exec), ServiceAccount admission (pods get
    their token volume) and the controllers that DaemonSets and token volumes need.
    """

    def __init__(
        self,
        binaries: ControlPlaneBinaries,
        base_dir: Path,
        *,
        kubeconfig: Path | None = None,
        die_with_parent: bool = True,
        real_nodes: bool = False,
    ) -> None:
        self._real_nodes = real_nodes
        self._binaries = binaries
        self._base_dir = base_dir
        self._kubeconfig = kubeconfig or base_dir / "admin.kubeconfig"
        self._die_with_parent = die_with_parent
        self._children: list[_Running] = []
        self._info: ClusterInfo | None = None

    @property
    def _egress_socket(self) -> Path:
        return self._base_dir / "cluster-egress.sock"

    @property
    def info(self) -> ClusterInfo:
        if self._info is None:
            raise RuntimeError("the control plane is not running; call start() first")
        return self._info

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def start(self, timeout_seconds: float = 120.0) -> ClusterInfo:
        if self._children:
            raise RuntimeError("this control plane is already started")
        try:
            self._info = self._start(time.monotonic() + timeout_seconds)
        except BaseException:
            self.stop()
            raise
        return self._info

    def stop(self) -> None:
        """Stops every component this object started, and reaps them."""
        children, self._children = self._children, []
        self._info = None
        try:
            stop_processes(tuple(running.record for running in children))
        finally:
            for running in children:
                running.child.wait()

    def _start(self, deadline: float) -> ClusterInfo:
        base = self._base_dir
        logs = base / "logs"
        for directory in (logs, base / "etcd", base / "apiserver-certs"):
            directory.mkdir(parents=True, exist_ok=True)
        ports = Ports(*free_ports(5))
        admin = credentials.new_token(ADMIN_USER, "system:masters")
        scheduler = credentials.new_token(SCHEDULER_USER)
        node = credentials.new_token(f"system:node:{REAL_NODE_NAME}", "system:nodes")
        tokens = [admin, scheduler] + ([node] if self._real_nodes else [])
        credentials.write_token_file(base / "tokens.csv", tokens)
        if self._real_nodes:
            credentials.write_kubelet_client_certificate(base / "kubelet-client")
            (base / "egress-selector.yaml").write_text(yaml.safe_dump(_egress_selector(self._egress_socket)))
        credentials.write_service_account_key(base / "service-account.key")
        # The three binaries of a release share one feature-gate registry; asking one of them suffices.
        gates = features.feature_gates_flag(features.settable_gates(self._binaries.kube_apiserver))
        server = f"https://127.0.0.1:{ports.apiserver}"
        ca_file = base / "apiserver-certs" / "apiserver.crt"

        etcd = self._launch("etcd", self._etcd_args(ports), logs)
        etcd_health = f"http://127.0.0.1:{ports.etcd_client}/health"
        _wait_until("etcd", etcd, deadline, _http_ok(etcd_health, b'"health":"true"'))
        apiserver = self._launch("kube-apiserver", self._apiserver_args(ports, gates), logs)
        _wait_until("kube-apiserver", apiserver, deadline, _apiserver_ready(server, ca_file, admin.token))

        ca = ca_file.read_bytes()
        credentials.write_kubeconfig(self._kubeconfig, server=server, ca_certificate=ca, **_identity(admin))
        scheduler_kubeconfig = base / "scheduler.kubeconfig"
        credentials.write_kubeconfig(
            scheduler_kubeconfig, server=server, ca_certificate=ca, **_identity(scheduler)
        )
        scheduler_config = base / "scheduler.yaml"
        scheduler_config.write_text(yaml.safe_dump(_scheduler_configuration(scheduler_kubeconfig)))

        kube_scheduler = self._launch(
            "kube-scheduler", self._scheduler_args(ports, gates, scheduler_config), logs
        )
        controller_manager = self._launch(
            "kube-controller-manager", self._controller_manager_args(ports, gates), logs
        )
        _wait_until("kube-scheduler", kube_scheduler, deadline, _http_ok(_healthz(ports.scheduler), b"ok"))
        controller_manager_health = _http_ok(_healthz(ports.controller_manager), b"ok")
        _wait_until("kube-controller-manager", controller_manager, deadline, controller_manager_health)
        return ClusterInfo(
            kube_version=self._binaries.kube_version,
            server=server,
            kubeconfig=self._kubeconfig,
            admin_token=admin.token,
            ca_file=ca_file,
            base_dir=base,
            ports=ports,
            processes=tuple(running.record for running in self._children),
            node_token=node.token if self._real_nodes else None,
            kubelet_client_ca_file=base / "kubelet-client" / "ca.crt" if self._real_nodes else None,
            cluster_egress_socket=self._egress_socket if self._real_nodes else None,
        )

    def _launch(self, name: str, argv: list[str], logs: Path) -> _Running:
        child, record = processes.spawn(
            name, argv, logs / f"{name}.log", die_with_parent=self._die_with_parent
        )
        running = _Running(record, child)
        self._children.append(running)
        return running

    def _etcd_args(self, ports: Ports) -> list[str]:
        client_url = f"http://127.0.0.1:{ports.etcd_client}"
        peer = f"http://127.0.0.1:{ports.etcd_peer}"
        return [
            str(self._binaries.etcd),
            f"--data-dir={self._base_dir / 'etcd'}",
            f"--listen-client-urls={client_url}",
            f"--advertise-client-urls={client_url}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=default={peer}",
            "--unsafe-no-fsync=true",  # throw-away data: durability only costs time
        ]

    def _apiserver_args(self, ports: Ports, gates: str) -> list[str]:
        base = self._base_dir
        key = base / "service-account.key"
        # No ServiceAccount admission: no controller creates the `default` accounts it would demand.
        # No TaintNodesByCondition: it would taint new Nodes not-ready, and no kubelet clears that.
        disabled_admission = (
            "TaintNodesByCondition" if self._real_nodes else "ServiceAccount,TaintNodesByCondition"
        )
        kubelet_client = base / "kubelet-client"
        real_node_args = [
            f"--kubelet-client-certificate={kubelet_client / 'client.crt'}",
            f"--kubelet-client-key={kubelet_client / 'client.key'}",
            # The pods are in the node's network namespace: webhooks behind a Service are called at
            # their pods' addresses, through the node's proxy, as through Konnectivity.
            f"--egress-selector-config-file={base / 'egress-selector.yaml'}",
            "--enable-aggregator-routing=true",
        ]
        return [
            str(self._binaries.kube_apiserver),
            f"--etcd-servers=http://127.0.0.1:{ports.etcd_client}",
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            f"--secure-port={ports.apiserver}",
            f"--cert-dir={base / 'apiserver-certs'}",  # self-signed serving certificate
            f"--token-auth-file={base / 'tokens.csv'}",
            "--authorization-mode=Node,RBAC",
            f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
            f"--service-account-key-file={key}",
            f"--service-account-signing-key-file={key}",
            "--service-cluster-ip-range=10.0.0.0/24",
            "--allow-privileged=true",
            f"--disable-admission-plugins={disabled_admission}",
            "--endpoint-reconciler-type=none",
            f"--feature-gates={gates}",
            f"--runtime-config={features.runtime_config_flag(self._binaries.kube_version)}",
            *(real_node_args if self._real_nodes else []),
        ]

    def _scheduler_args(self, ports: Ports, gates: str, config: Path) -> list[str]:
        return [
            str(self._binaries.kube_scheduler),
            f"--config={config}",
            f"--feature-gates={gates}",
            "--bind-address=127.0.0.1",
            f"--secure-port={ports.scheduler}",
        ]

    def _extra_controllers(self) -> tuple[str, ...]:
        return _REAL_NODE_CONTROLLERS if self._real_nodes else _KUBELETLESS_CONTROLLERS

    def _controller_manager_args(self, ports: Ports, gates: str) -> list[str]:
        return [
            str(self._binaries.kube_controller_manager),
            # Admin rather than system:kube-controller-manager: that identity's RBAC relies on per-controller
            # service-account credentials, which need controllers this cluster leaves out.
            f"--kubeconfig={self._kubeconfig}",
            "--leader-elect=false",
            f"--controllers={','.join(_CONTROLLERS + self._extra_controllers())}",
            f"--feature-gates={gates}",
            "--bind-address=127.0.0.1",
            f"--secure-port={ports.controller_manager}",
        ]


def _identity(token: credentials.StaticToken) -> dict[str, str]:
    return {"user": token.user, "token": token.token}


def _egress_selector(socket_path: Path) -> dict[str, Any]:
    """The API server's traffic to the cluster goes as HTTP CONNECT over `socket_path`."""
    return {
        "apiVersion": "apiserver.k8s.io/v1beta1",
        "kind": "EgressSelectorConfiguration",
        "egressSelections": [
            {
                "name": "cluster",
                "connection": {
                    "proxyProtocol": "HTTPConnect",
                    "transport": {"uds": {"udsName": str(socket_path)}},
                },
            }
        ],
    }


def _scheduler_configuration(kubeconfig: Path) -> dict[str, Any]:
    return {
        "apiVersion": "kubescheduler.config.k8s.io/v1",
        "kind": "KubeSchedulerConfiguration",
        "clientConnection": {"kubeconfig": str(kubeconfig)},
        "leaderElection": {"leaderElect": False},
    }


def _healthz(port: int) -> str:
    return f"https://127.0.0.1:{port}/healthz"


_Probe = Callable[[], bool]


def _http_ok(url: str, expected: bytes) -> _Probe:
    # The scheduler and controller manager serve /healthz with an in-memory self-signed certificate
    # that nothing can verify; this probe only asks whether they are healthy.
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return lambda: _get(urllib.request.Request(url), context, expected)


def _apiserver_ready(server: str, ca_file: Path, token: str) -> _Probe:
    request = urllib.request.Request(f"{server}/readyz", headers={"Authorization": f"Bearer {token}"})

    def probe() -> bool:
        try:  # the API server writes its certificate early in its start-up
            context = ssl.create_default_context(cafile=str(ca_file))
        except OSError:
            return False
        return _get(request, context, b"ok")

    return probe


def _get(request: urllib.request.Request, context: ssl.SSLContext, expected: bytes) -> bool:
    try:
        with urllib.request.urlopen(request, context=context, timeout=2) as response:
            return response.status == 200 and expected in response.read()
    except (OSError, urllib.error.URLError):
        return False


def _wait_until(name: str, running: _Running, deadline: float, probe: _Probe) -> None:
    """Polls `probe` until it passes; fails early, with the log, if the component exits."""
    while not probe():
        if running.child.poll() is not None:
            status = running.child.returncode
            raise StartupError(f"{name} exited with status {status}:\n{_tail(running.record.log)}")
        if time.monotonic() > deadline:
            raise StartupError(f"{name} was not healthy in time:\n{_tail(running.record.log)}")
        time.sleep(_POLL_SECONDS)


def _tail(log: Path, lines: int = 25) -> str:
    text = log.read_text(errors="replace") if log.exists() else ""
    return "\n".join(f"  | {line}" for line in text.splitlines()[-lines:]) + f"\n(full log: {log})"
