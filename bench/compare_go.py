"""``make bench-go``: our daemon and the Go reference driver side by side, in one run.

One control plane, one client playing the kubelet (bench/kubelet.py), the same workload for both
(bench/prepare_bench.py: start-ups, 1-claim and 8-claim pods, 200-claim bursts), and rounds that
alternate which driver goes first, so that a drift in the machine's load hits both alike. Each
driver prepares its own claims (allocated from its own driver name, in its own namespaces), created
once before the first round.

Every row is reported per driver as the range over the rounds, and as ours/Go: the ratio of the
two figures of the same round, whose range is the steadiest thing this shared machine measures.
Prints a table and writes _output/bench-go.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from bench import go_reference
from bench.claims import AllocatedClaims
from bench.daemon import Daemon, DaemonConfig
from bench.kubelet import BenchFailure
from bench.prepare_bench import GPU_PROFILE, NODE, WORKLOAD, Claims, create_claims, measure_daemon
from bench.report import DaemonRun
from dra_driver.settings import DEFAULT_DRIVER_NAME
from e2e.cluster import ClusterInfo, ControlPlane, create_fake_node, ensure_control_plane_binaries

OUTPUT = Path("_output/bench-go.json")
DEFAULT_ROUNDS = 3


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


@dataclass(frozen=True)
class Row:
    """One figure, read from each driver's run; ``better`` says which way is good."""

    name: str
    unit: str
    better: str  # "lower" or "higher"
    read: Callable[[DaemonRun], float]


ROWS = [
    Row("1-claim prepare p50", "ms", "lower", lambda r: r.load.latency["one_claim_prepare"].p50),
    Row("1-claim prepare p99", "ms", "lower", lambda r: r.load.latency["one_claim_prepare"].p99),
    Row("1-claim unprepare p50", "ms", "lower", lambda r: r.load.latency["one_claim_unprepare"].p50),
    Row(
        f"{WORKLOAD.burst_claims} claims in flight",
        "claims/s",
        "higher",
        lambda r: _median([b.concurrent_claims_per_s for b in r.load.rounds]),
    ),
    Row(
        f"{WORKLOAD.burst_claims} claims one at a time",
        "claims/s",
        "higher",
        lambda r: _median([b.serial_claims_per_s for b in r.load.rounds]),
    ),
    Row(
        "CPU per prepare, serial",
        "ms",
        "lower",
        lambda r: _median([b.serial_cpu_ms_per_claim for b in r.load.rounds]),
    ),
    Row(
        "CPU per prepare, burst",
        "ms",
        "lower",
        lambda r: _median([b.concurrent_cpu_ms_per_claim for b in r.load.rounds]),
    ),
    Row("RSS idle", "MiB", "lower", lambda r: r.idle_rss_mib),
    Row("RSS after load", "MiB", "lower", lambda r: r.final_rss_mib),
    Row("start -> registration answers", "s", "lower", lambda r: _median([s.registered for s in r.startups])),
]

# Figures of one driver in units of a baseline measured in the same run (the goals).
WITHIN: dict[str, Callable[[DaemonRun], float]] = {
    "prepare_p50_vs_api_get_p50": lambda r: (
        r.load.latency["one_claim_prepare"].p50 / r.load.latency["api_get"].p50
    ),
    "prepare_p99_vs_p50": lambda r: (
        r.load.latency["one_claim_prepare"].p99 / r.load.latency["one_claim_prepare"].p50
    ),
    "unprepare_p50_vs_empty_grpc_p50": lambda r: (
        r.load.latency["one_claim_unprepare"].p50 / r.load.latency["empty_prepare"].p50
    ),
    "serial_last_vs_first_claims_of_burst_p50": lambda r: (
        r.load.latency["burst_serial_last"].p50 / r.load.latency["burst_serial_first"].p50
    ),
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.compare_go", description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS, help="alternating rounds (default 3)")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    load_before = os.getloadavg()
    try:
        binary = go_reference.build()
    except BenchFailure as failure:
        print(f"bench-go: {failure}", file=sys.stderr)
        return 1
    binaries = ensure_control_plane_binaries()
    with (
        tempfile.TemporaryDirectory(prefix="dra-bench-go-") as scratch,
        ControlPlane(binaries, Path(scratch) / "cluster") as control_plane,
    ):
        try:
            runs = asyncio.run(_rounds(control_plane.info, Path(scratch), binary, args.rounds))
        except BenchFailure as failure:
            print(f"bench-go: {failure}", file=sys.stderr)
            return 1
    report = build(runs, kube_version=binaries.kube_version, load=(load_before, os.getloadavg()))
    OUTPUT.parent.mkdir(parents=True, exist_ok=True)
    OUTPUT.write_text(json.dumps(report, indent=2) + "\n")
    print(table(report))
    print(f"\nwritten: {OUTPUT}")
    return 0


async def _rounds(cluster: ClusterInfo, base: Path, binary: Path, rounds: int) -> dict[str, list[DaemonRun]]:
    with cluster.api_client() as admin:
        create_fake_node(admin, NODE)
    ours = DaemonConfig(
        driver=DEFAULT_DRIVER_NAME, node=NODE, gpus=GPU_PROFILE, kubeconfig=cluster.kubeconfig
    )
    go = DaemonConfig(
        driver=go_reference.DRIVER_NAME, node=NODE, gpus=GPU_PROFILE, kubeconfig=cluster.kubeconfig
    )
    claims: dict[str, Claims] = {
        "ours": await asyncio.to_thread(
            create_claims, AllocatedClaims(cluster.rest(), ours.driver, NODE), "ours"
        ),
        "go": await asyncio.to_thread(create_claims, AllocatedClaims(cluster.rest(), go.driver, NODE), "go"),
    }
    runs: dict[str, list[DaemonRun]] = {"ours": [], "go": []}
    for round_ in range(rounds):

        def new_daemon(which: str, name: str, r: int = round_) -> Daemon:
            where = base / f"{which}-{r}-{name}"
            if which == "go":
                return go_reference.GoReferenceDaemon(binary, go, where)
            return Daemon(ours, where)

        order = ("ours", "go") if round_ % 2 == 0 else ("go", "ours")
        for which in order:
            print(f"bench-go: round {round_ + 1}/{rounds}: {which}", file=sys.stderr, flush=True)
            run = await measure_daemon(partial(new_daemon, which), claims[which], cluster.kubeconfig)
            runs[which].append(run)
    return runs


def _spread(values: Sequence[float]) -> dict[str, Any]:
    return {
        "median": round(_median(values), 3),
        "min": round(min(values), 3),
        "max": round(max(values), 3),
        "rounds": [round(v, 3) for v in values],
    }


def build(
    runs: dict[str, list[DaemonRun]],
    *,
    kube_version: str,
    load: tuple[tuple[float, float, float], tuple[float, float, float]],
) -> dict[str, Any]:
    """Per row: each driver's figure per round, and ours/Go per round."""
    rows = {}
    for row in ROWS:
        ours = [row.read(r) for r in runs["ours"]]
        go = [row.read(r) for r in runs["go"]]
        rows[row.name] = {
            "unit": row.unit,
            "better": row.better,
            "ours": _spread(ours),
            "go": _spread(go),
            "ours_vs_go": _spread([o / g for o, g in zip(ours, go, strict=True)]),
        }
    within = {
        name: {driver: _spread([read(r) for r in runs[driver]]) for driver in ("ours", "go")}
        for name, read in WITHIN.items()
    }
    return {
        "design": {
            "reference": "sigs.k8s.io/dra-example-driver "
            f"(hack/versions.env GO_REFERENCE_DRIVER_VERSION), gpu profile, {go_reference.API_QPS} API QPS",
            "workload": "bench/prepare_bench.py's, for each driver; rounds alternate which goes first",
            "ratios": "ours/Go is taken per round (the two figures of the same round), then its range",
        },
        "kubernetes": kube_version,
        "cpus_usable": len(os.sched_getaffinity(0)),
        "load_average": {"before": [round(x, 2) for x in load[0]], "after": [round(x, 2) for x in load[1]]},
        "rounds": len(runs["ours"]),
        "rows": rows,
        "within_driver": within,
        "goals": goals(rows, within),
    }


def goals(rows: dict[str, Any], within: dict[str, Any]) -> dict[str, Any]:
    """Issue 13's goals, on the medians over the rounds."""
    burst = f"{WORKLOAD.burst_claims} claims in flight"
    checks: list[tuple[str, float, str, float]] = [
        ("prepare p50 vs API GET p50", within["prepare_p50_vs_api_get_p50"]["ours"]["median"], "<=", 1.2),
        ("prepare p99 vs p50", within["prepare_p99_vs_p50"]["ours"]["median"], "<=", 2.0),
        (
            "unprepare p50 vs empty gRPC p50",
            within["unprepare_p50_vs_empty_grpc_p50"]["ours"]["median"],
            "<=",
            2.0,
        ),
        ("burst claims/s, ours/Go", rows[burst]["ours_vs_go"]["median"], ">=", 2.0),
        ("CPU per claim, burst, ms", rows["CPU per prepare, burst"]["ours"]["median"], "<=", 2.0),
        ("CPU per claim, serial, ms", rows["CPU per prepare, serial"]["ours"]["median"], "<=", 4.5),
        (
            "serial last vs first of burst",
            within["serial_last_vs_first_claims_of_burst_p50"]["ours"]["median"],
            "<=",
            1.1,
        ),
        ("RSS idle, MiB", rows["RSS idle"]["ours"]["median"], "<=", 60.0),
        ("RSS after load, MiB", rows["RSS after load"]["ours"]["median"], "<=", 70.0),
        ("start -> registered, s", rows["start -> registration answers"]["ours"]["median"], "<=", 0.4),
    ]
    return {
        name: {
            "aim": f"{op} {limit:g}",
            "measured": value,
            "met": value <= limit if op == "<=" else value >= limit,
        }
        for name, value, op, limit in checks
    }


def _meets(value: float, op: str, limit: float) -> bool:
    return value <= limit if op == "<=" else value >= limit


def table(report: dict[str, Any]) -> str:
    load = report["load_average"]
    lines = [
        f"dra-driver vs the Go reference driver: {report['rounds']} alternating rounds, Kubernetes "
        f"{report['kubernetes']}, {report['cpus_usable']} CPUs; load average {load['before']} before, "
        f"{load['after']} after",
        "",
        f"{'measure':36}{'ours (range)':>22}{'Go (range)':>22}{'ours/Go (range)':>24}",
    ]

    def span(s: dict[str, Any], digits: int = 1) -> str:
        return f"{s['min']:.{digits}f}-{s['max']:.{digits}f}"

    for name, row in report["rows"].items():
        digits = 3 if row["unit"] == "s" else 1
        lines.append(
            f"  {name + ', ' + row['unit']:34}{span(row['ours'], digits):>22}{span(row['go'], digits):>22}"
            f"{span(row['ours_vs_go'], 2):>16} ({row['ours_vs_go']['median']:.2f})"
        )
    lines += ["", f"{'within each driver (same run)':36}{'ours (range)':>22}{'Go (range)':>22}"]
    for name, by in report["within_driver"].items():
        lines.append(f"  {name:34}{span(by['ours'], 2):>22}{span(by['go'], 2):>22}")
    lines += ["", "goals (issue 13), medians over the rounds"]
    for name, goal in report["goals"].items():
        verdict = "met" if goal["met"] else "MISSED"
        lines.append(f"  {name:36}{goal['aim']:>8}   measured {goal['measured']:>9.2f}   {verdict}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
