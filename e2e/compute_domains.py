"""ComputeDomains end to end: what is real, and what plays the part of what this machine lacks.

Real: the control plane (API server, scheduler, the resourceclaim, garbage-collector, DaemonSet and
Job controllers), the CRD and DeviceClasses as the chart renders them, the controller process
(`dra-driver compute-domain-controller`), each node's kubelet DRA code (the harness) and driver
process with its two drivers, and every claim, allocation, prepare and CDI spec along the way.

Two of the four trays run the NVML backend on the mock libnvidia-ml.so.1 (a GB200 NVL72 tray whose
GPUs report fabric info), the other two the simulator: the domain of the main test lands on the
NVML trays.

Played: there is no container runtime, so no container of an IMEX daemon pod starts by itself.
:class:`DaemonPodRunner` is the runtime for exactly those pods: once the harness has prepared a daemon
pod's claim and reports it Running, the runner starts `dra-driver compute-domain-daemon` (the
simulated IMEX daemon) with what the container would get -- the CDI spec's environment and its
``/imexd`` mount (as the host directory), the downward API's NODE_NAME/POD_IP -- restarts it when it
dies (restartPolicy Always) and stops it when the pod goes. Each node gets its own loopback address
as pod IP, so the daemons reach each other over real TCP.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from e2e.cluster import ClusterInfo, RestClient, processes
from e2e.cluster.binaries import ControlPlaneBinaries
from e2e.cluster.controlplane import free_ports
from e2e.daemon import Daemon
from e2e.gpu_node import GpuNode

DRIVER = "gpu.nvidia.com"  # deployed as NVIDIA's stand-in: NVIDIA's manifests apply unchanged
CD_DRIVER = "compute-domain.nvidia.com"
GROUP = "resource.nvidia.com"
LABEL = f"{GROUP}/computeDomain"
CDI_ANNOTATION = "dra-harness.dra-driver.dev/cdi-devices"


IMEX_CHANNEL_MAJOR = 508  # what the kernel gave nvidia-caps-imex-channels on the mock trays


def nvml_tray_wrapper(base: Path, cluster_uuid: str, clique: int) -> list[str]:
    """How a GB200 tray on the mock NVML starts its driver: in clique ``clique`` of the mock's fabric,
    seeing a ``/proc/devices`` with the NVIDIA driver's IMEX channel device, as a host with the
    driver loaded shows it. This machine's kernel has none; the driver reads the file as on a host
    (NVIDIA's plugin reads it too), so a private mount namespace of the driver's process alone gets
    one bind-mounted over it. The namespace ends with the process.
    """
    devices = base / "proc-devices"
    devices.parent.mkdir(parents=True, exist_ok=True)
    devices.write_text(
        "Character devices:\n  1 mem\n195 nvidia\n"
        f"{IMEX_CHANNEL_MAJOR} nvidia-caps-imex-channels\n509 nvidia-caps\n510 nvidia-uvm\n\n"
        "Block devices:\n  8 sd\n"
    )
    unshare = ["unshare", "--mount"] if os.geteuid() == 0 else ["unshare", "--map-root-user", "--mount"]
    return [
        "env",
        f"MOCK_NVML_FABRIC={cluster_uuid}/{clique}",
        *unshare,
        "sh",
        "-c",
        'mount --bind "$0" /proc/devices && exec "$@"',
        str(devices),
    ]


def domains_path(namespace: str, name: str = "") -> str:
    path = f"/apis/{GROUP}/v1beta1/namespaces/{namespace}/computedomains"
    return f"{path}/{name}" if name else path


class ExtraControllers:
    """A second kube-controller-manager running the DaemonSet and Job controllers, which the shared
    control plane leaves out (their pods would land on other tests' nodes)."""

    def __init__(self, binaries: ControlPlaneBinaries, cluster: ClusterInfo, log: Path) -> None:
        (port,) = free_ports(1)
        self._argv = [
            str(binaries.kube_controller_manager),
            f"--kubeconfig={cluster.kubeconfig}",
            "--leader-elect=false",
            "--controllers=daemonset-controller,job-controller",
            "--bind-address=127.0.0.1",
            f"--secure-port={port}",
        ]
        self.daemon = Daemon("kube-controller-manager[daemonset,job]", log)

    def start(self) -> None:
        def ready(offset: int) -> bool:
            log = self.daemon.log_since(offset)
            return "Starting daemon sets controller" in log and "Starting job controller" in log

        self.daemon.start(self._argv, ready, timeout_seconds=60)

    def stop(self) -> None:
        self.daemon.stop()


class ControllerProcess:
    """One replica of `dra-driver compute-domain-controller`; replicas elect a leader on a Lease."""

    LEASE = "cd-dra-driver-gpu-compute-domain-controller"  # the chart's, for release "cd"
    # Short, so that a hand-over fits in a test; long enough that a loaded machine does not make the
    # leader miss its renew deadline (2/3 of it) and exit, with no Deployment here to restart it.
    LEASE_SECONDS = 9.0

    def __init__(
        self,
        kubeconfig: Path,
        namespace: str,
        log: Path,
        ready_timeout: float,
        name: str,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.namespace = namespace
        self.name = name
        self._argv = [
            sys.executable,
            "-m",
            "dra_driver",
            "compute-domain-controller",
            f"--driver-name={DRIVER}",
            f"--namespace={namespace}",
            "--daemon-image=ghcr.io/dra-driver/dra-driver-gpu:e2e",
            f"--kubeconfig={kubeconfig}",
            f"--daemon-ready-timeout-seconds={ready_timeout}",
            "--resync-seconds=30",
            f"--lease-name={self.LEASE}",
            f"--lease-duration-seconds={self.LEASE_SECONDS}",
            "--log-format=console",
            *extra_args,
        ]
        self.daemon = Daemon(f"compute-domain-controller[{name}]", log)
        self._offset = 0

    def start(self) -> None:
        """Starts the replica; returns once it takes part in the election (it may stand by)."""
        self._offset = self.daemon.log_size()
        self.daemon.start(
            [*self._argv],
            lambda offset: "waiting for the leader lease" in self.daemon.log_since(offset),
            timeout_seconds=60,
        )

    def log(self) -> str:
        """What this run of the replica logged."""
        return self.daemon.log_since(self._offset)

    @property
    def leading(self) -> bool:
        return self.daemon.running and "controller running" in self.log()

    def kill(self) -> None:
        """SIGKILL, as a crashed or cut-off node would: the Lease is not released."""
        pid = self.daemon.pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        self.daemon.stop()  # reaps it

    def stop(self) -> None:
        self.daemon.stop()


@dataclass
class _Running:
    pod_uid: str
    process: subprocess.Popen[bytes]
    env: dict[str, str]
    config_dir: str
    restarts: int = 0


@dataclass
class DaemonPodRunner:
    """The container runtime of the IMEX daemon pods (see the module docstring)."""

    rest: RestClient
    kubeconfig: Path  # the daemon pods' identity
    namespace: str
    nodes: dict[str, GpuNode]
    pod_ips: dict[str, str]
    port: int
    log_dir: Path
    _running: dict[str, _Running] = field(default_factory=dict)  # by node name
    _held: set[str] = field(default_factory=set)  # nodes whose daemon container has not started yet
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="daemon-pod-runner", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stops the daemons (SIGTERM, as the kubelet stops a container) and the runner."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)

    def kill(self, node: str) -> None:
        """SIGKILL the daemon of `node`, as a crash would; the runner starts it again."""
        with self._lock:
            self._running[node].process.kill()

    def hold(self, nodes: set[str]) -> None:
        """Start no new daemon on `nodes` until :meth:`release`: its pod Running, its IMEX daemon not
        yet up, as a container whose image is still being pulled."""
        with self._lock:
            self._held |= nodes

    def release(self) -> None:
        with self._lock:
            self._held.clear()

    def running_on(self) -> set[str]:
        with self._lock:
            return {node for node, run in self._running.items() if run.process.poll() is None}

    def restarts(self, node: str) -> int:
        with self._lock:
            return self._running[node].restarts if node in self._running else 0

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._sync()
            except Exception as error:  # the API server busy: look again
                print(f"daemon-pod-runner: {error}", file=sys.stderr)
            self._stop.wait(0.3)
        # In this thread: the daemons die with the thread that started them (PR_SET_PDEATHSIG), so
        # they get their SIGTERM first.
        with self._lock:
            for node in list(self._running):
                self._end(node)

    def _sync(self) -> None:
        pods = self.rest.request(
            "GET", f"/api/v1/namespaces/{self.namespace}/pods", query={"labelSelector": LABEL}
        )["items"]
        wanted: dict[str, dict] = {}
        for pod in pods:
            node = pod["spec"].get("nodeName")
            running = pod.get("status", {}).get("phase") == "Running"
            if node in self.nodes and running and not pod["metadata"].get("deletionTimestamp"):
                wanted[node] = pod
        with self._lock:
            for node in [
                n
                for n, run in self._running.items()
                if wanted.get(n, {}).get("metadata", {}).get("uid") != run.pod_uid
            ]:
                self._end(node)
            for node, pod in wanted.items():
                run = self._running.get(node)
                if run is None:
                    if node not in self._held:
                        self._begin(node, pod)
                elif run.process.poll() is not None:  # died: restartPolicy Always
                    run.process = self._spawn(node, run.env, run.config_dir)
                    run.restarts += 1

    def _begin(self, node: str, pod: dict) -> None:
        devices = json.loads(pod["metadata"].get("annotations", {}).get(CDI_ANNOTATION, "{}"))
        ids = devices.get("compute-domain-daemon") or []
        (cdi_id,) = [i for i in ids if i.startswith(f"k8s.{CD_DRIVER}/claim=")]
        claim_uid = cdi_id.split("=", 1)[1].removesuffix("-daemon-0")
        spec_file = self.nodes[node].driver.paths.cdi / f"k8s.{CD_DRIVER}-claim_{claim_uid}.json"
        spec = json.loads(spec_file.read_text())
        # The container's own variables with plain values (the DaemonSet's, from the controller),
        # then the CDI spec's, then what the downward API would give: as containerd composes them.
        (container,) = pod["spec"]["containers"]
        env: dict[str, str] = {e["name"]: e["value"] for e in container.get("env") or [] if "value" in e}
        for entry in [
            *spec.get("containerEdits", {}).get("env", []),
            *(e for d in spec["devices"] for e in d["containerEdits"].get("env", [])),
        ]:
            key, _, value = entry.partition("=")
            env[key] = value
        (mount,) = [m for m in spec["containerEdits"]["mounts"] if m["containerPath"] == "/imexd"]
        env.update(
            NODE_NAME=node,
            POD_IP=self.pod_ips[node],
            POD_NAME=pod["metadata"]["name"],
            POD_UID=pod["metadata"]["uid"],
            POD_NAMESPACE=self.namespace,
            DRA_DRIVER_NAME=DRIVER,
            DRA_KUBECONFIG=str(self.kubeconfig),
            DRA_IMEX_CONFIG_DIR=mount["hostPath"],
            DRA_IMEX_SERVER_PORT=str(self.port),
            DRA_LOG_FORMAT="console",
            DRA_HOSTS_FILE=str(self._hosts_file(node, pod)),
        )
        self._running[node] = _Running(
            pod["metadata"]["uid"], self._spawn(node, env, mount["hostPath"]), env, mount["hostPath"]
        )

    def hosts_file(self, node: str) -> Path:
        """The /etc/hosts of the daemon pod on `node` (the kubelet writes one per pod)."""
        return self.log_dir / f"hosts-{node}"

    def _hosts_file(self, node: str, pod: dict) -> Path:
        """A fresh pod's /etc/hosts as the kubelet writes it: localhost and the pod's own name."""
        path = self.hosts_file(node)
        path.write_text(
            "# Kubernetes-managed hosts file.\n127.0.0.1\tlocalhost\n"
            f"{self.pod_ips[node]}\t{pod['metadata']['name']}\n"
        )
        return path

    def config_dir(self, node: str) -> Path:
        """The daemon's /imexd on `node` (its CDI mount's host path)."""
        with self._lock:
            return Path(self._running[node].config_dir)

    def _spawn(self, node: str, env: dict[str, str], config_dir: str) -> subprocess.Popen[bytes]:
        child, _ = processes.spawn(
            f"imex-daemon[{node}]",
            [sys.executable, "-m", "dra_driver", "compute-domain-daemon"],
            self.log_dir / f"imex-daemon-{node}.log",
            die_with_parent=True,  # a test run that dies leaves no daemon behind
            env={**os.environ, **env},
        )
        return child

    def _end(self, node: str) -> None:
        run = self._running.pop(node)
        if run.process.poll() is None:
            run.process.terminate()
            try:
                run.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                run.process.kill()
                run.process.wait()


def wait(probe, *, timeout: float, what: str):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(0.3)
    raise TimeoutError(f"gave up after {timeout:.0f}s waiting for {what}; last: {last!r}")
