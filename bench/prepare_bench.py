"""``make bench``: how fast the daemon prepares claims, starts, and how much memory it keeps.

The benchmark plays the kubelet against the real control plane: allocated ResourceClaims in the
API server (see bench/claims.py), the daemon as its own process with 8 simulated H100s, and
NodePrepareResources / NodeUnprepareResources over the real DRA socket. This machine is small and
shared, so every absolute figure comes with a baseline measured in the same run, under the same
load; the ratios are what compares across runs (bench/README.md says how to read them).

Prints a table and writes _output/bench.json.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.claims import AllocatedClaims
from bench.daemon import DAEMON_MODULES, Daemon, DaemonConfig, StartupTimes, imported_rss_mib, python_seconds
from bench.kubelet import BenchFailure, DraClient
from bench.report import (
    BurstRound,
    DaemonRun,
    Floors,
    LoadResults,
    Measurements,
    Workload,
    build_report,
    table,
)
from bench.stats import Latency
from dra_driver.apiserver.connect import api_client
from dra_driver.node.claim_fetcher import ApiServerClaimFetcher
from dra_driver.node.types import ClaimRef
from dra_driver.settings import DEFAULT_DRIVER_NAME
from e2e.cluster import ClusterInfo, ControlPlane, create_fake_node, ensure_control_plane_binaries

NODE = "bench-node"
GPU_PROFILE = "dgx-h100"  # 8x H100 80GB HBM3
GPUS = 8
STARTS = 3  # daemon start-ups timed; the last one serves the load
WARMUP_PODS = 5
ONE_CLAIM_PODS = 100
EIGHT_CLAIM_PODS = 40
BURST_CLAIMS = 200
BURST_ROUNDS = 3
GROWTH_WINDOW = 20  # serial prepares compared at the start and the end of a burst
SETTLE_S = 3.0  # idle time after the load before its memory is read
OUTPUT = Path("_output/bench.json")

DESIGN = {
    "claims": "ResourceClaims are created in the API server and allocated by writing status.allocation "
    "(one device of our driver in the node's pool, plus the node selector) through the status subresource, "
    "so throughput does not depend on the scheduler.",
    "pods": "A pod is one NodePrepareResources call with all its claims, as the kubelet sends it; each "
    "claim holds one GPU. The 1-claim and 8-claim pods use exclusive allocations (the 8-claim pod holds "
    "gpu-0..gpu-7); each pod is unprepared before the next one, so the node is idle between samples.",
    "burst": f"The {BURST_CLAIMS}-claim burst is {BURST_CLAIMS} one-claim pods whose calls are all in flight "
    f"at once on one connection. A node has {GPUS} GPUs, so these claims use admin-access allocations "
    f"({BURST_CLAIMS // GPUS} per GPU, in a namespace labelled resource.kubernetes.io/admin-access=true, "
    "which the API server requires of them): admin access is never exclusive, and the driver prepares it "
    "by the same steps (GET, plan, two store commits, CDI spec). The 1-claim pods alternate with "
    "admin-access 1-claim pods, and their ratio checks that both cost the same.",
    "serial": "The serial baseline prepares the same claims one call at a time: the most a plugin that "
    "serializes every call (the upstream Go helper's one mutex) could reach, less its gRPC overlap. A "
    "round prepares all of them, then unprepares them, so the last of them are prepared next to "
    f"{BURST_CLAIMS - GROWTH_WINDOW}+ prepared claims: 'last vs first' shows how the cost of a prepare "
    "grows with the claims already on the node.",
    "baselines": "Empty prepare = a NodePrepareResources call with no claim (gRPC round trip through the "
    "daemon). API GET = the driver's own claim fetcher (kubernetes.aio) reading the same claim from this "
    "process, interleaved with the prepares. Start-up floors = a bare interpreter, and one that only "
    "imports the daemon's modules, each run right before every daemon start.",
    "noise": "The client, the daemon, the API server and etcd share this machine's cores with other work; "
    "compare ratios across runs, and read absolute times with the load average beside them.",
}

WORKLOAD = Workload(
    gpus=f"{GPUS} simulated H100 ({GPU_PROFILE})",
    startups=STARTS,
    warmup_pods=WARMUP_PODS,
    one_claim_pods=ONE_CLAIM_PODS,
    eight_claim_pods=EIGHT_CLAIM_PODS,
    burst_claims=BURST_CLAIMS,
    burst_rounds=BURST_ROUNDS,
    growth_window=GROWTH_WINDOW,
    design=DESIGN,
)


@dataclass(frozen=True)
class Claims:
    warmup: list[ClaimRef]
    one_claim: list[ClaimRef]
    one_claim_admin: list[ClaimRef]
    eight_claim: list[list[ClaimRef]]
    burst: list[ClaimRef]


def main() -> int:
    load_before = os.getloadavg()
    binaries = ensure_control_plane_binaries()
    with tempfile.TemporaryDirectory(prefix="dra-bench-") as scratch:
        base = Path(scratch)
        with ControlPlane(binaries, base / "cluster") as control_plane:
            try:
                measured = asyncio.run(_measure(control_plane.info, base))
            except BenchFailure as failure:
                print(f"bench: {failure}", file=sys.stderr)
                return 1
    report = build_report(
        measured,
        WORKLOAD,
        kube_version=binaries.kube_version,
        load_before=load_before,
        load_after=os.getloadavg(),
    )
    OUTPUT.parent.mkdir(parents=True, exist_ok=True)
    OUTPUT.write_text(json.dumps(report, indent=2) + "\n")
    print(table(report))
    print(f"\nwritten: {OUTPUT}")
    return 0


async def _measure(cluster: ClusterInfo, base: Path) -> Measurements:
    with cluster.api_client() as admin:
        create_fake_node(admin, NODE)
    config = DaemonConfig(
        driver=DEFAULT_DRIVER_NAME, node=NODE, gpus=GPU_PROFILE, kubeconfig=cluster.kubeconfig
    )
    claims = await asyncio.to_thread(create_claims, AllocatedClaims(cluster.rest(), config.driver, NODE))
    bare: list[float] = []
    imports: list[float] = []

    async def floors() -> None:
        # Before each start, so that the floors and the start see the machine in the same state.
        bare.append(await asyncio.to_thread(python_seconds, "pass"))
        imports.append(await asyncio.to_thread(python_seconds, f"import {DAEMON_MODULES}"))

    run = await measure_daemon(lambda where: Daemon(config, base / where), claims, cluster.kubeconfig, floors)
    return Measurements(
        run.startups,
        Floors(
            python_bare_s=statistics.median(bare),
            python_imports_s=statistics.median(imports),
            imports_only_rss_mib=await asyncio.to_thread(imported_rss_mib),
        ),
        run.idle_rss_mib,
        run.final_rss_mib,
        run.peak_rss_mib,
        run.load,
    )


async def measure_daemon(
    new_daemon: Callable[[str], Daemon],
    claims: Claims,
    kubeconfig: Path,
    before_start: Callable[[], Awaitable[None]] | None = None,
) -> DaemonRun:
    """Start-ups, then the whole load on the last start: what one driver measures in one run.

    ``new_daemon(name)`` makes a daemon in fresh directories called ``name``; ``before_start`` runs
    right before each start (the interpreter floors).
    """
    startups: list[StartupTimes] = []

    async def start(daemon: Daemon) -> Path:
        if before_start is not None:
            await before_start()
        times, endpoint = await daemon.start()
        startups.append(times)
        return endpoint

    for run in range(STARTS - 1):  # fresh directories each time: a first start on a node
        daemon = new_daemon(f"start-{run}")
        try:
            await start(daemon)
        finally:
            daemon.stop()
    daemon = new_daemon("load")
    try:
        endpoint = await start(daemon)
        idle_rss, _ = daemon.rss_mib()
        load = await _load(endpoint, kubeconfig, claims, daemon)
        await asyncio.sleep(SETTLE_S)  # memory after load: what an idle node keeps, not the last burst's
        rss, peak_rss = daemon.rss_mib()
    finally:
        daemon.stop()
    return DaemonRun(startups, idle_rss, rss, peak_rss, load)


def create_claims(factory: AllocatedClaims, prefix: str = "bench") -> Claims:
    """Every claim one run prepares, allocated from the factory's driver; namespaces ``prefix``-*."""
    exclusive = factory.namespace(f"{prefix}-exclusive", admin_access=False)
    admin = factory.namespace(f"{prefix}-admin", admin_access=True)

    def claims(prefix: str, count: int, *, admin_access: bool = False) -> list[ClaimRef]:
        namespace = admin if admin_access else exclusive
        return [
            factory.create(namespace, f"{prefix}-{i}", f"gpu-{i % GPUS}", admin_access=admin_access)
            for i in range(count)
        ]

    return Claims(
        warmup=claims("warmup", WARMUP_PODS),
        one_claim=claims("single", ONE_CLAIM_PODS),
        one_claim_admin=claims("single", ONE_CLAIM_PODS, admin_access=True),
        eight_claim=[claims(f"pod{pod}", GPUS) for pod in range(EIGHT_CLAIM_PODS)],
        burst=claims("burst", BURST_CLAIMS, admin_access=True),
    )


async def _load(dra_socket: Path, kubeconfig: Path, claims: Claims, daemon: Daemon) -> LoadResults:
    api = await api_client(kubeconfig)
    fetcher = ApiServerClaimFetcher(api)
    kubelet = DraClient(dra_socket)
    try:
        for ref in claims.warmup:  # connections, caches and first-call imports on both sides
            await fetcher.get(ref.namespace, ref.name)
            await kubelet.prepare([ref])
            await kubelet.unprepare([ref])

        empty, get, prepare_1, unprepare_1, prepare_admin = [], [], [], [], []
        # Interleaved, so that the baselines see the same load as the prepares.
        for ref, admin_ref in zip(claims.one_claim, claims.one_claim_admin, strict=True):
            empty.append(await kubelet.empty_prepare())
            get.append(await _timed(fetcher.get(ref.namespace, ref.name)))
            prepare_1.append(await kubelet.prepare([ref]))
            unprepare_1.append(await kubelet.unprepare([ref]))
            prepare_admin.append(await kubelet.prepare([admin_ref]))
            await kubelet.unprepare([admin_ref])

        prepare_8, unprepare_8 = [], []
        for pod in claims.eight_claim:
            prepare_8.append(await kubelet.prepare(pod))
            unprepare_8.append(await kubelet.unprepare(pod))

        rounds, serial_latency, burst_latency, rss_after_rounds = [], [], [], []
        first, last = [], []
        for _ in range(BURST_ROUNDS):  # alternating, so drift in the machine's load hits both alike
            round_, serial, burst = await _burst_round(kubelet, claims.burst, daemon)
            rounds.append(round_)
            serial_latency += serial
            burst_latency += burst
            first += serial[:GROWTH_WINDOW]
            last += serial[-GROWTH_WINDOW:]
            rss_after_rounds.append(round(daemon.rss_mib()[0], 1))
    finally:
        await kubelet.close()
        await api.close()  # type: ignore[no-untyped-call]
    return LoadResults(
        latency={
            "empty_prepare": Latency.of(empty),
            "api_get": Latency.of(get),
            "one_claim_prepare": Latency.of(prepare_1),
            "one_claim_unprepare": Latency.of(unprepare_1),
            "one_claim_admin_prepare": Latency.of(prepare_admin),
            "eight_claim_prepare": Latency.of(prepare_8),
            "eight_claim_unprepare": Latency.of(unprepare_8),
            "burst_serial_prepare": Latency.of(serial_latency),
            "burst_serial_first": Latency.of(first),
            "burst_serial_last": Latency.of(last),
            "burst_concurrent_prepare": Latency.of(burst_latency),
        },
        rounds=rounds,
        rss_after_rounds=rss_after_rounds,
    )


async def _burst_round(
    kubelet: DraClient, claims: Sequence[ClaimRef], daemon: Daemon
) -> tuple[BurstRound, list[float], list[float]]:
    cpu, started = daemon.cpu_seconds(), time.perf_counter()
    serial = [await kubelet.prepare([ref]) for ref in claims]
    serial_s, serial_cpu = time.perf_counter() - started, daemon.cpu_seconds() - cpu
    for ref in claims:
        await kubelet.unprepare([ref])

    cpu, started = daemon.cpu_seconds(), time.perf_counter()
    concurrent = list(await asyncio.gather(*(kubelet.prepare([ref]) for ref in claims)))
    concurrent_s, concurrent_cpu = time.perf_counter() - started, daemon.cpu_seconds() - cpu
    started = time.perf_counter()
    await asyncio.gather(*(kubelet.unprepare([ref]) for ref in claims))
    unprepare_s = time.perf_counter() - started

    count = len(claims)
    measured = BurstRound(
        serial_claims_per_s=count / serial_s,
        concurrent_claims_per_s=count / concurrent_s,
        concurrent_unprepare_claims_per_s=count / unprepare_s,
        serial_cpu_ms_per_claim=1000 * serial_cpu / count,
        concurrent_cpu_ms_per_claim=1000 * concurrent_cpu / count,
    )
    return measured, serial, concurrent


async def _timed(call: Awaitable[object]) -> float:
    started = time.perf_counter()  # a coroutine starts running only when awaited
    await call
    return time.perf_counter() - started


if __name__ == "__main__":
    sys.exit(main())
