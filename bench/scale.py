"""``make scale``: many simulated GPU nodes on one real control plane, as a cluster operator sees them.

Every node is what a real one runs: the kubelet (the kubelet harness, the kubelet's own DRA and plugin
managers) and our driver daemon (8 simulated H100s, every MIG placement published), each its own
process, side by side on the node's registration directory. The phases, in order:

1. **publish**: all drivers start (a few at a time: the machine has few cores); the clock stops when
   every node's ResourceSlices are published and valid, checked as a user reads them (bench/scale_checks.py).
2. **steady**: nothing happens for a while; the API server's own ``apiserver_request_total`` says
   which requests the nodes still make (watches excluded) and its process how much CPU it burns.
3. **pods**: one-GPU claims and pods for every GPU of the cluster; the real kube-scheduler places
   them, the kubelets have the drivers prepare them; the clock stops when every pod runs. Then every
   claim's allocation is checked against the CDI specs on its node.
4. **rolling restart**: every driver is restarted, one node at a time, as the chart's DaemonSet
   rolls (surge: the new instance starts next to the old one, which then stops), while pods on the
   node being restarted are replaced, so that prepares and unprepares keep arriving. Failed prepares
   are the kubelet's FailedPrepareDynamicResources events and pods that never ran.

Writes ``_output/scale.json``; everything it started is stopped on success, failure and Ctrl-C. How to
run it and read it: bench/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import shutil
import signal
import ssl
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from bench.scale_checks import (
    JsonObject,
    expected_devices,
    gpu_uuids,
    open_watches,
    pool_problems,
    request_counts,
    steady_requests,
)
from dra_driver.settings import DEFAULT_DRIVER_NAME
from dra_driver.simulated.gpus import SimulatedBackend
from e2e import manifests
from e2e.cluster import ApiError, ClusterInfo, ControlPlane, RestClient, ensure_control_plane_binaries
from e2e.cluster.nodes import GPU_NODE_LABELS
from e2e.daemon import Daemon, DaemonError
from e2e.driver import DriverPaths, DriverProcess
from e2e.harness import KubeletHarness, ensure_harness_binary

DRIVER = DEFAULT_DRIVER_NAME
PROFILE = "dgx-h100"
GPUS_PER_NODE = 8
NAMESPACE = "scale"
OUTPUT = Path("_output/scale.json")
LOGS = "scale-logs"  # beside the report: every log of a run that failed
# What one node takes from the machine, measured (bench/README.md): PSS of the driver ~55 MiB and of
# the kubelet harness ~15 MiB (their RSS is 80 and 50 MiB, counting the pages they share); the control
# plane grows with the slices it keeps. The run refuses to start without this much memory
# available, and stops if the machine runs low meanwhile: other work shares it.
NODE_MIB = 100
CONTROL_PLANE_MIB = 1500
LOW_MEMORY_MIB = 1024
HEARTBEAT = "10s"  # the kubelet's node status update frequency
POLL_S = 1.0
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
_START_TIMEOUT_S = 300.0  # a 2-core machine under a load of 40 starts Python daemons slowly
_PORT_ATTEMPTS = 3


class ScaleError(RuntimeError):
    """The run cannot go on; the message says why (and where the logs are)."""


# --- one simulated node -------------------------------------------------------------------------------


class ScaleNode:
    """A node's kubelet harness and driver; the driver can be rolled to a new instance (new pod UID)."""

    def __init__(
        self, info: ClusterInfo, harness_binary: Path, base: Path, name: str, *, mig_partitions: bool
    ) -> None:
        self.name = name
        self.mig_partitions = mig_partitions
        self.base = base
        self._info = info
        registry = base / "registry"
        self.paths = DriverPaths.under(base / "d", registry)  # socket paths must stay short
        self.harness = KubeletHarness(
            harness_binary,
            kubeconfig=info.kubeconfig,
            node_name=name,
            registry_dir=registry,
            state_dir=base / "kubelet",
            log=base / "kubelet-harness.log",
            labels=GPU_NODE_LABELS,
            heartbeat_interval=HEARTBEAT,
        )
        self.instances = 0
        self.driver = self._new_driver()

    def _new_driver(self) -> DriverProcess:
        """An instance as the DaemonSet's pod would be: a pod UID of its own names its sockets."""
        self.instances += 1
        return DriverProcess(
            kubeconfig=self._info.kubeconfig,
            node_name=self.name,
            paths=self.paths,
            log=self.base / f"dra-driver-{self.instances}.log",
            profile=PROFILE,
            extra_args=[
                f"--pod-uid={uuid.uuid4()}",
                f"--mig-partitions={'all' if self.mig_partitions else 'none'}",
            ],
        )

    def start_driver(self, driver: DriverProcess | None = None) -> None:
        """Starts the driver; again on a new port if another process took its port meanwhile (the
        port is picked free, but a hundred daemons and their connections take ports all the time)."""
        driver = driver or self.driver
        for attempt in range(_PORT_ATTEMPTS):
            try:
                driver.start(timeout_seconds=_START_TIMEOUT_S)
                return
            except DaemonError as error:
                if "address already in use" not in str(error) or attempt == _PORT_ATTEMPTS - 1:
                    raise

    def roll(self) -> tuple[float, int | None]:
        """Surge: a new instance starts and is ready before the old one stops. Seconds until the new
        one was ready, and the old one's exit status (0: a clean shutdown)."""
        started = time.monotonic()
        new = self._new_driver()
        self.start_driver(new)
        ready = time.monotonic() - started
        old, self.driver = self.driver, new
        return ready, old.stop()

    @property
    def daemons(self) -> tuple[Daemon, ...]:
        return (self.driver.daemon, self.harness.daemon)


def terminate(daemons: Iterable[Daemon]) -> None:
    """SIGTERM to all first, then wait for each: the stops overlap instead of adding up."""
    running = [daemon for daemon in daemons if daemon.running]
    for daemon in running:
        pid = daemon.pid
        if pid is not None:  # each daemon leads its own process group (e2e/cluster/processes.py)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGTERM)
    for daemon in running:
        daemon.stop()


# --- measuring processes and the machine --------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS  # utime + stime


def memory_mib(pid: int) -> tuple[float, float]:
    """(RSS, PSS) in MiB. PSS splits shared pages (the interpreter, libraries) among the processes that
    map them: the sum of PSS is what the processes really take from the machine."""
    values = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("Rss", "Pss"):
            values[key] = int(rest.split()[0]) / 1024
    return values["Rss"], values["Pss"]


def available_mib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    raise ScaleError("no MemAvailable in /proc/meminfo")


def summary(values: Sequence[float]) -> JsonObject:
    ordered = sorted(values)
    if not ordered:
        return {"count": 0}
    return {
        "count": len(ordered),
        "mean": round(sum(ordered) / len(ordered), 2),
        "p50": round(ordered[len(ordered) // 2], 2),
        "max": round(ordered[-1], 2),
    }


class MemoryGuard:
    """Watches the machine's available memory; interrupts the run before the machine runs out."""

    def __init__(self, low_mib: float) -> None:
        self.low_mib = low_mib
        self.lowest_mib = available_mib()
        self.tripped = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="memory-guard", daemon=True)

    def __enter__(self) -> MemoryGuard:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._stop.wait(1.0):
            available = available_mib()
            self.lowest_mib = min(self.lowest_mib, available)
            if available < self.low_mib and not self.tripped:
                self.tripped = True
                signal.raise_signal(signal.SIGINT)  # the main thread stops and cleans up


# --- the API server -----------------------------------------------------------------------------------


@dataclass
class Server:
    info: ClusterInfo
    rest: RestClient = field(init=False)
    pids: dict[str, int] = field(init=False)
    _connections: threading.local = field(init=False)

    def __post_init__(self) -> None:
        self.rest = self.info.rest()
        self._connections = threading.local()
        self.pids = {record.name: record.pid for record in self.info.processes}

    def metrics(self) -> str:
        """The API server's own /metrics (Prometheus text)."""
        request = urllib.request.Request(
            f"{self.info.server}/metrics", headers={"Authorization": f"Bearer {self.info.admin_token}"}
        )
        context = ssl.create_default_context(cafile=str(self.info.ca_file))
        with urllib.request.urlopen(request, context=context, timeout=30) as response:
            text: str = response.read().decode()
            return text

    def cpu(self) -> dict[str, float]:
        return {name: cpu_seconds(pid) for name, pid in self.pids.items()}

    def rss_mib(self) -> dict[str, float]:
        return {name: round(memory_mib(pid)[0], 1) for name, pid in self.pids.items()}

    def slices_by_node(self) -> dict[str, list[JsonObject]]:
        items = self.rest.request("GET", manifests_path("resourceslices"), query=driver_query())["items"]
        by_node: dict[str, list[JsonObject]] = {}
        for item in items:
            by_node.setdefault(item["spec"].get("nodeName", ""), []).append(item)
        return by_node

    def create(self, collection: str, body: JsonObject) -> None:
        """POST on a kept-alive connection of this thread: a new TLS handshake per object would cost
        the benchmark more CPU than the API server spends storing it."""
        connection = getattr(self._connections, "https", None)
        if connection is None:
            host, _, port = self.info.server.removeprefix("https://").partition(":")
            context = ssl.create_default_context(cafile=str(self.info.ca_file))
            connection = http.client.HTTPSConnection(host, int(port), context=context, timeout=30)
            self._connections.https = connection
        headers = {"Authorization": f"Bearer {self.info.admin_token}", "Content-Type": "application/json"}
        try:
            connection.request("POST", collection, body=json.dumps(body), headers=headers)
            response = connection.getresponse()
            answer = response.read()
        except (OSError, http.client.HTTPException):
            connection.close()
            self._connections.https = None
            raise
        if response.status != 201:
            raise ScaleError(f"POST {collection} answered {response.status}: {answer[:300].decode()}")

    def list(self, path: str, **query: str) -> list[JsonObject]:
        items: list[JsonObject] = self.rest.request("GET", path, query=query or None)["items"]
        return items


def manifests_path(resource: str, namespace: str | None = None) -> str:
    prefix = "/apis/resource.k8s.io/v1" if resource.startswith("resource") else "/api/v1"
    return f"{prefix}/namespaces/{namespace}/{resource}" if namespace else f"{prefix}/{resource}"


def driver_query() -> dict[str, str]:
    return {"fieldSelector": f"spec.driver={DRIVER}"}


@dataclass
class Phase:
    """Wall time, and the API server's CPU and non-watch requests, over one phase of the run."""

    server: Server
    wall_s: float = 0.0
    cpu_s: dict[str, float] = field(default_factory=dict)
    requests: float = 0.0

    @contextlib.contextmanager
    def measured(self) -> Iterator[None]:
        cpu, counts, started = self.server.cpu(), request_counts(self.server.metrics()), time.monotonic()
        yield
        self.wall_s = time.monotonic() - started
        after = self.server.cpu()
        self.cpu_s = {name: round(after[name] - cpu[name], 2) for name in after}
        self.requests = sum(request_counts(self.server.metrics()).values()) - sum(counts.values())

    def report(self) -> JsonObject:
        return {
            "wall_s": round(self.wall_s, 2),
            "cpu_s": self.cpu_s,
            "apiserver_cores": round(self.cpu_s.get("kube-apiserver", 0.0) / max(self.wall_s, 1e-9), 3),
            "apiserver_requests": self.requests,
        }


# --- checks as a user makes them ----------------------------------------------------------------------


def cluster_pool_problems(server: Server, nodes: Sequence[ScaleNode], expected: frozenset[str]) -> list[str]:
    by_node = server.slices_by_node()
    problems = [
        problem
        for node in nodes
        for problem in pool_problems(node.name, by_node.get(node.name, []), expected, DRIVER)
    ]
    strangers = sorted(by_node.keys() - {node.name for node in nodes})
    if strangers:
        problems.append(f"slices of nodes that are not in the run: {strangers[:5]}")
    uuids = [uuid for items in by_node.values() for uuid in gpu_uuids(items, DRIVER)]
    if len(uuids) != len(set(uuids)):
        problems.append(f"{len(uuids) - len(set(uuids))} GPU UUIDs published by more than one device")
    return problems


def wait_for_valid_pools(
    server: Server, nodes: Sequence[ScaleNode], expected: frozenset[str], timeout_s: float
) -> list[str]:
    """Until every pool is valid (empty list), or the problems seen last when time is up."""
    deadline = time.monotonic() + timeout_s
    while True:
        problems = cluster_pool_problems(server, nodes, expected)
        if not problems or time.monotonic() > deadline:
            return problems
        time.sleep(POLL_S * 5)


def one_gpu_claim(name: str) -> JsonObject:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER}}]}},
    }


def pod_with_claim(name: str, node: str | None = None) -> JsonObject:
    pod: JsonObject = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "resourceClaims": [{"name": "gpu", "resourceClaimName": name}],
            "containers": [{"name": "app", "image": "busybox", "resources": {"claims": [{"name": "gpu"}]}}],
        },
    }
    if node is not None:  # kept to the node by its hostname label; the scheduler still allocates
        pod["spec"]["nodeSelector"] = {"kubernetes.io/hostname": node}
    return pod


def claim_allocations(server: Server) -> dict[str, tuple[str, str, str]]:
    """Claim name -> (uid, node, device) for every allocated claim in the namespace."""
    result = {}
    for claim in server.list(manifests_path("resourceclaims", NAMESPACE)):
        allocation = (claim.get("status") or {}).get("allocation")
        if not allocation:
            continue
        (device,) = [r["device"] for r in allocation["devices"]["results"] if r["driver"] == DRIVER]
        terms = allocation["nodeSelector"]["nodeSelectorTerms"]
        node = next(
            value
            for term in terms
            for requirement in term.get("matchFields") or term.get("matchExpressions") or []
            for value in requirement.get("values") or []
        )
        result[claim["metadata"]["name"]] = (claim["metadata"]["uid"], node, device)
    return result


def prepared_problems(server: Server, nodes: Sequence[ScaleNode], pods: dict[str, str]) -> list[str]:
    """Every running pod's claim allocated on the pod's node, no device twice, and the node's CDI specs
    exactly the claims allocated there: what the container runtime on each node would inject."""
    allocations = claim_allocations(server)
    problems = []
    held: dict[tuple[str, str], str] = {}
    for claim, (_, where, device) in allocations.items():
        if (where, device) in held:
            problems.append(f"{where}/{device} allocated to {held[where, device]} and {claim}")
        held[where, device] = claim
        if pods.get(claim) not in (None, where):
            problems.append(f"claim {claim} allocated on {where}, its pod runs on {pods[claim]}")
    for node in nodes:
        expected = {uid for uid, where, _ in allocations.values() if where == node.name}
        specs = node.driver.prepared_claim_uids()
        if specs != expected:
            problems.append(
                f"{node.name}: CDI specs for {len(specs)} claims, {len(expected)} allocated there "
                f"({len(specs - expected)} extra, {len(expected - specs)} missing)"
            )
    return problems


def is_running(pod: JsonObject) -> bool:
    return bool(pod.get("status", {}).get("phase") == "Running")


def running_pods(server: Server) -> dict[str, str]:
    """Pod name -> node, for the pods that run (prepared: the harness sets Running after that)."""
    pods = server.list(manifests_path("pods", NAMESPACE), fieldSelector="status.phase=Running")
    return {pod["metadata"]["name"]: pod["spec"]["nodeName"] for pod in pods}


def failed_prepares(server: Server, since: str | None = None) -> dict[str, str]:
    """Pod -> the kubelet's message, for pods with a FailedPrepareDynamicResources event (the kubelet's)
    at or after ``since``."""
    events = server.list(
        manifests_path("events", NAMESPACE), fieldSelector="reason=FailedPrepareDynamicResources"
    )
    return {
        event["involvedObject"]["name"]: f"{event.get('source', {}).get('host', '?')}: {event.get('message')}"
        for event in events
        if since is None or (event.get("lastTimestamp") or event.get("eventTime") or "") >= since
    }


def server_time() -> str:
    """Now as the API server (on this machine) stamps events: RFC 3339, in seconds."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


# --- the run ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Options:
    nodes: int
    pods: int
    steady_s: float
    parallel: int
    output: Path
    skip_restart: bool
    mig_partitions: bool = True


def parse_args(argv: Sequence[str]) -> Options:
    parser = argparse.ArgumentParser(prog="bench/scale.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=100, help="simulated nodes of 8 H100 each (100)")
    parser.add_argument("--pods", type=int, help="one-GPU pods to place (default: one per GPU)")
    parser.add_argument("--steady-seconds", type=float, default=120.0, help="steady-state window (120)")
    parser.add_argument("--parallel", type=int, default=8, help="nodes started at once (8)")
    parser.add_argument("--output", type=Path, default=OUTPUT, help=f"the report ({OUTPUT})")
    parser.add_argument("--skip-restart", action="store_true", help="leave out the rolling restart")
    parser.add_argument(
        "--no-mig-partitions",
        action="store_true",
        help="drivers publish whole GPUs only (--mig-partitions=none): what the scheduler pays per device",
    )
    args = parser.parse_args(argv)
    pods = args.pods if args.pods is not None else args.nodes * GPUS_PER_NODE
    if args.nodes < 1 or args.parallel < 1 or args.steady_seconds < 0:
        parser.error("--nodes and --parallel must be at least 1, --steady-seconds at least 0")
    if not 0 <= pods <= args.nodes * GPUS_PER_NODE:
        parser.error(f"--pods must be between 0 and {args.nodes * GPUS_PER_NODE} (one per GPU at most)")
    return Options(
        args.nodes,
        pods,
        args.steady_seconds,
        args.parallel,
        args.output,
        args.skip_restart,
        mig_partitions=not args.no_mig_partitions,
    )


def check_memory(options: Options) -> float:
    needed = CONTROL_PLANE_MIB + options.nodes * NODE_MIB + LOW_MEMORY_MIB
    available = available_mib()
    if available < needed:
        raise ScaleError(
            f"{options.nodes} nodes need about {needed / 1024:.1f} GiB of available memory; the machine has "
            f"{available / 1024:.1f} GiB (free -g); try fewer --nodes"
        )
    return available


def step(message: str) -> None:
    print(f"==> {message}", file=sys.stderr, flush=True)


def in_parallel(pool: ThreadPoolExecutor, work: Callable[[Any], Any], items: Sequence[Any]) -> list[Any]:
    return list(pool.map(work, items))


class Run:
    def __init__(self, options: Options, server: Server, nodes: list[ScaleNode], pool: ThreadPoolExecutor):
        self.options = options
        self.server = server
        self.nodes = nodes
        self.pool = pool
        self.report: JsonObject = {"nodes": len(nodes)}

    def publish(self) -> None:
        count = len(self.nodes)
        step(f"starting {count} kubelets, then {count} drivers, {self.options.parallel} at a time")
        phase = Phase(self.server)
        with phase.measured():
            in_parallel(
                self.pool, lambda node: node.harness.start(timeout_seconds=_START_TIMEOUT_S), self.nodes
            )
        self.report["kubelets_started_s"] = round(phase.wall_s, 2)

        # What the GPUs call for, from the simulated hardware itself (as nvidia-smi would list it).
        probe = SimulatedBackend(PROFILE, "probe", self.nodes[0].base.parent / "probe")
        try:
            expected = expected_devices(probe.inventory(), mig=self.options.mig_partitions)
        finally:
            probe.close()
        ready_at: list[float] = []
        phase = Phase(self.server)
        with phase.measured():
            started = time.monotonic()

            def start(node: ScaleNode) -> None:
                node.start_driver()
                ready_at.append(time.monotonic() - started)

            in_parallel(self.pool, start, self.nodes)
            problems = wait_for_valid_pools(self.server, self.nodes, expected, timeout_s=60)
        self.expected = expected
        self.report |= {
            "slices_valid": not problems,
            "publish_all_s": round(phase.wall_s, 2),
            "slice_problems": problems[:20],
            "publish": phase.report()
            | {
                "driver_ready_s": summary(ready_at),
                # CPU each driver used to start and publish: what the machine's cores had to supply.
                "driver_start_cpu_s": summary(
                    [cpu_seconds(node.driver.daemon.pid or 0) for node in self.nodes]
                ),
                "load_average": [round(value, 2) for value in os.getloadavg()],
                "slices": sum(len(items) for items in self.server.slices_by_node().values()),
                "devices_per_node": len(expected),
            },
        }

    def steady(self) -> None:
        step(f"published in {self.report['publish_all_s']} s; steady state for {self.options.steady_s:.0f} s")
        time.sleep(min(10.0, self.options.steady_s))  # let start-up stragglers finish
        before_text = self.server.metrics()
        phase = Phase(self.server)
        with phase.measured():
            time.sleep(self.options.steady_s)
        after_text = self.server.metrics()
        steady = steady_requests(
            request_counts(before_text), request_counts(after_text), phase.wall_s, len(self.nodes)
        )
        self.report |= {
            "steady_requests_per_node_per_min": steady.driver_per_node_per_min,
            "steady": phase.report()
            | {
                "requests_per_node_per_min": steady.per_node_per_min,
                "requests": steady.rows,
                "open_watches": {
                    resource: count
                    for resource, count in open_watches(after_text).items()
                    if resource in ("resourceslices", "resourceclaims", "nodes", "pods")
                },
            },
        }
        self.report["memory_idle"] = self.memory()

    def memory(self) -> JsonObject:
        drivers = [memory_mib(node.driver.daemon.pid or 0) for node in self.nodes]
        harnesses = [memory_mib(node.harness.daemon.pid or 0) for node in self.nodes]
        return {
            "driver_rss_mib": summary([rss for rss, _ in drivers]),
            "driver_pss_mib": summary([pss for _, pss in drivers]),
            "kubelet_harness_rss_mib": summary([rss for rss, _ in harnesses]),
            "kubelet_harness_pss_mib": summary([pss for _, pss in harnesses]),
            "control_plane_rss_mib": self.server.rss_mib(),
            "all_nodes_pss_mib": round(sum(pss for _, pss in drivers + harnesses)),
        }

    def pods(self) -> None:
        count = self.options.pods
        step(f"{count} one-GPU claims and pods for the scheduler to place")
        names = [f"gpu-{index:04d}" for index in range(count)]
        rest = self.server.rest
        rest.create(
            "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}}
        )
        claims = manifests.collection("ResourceClaim", NAMESPACE)
        pods = manifests.collection("Pod", NAMESPACE)
        in_parallel(self.pool, lambda name: self.server.create(claims, one_gpu_claim(name)), names)
        phase = Phase(self.server)
        scheduled_s = 0.0
        with phase.measured():
            started = time.monotonic()
            in_parallel(self.pool, lambda name: self.server.create(pods, pod_with_claim(name)), names)
            created_s = time.monotonic() - started
            deadline = started + 120 + count  # generous: the timing is reported, never judged
            while time.monotonic() < deadline:
                if not scheduled_s:
                    unscheduled = self.server.list(pods, fieldSelector="spec.nodeName=")
                    scheduled_s = 0.0 if unscheduled else time.monotonic() - started
                if not self.server.list(pods, fieldSelector="status.phase!=Running"):
                    break
                time.sleep(POLL_S)
        running = running_pods(self.server)
        problems = prepared_problems(self.server, self.nodes, running)
        self.running = running
        self.report |= {
            "pods_placed_and_prepared_s": round(phase.wall_s, 2) if len(running) == count else None,
            "pods": phase.report()
            | {
                "pods": count,
                "running": len(running),
                "created_s": round(created_s, 2),
                "scheduled_s": round(scheduled_s, 2) or None,
                "failed_prepares": failed_prepares(self.server),
                "prepared_problems": problems[:20],
            },
        }
        self.report["memory_loaded"] = self.memory()

    def rolling_restart(self) -> None:
        """Every driver rolled, one node at a time, while a worker replaces pods on the rolling node."""
        step(f"rolling restart of {len(self.nodes)} drivers, pods replaced on the rolling node meanwhile")
        since = server_time()
        current = {"node": self.nodes[0].name}
        done = threading.Event()
        churn: JsonObject = {"replaced": 0, "never_ran": [], "prepare_s": []}
        by_node: dict[str, list[str]] = {}
        for pod, where in sorted(self.running.items()):
            by_node.setdefault(where, []).append(pod)
        rest = self.server.rest
        claims = manifests.collection("ResourceClaim", NAMESPACE)
        pods = manifests.collection("Pod", NAMESPACE)

        def replace_pods() -> None:
            try:
                replace_until_done()
            except Exception as error:  # reported, not raised: the restart goes on without churn
                churn["error"] = f"{type(error).__name__}: {error}"

        def replace_until_done() -> None:
            serial = 0
            while not done.is_set():
                node = current["node"]
                if not by_node.get(node):
                    time.sleep(0.2)
                    continue
                old = by_node[node].pop(0)
                rest.delete(f"{pods}/{old}")
                _wait_gone(rest, f"{pods}/{old}")
                rest.delete(f"{claims}/{old}")
                _wait_gone(rest, f"{claims}/{old}")
                serial += 1
                new = f"churn-{serial:04d}"
                rest.create(claims, one_gpu_claim(new))
                started = time.monotonic()
                rest.create(pods, pod_with_claim(new, node))
                try:
                    rest.wait_for(pods, new, is_running, timeout_seconds=90)
                    churn["prepare_s"].append(time.monotonic() - started)
                    by_node[node].append(new)
                except TimeoutError:
                    churn["never_ran"].append(new)
                churn["replaced"] += 1

        worker = threading.Thread(target=replace_pods, name="churn", daemon=True)
        ready_s, statuses = [], []
        phase = Phase(self.server)
        with phase.measured():
            if self.running:
                worker.start()
            for node in self.nodes:
                current["node"] = node.name
                ready, status = node.roll()
                ready_s.append(ready)
                statuses.append(status)
            done.set()
            if worker.is_alive():
                worker.join(timeout=180)
        failed = failed_prepares(self.server, since) | {
            pod: "did not run within 90 s" for pod in churn["never_ran"]
        }
        pool_problems_after = wait_for_valid_pools(self.server, self.nodes, self.expected, timeout_s=60)
        running = running_pods(self.server)
        self.report |= {
            "rolling_restart_failed_prepares": len(failed),
            "rolling_restart": phase.report()
            | {
                "restarted": len(ready_s),
                "new_instance_ready_s": summary(ready_s),
                "old_instance_clean_exits": sum(1 for status in statuses if status == 0),
                "pods_replaced_meanwhile": churn["replaced"],
                "replacement_error": churn.get("error"),
                "replacement_prepared_s": summary(churn["prepare_s"]),
                "failed_prepares": dict(sorted(failed.items())[:20]),
                "slice_problems_after": pool_problems_after[:20],
                "prepared_problems_after": prepared_problems(self.server, self.nodes, running)[:20],
                "running_pods_after": len(running),
            },
        }


def _wait_gone(rest: RestClient, path: str, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            rest.get(path)
        except ApiError as error:
            if error.status == 404:
                return
            raise
        time.sleep(0.1)
    raise ScaleError(f"{path} still there after {timeout_s:.0f}s")


def machine() -> JsonObject:
    return {
        "cpus": os.cpu_count(),
        "memory_total_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "load_average": [round(value, 2) for value in os.getloadavg()],
        "python": sys.version.split()[0],
    }


def interruptible() -> None:
    """SIGTERM and SIGINT raise KeyboardInterrupt in the main thread, which stops and cleans up.

    SIGINT is set explicitly: a run started in the background by a non-interactive shell
    (`make bench &`, a CI runner) inherits it as ignored, and then the memory guard's SIGINT would
    not stop the run.
    """

    def handler(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def main(argv: Sequence[str] | None = None) -> int:
    options = parse_args(sys.argv[1:] if argv is None else argv)
    interruptible()
    try:
        report = run(options)
    except (ScaleError, DaemonError, TimeoutError) as error:
        print(f"scale: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("scale: interrupted; everything it started is stopped", file=sys.stderr)
        return 130
    save(options.output, report | {"complete": True})
    print_summary(report)
    print(f"\nwrote {options.output}")
    failures = verdict(report)
    for failure in failures:
        print(f"FAILED: {failure}")
    return 1 if failures else 0


def keep_logs(scratch: Path, destination: Path) -> None:
    """Copies every log of a failed run (drivers, kubelets, control plane) out of the scratch directory."""
    shutil.rmtree(destination, ignore_errors=True)
    for log in scratch.rglob("*.log"):
        target = destination / log.relative_to(scratch)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(log, target)
    print(f"scale: the run's logs are in {destination}", file=sys.stderr)


def save(output: Path, report: JsonObject) -> None:
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=2) + "\n")


def verdict(report: JsonObject) -> list[str]:
    """What went wrong, in words (the figures themselves are never judged: this machine is shared)."""
    failures = [f"slices: {problem}" for problem in report.get("slice_problems", [])]
    pods = report.get("pods")
    if pods:
        if pods["running"] != pods["pods"]:
            failures.append(f"{pods['pods'] - pods['running']} of {pods['pods']} pods never ran")
        failures += [f"pods: {problem}" for problem in pods["prepared_problems"]]
        failures += [f"pods: failed prepare of {pod}: {why}" for pod, why in pods["failed_prepares"].items()]
    restart = report.get("rolling_restart")
    if restart:
        if report["rolling_restart_failed_prepares"]:
            failures += [
                f"rolling restart: failed prepare of {pod}: {why}"
                for pod, why in restart["failed_prepares"].items()
            ]
        if restart["replacement_error"]:
            failures.append(f"rolling restart: replacing pods failed: {restart['replacement_error']}")
        failures += [f"after the rolling restart: {p}" for p in restart["slice_problems_after"]]
        failures += [f"after the rolling restart: {p}" for p in restart["prepared_problems_after"]]
        if restart["old_instance_clean_exits"] != restart["restarted"]:
            failures.append("rolling restart: an old instance did not exit cleanly (status 0)")
    return failures


def run(options: Options) -> JsonObject:
    available = check_memory(options)
    started = time.monotonic()
    binaries = ensure_control_plane_binaries()
    harness_binary = ensure_harness_binary()
    load_before = os.getloadavg()
    with (
        MemoryGuard(LOW_MEMORY_MIB) as guard,
        tempfile.TemporaryDirectory(prefix="scale-") as scratch,
        ControlPlane(binaries, Path(scratch) / "cluster", die_with_parent=True) as control_plane,
        # Children die with the thread that spawned them (PR_SET_PDEATHSIG): the pool's threads
        # live until every daemon is stopped.
        ThreadPoolExecutor(max_workers=options.parallel, thread_name_prefix="node") as pool,
    ):
        server = Server(control_plane.info)
        manifests.apply(server.rest, manifests.load(manifests.DEMO / "deviceclass.yaml"), NAMESPACE)
        nodes = [
            ScaleNode(
                server.info,
                harness_binary,
                Path(scratch) / f"n{i:03d}",
                f"scale-{i:03d}",
                mig_partitions=options.mig_partitions,
            )
            for i in range(options.nodes)
        ]
        run = Run(options, server, nodes, pool)
        try:
            # After each phase the figures so far are saved ("complete": false): a run stopped later
            # still leaves them.
            for phase, wanted in (
                (run.publish, True),
                (run.steady, True),
                (run.pods, options.pods > 0),
                (run.rolling_restart, not options.skip_restart),
            ):
                if wanted:
                    phase()
                    save(options.output, run.report | {"complete": False})
        except KeyboardInterrupt:
            if guard.tripped:
                raise ScaleError(
                    f"stopped: the machine's available memory fell below {LOW_MEMORY_MIB} MiB"
                ) from None
            raise
        except (ScaleError, DaemonError, TimeoutError):
            terminate(daemon for node in nodes for daemon in node.daemons)
            keep_logs(Path(scratch), options.output.parent / LOGS)
            raise
        finally:
            terminate(daemon for node in nodes for daemon in node.daemons)
        report = run.report
        if verdict(report):
            keep_logs(Path(scratch), options.output.parent / LOGS)
    memory = report.get("memory_loaded") or report.get("memory_idle") or {}
    report |= {
        # The driver daemon's own RSS on a node (mean, after the pods phase): what the driver costs a
        # node. The kubelet harness stands in for the kubelet every node runs anyway; it is in memory_*.
        "rss_mib_per_node": memory.get("driver_rss_mib", {}).get("mean"),
        "apiserver_cpu_cores": {
            phase: report[phase]["apiserver_cores"]
            for phase in ("publish", "steady", "pods", "rolling_restart")
            if phase in report
        },
        "mig_partitions": options.mig_partitions,
        "machine": machine()
        | {
            "memory_available_gib_at_start": round(available / 1024, 1),
            "memory_available_gib_lowest": round(guard.lowest_mib / 1024, 1),
            "load_average_before": [round(value, 2) for value in load_before],
        },
        "kube_version": binaries.kube_version,
        "total_s": round(time.monotonic() - started, 1),
    }
    return report


def print_summary(report: JsonObject) -> None:
    idle = report.get("memory_idle", {})
    steady = report.get("steady", {})
    rows = [
        ("nodes", report["nodes"]),
        ("slices valid", report["slices_valid"]),
        ("publish all (s)", report["publish_all_s"]),
        ("steady requests/node/min, driver", report.get("steady_requests_per_node_per_min")),
        ("steady requests/node/min, all", steady.get("requests_per_node_per_min", {}).get("all")),
        ("API server cores, steady", steady.get("apiserver_cores")),
        ("pods placed and prepared (s)", report.get("pods_placed_and_prepared_s")),
        ("API server cores, pods", report.get("pods", {}).get("apiserver_cores")),
        ("rolling restart failed prepares", report.get("rolling_restart_failed_prepares")),
        ("driver RSS MiB/node (idle)", idle.get("driver_rss_mib", {}).get("mean")),
        ("driver PSS MiB/node (idle)", idle.get("driver_pss_mib", {}).get("mean")),
        ("kubelet harness RSS MiB/node", idle.get("kubelet_harness_rss_mib", {}).get("mean")),
    ]
    for label, value in rows:
        print(f"  {label:36} {value}")


if __name__ == "__main__":
    raise SystemExit(main())
