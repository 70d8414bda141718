"""What one benchmark run measured, and the table and JSON it is reported as.

Every absolute figure is reported next to a baseline from the same run (see bench/README.md);
the ratios computed here are what compares across runs.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import grpc

from bench.daemon import StartupTimes
from bench.stats import Latency, ratio

AIMS = {  # issue 3: what the daemon should reach on this machine
    "one_claim_prepare_p50_ms": ("<=", 10.0),
    "concurrent_claims_per_s": (">=", 200.0),
    "startup_to_registered_s": ("<=", 2.0),
    "rss_after_load_mib": ("<=", 120.0),
}


@dataclass(frozen=True)
class Workload:
    """What the run did: reported with its figures, so that a reader knows what they count."""

    gpus: str
    startups: int
    warmup_pods: int
    one_claim_pods: int
    eight_claim_pods: int
    burst_claims: int
    burst_rounds: int
    growth_window: int  # serial prepares compared at the start and at the end of a burst round
    design: dict[str, str]  # the measuring choices, in words


@dataclass(frozen=True)
class Floors:
    """Baselines under the start-up and the memory: what any Python daemon with these imports pays."""

    python_bare_s: float
    python_imports_s: float
    imports_only_rss_mib: float


@dataclass(frozen=True)
class BurstRound:
    serial_claims_per_s: float
    concurrent_claims_per_s: float
    concurrent_unprepare_claims_per_s: float
    serial_cpu_ms_per_claim: float  # daemon CPU (user + system) per prepare
    concurrent_cpu_ms_per_claim: float


@dataclass(frozen=True)
class LoadResults:
    latency: dict[str, Latency]
    rounds: list[BurstRound]
    rss_after_rounds: list[float]


@dataclass(frozen=True)
class DaemonRun:
    """What one daemon measured: its start-ups, then the load on its last start."""

    startups: list[StartupTimes]
    idle_rss_mib: float
    final_rss_mib: float
    peak_rss_mib: float
    load: LoadResults


@dataclass(frozen=True)
class Measurements:
    startups: list[StartupTimes]
    floors: Floors
    idle_rss_mib: float
    final_rss_mib: float
    peak_rss_mib: float
    load: LoadResults


def build_report(
    measured: Measurements,
    workload: Workload,
    *,
    kube_version: str,
    load_before: tuple[float, float, float],
    load_after: tuple[float, float, float],
) -> dict[str, Any]:
    latency, rounds, startups = measured.load.latency, measured.load.rounds, measured.startups
    floors = measured.floors

    def median_of(field: str) -> float:
        return float(statistics.median(getattr(r, field) for r in rounds))

    throughput = {field: round(median_of(field), 2) for field in BurstRound.__dataclass_fields__}
    startup = {
        field: round(statistics.median(v for s in startups if (v := getattr(s, field)) is not None), 3)
        for field in StartupTimes.__dataclass_fields__
    }
    rss = {
        "idle_mib": round(measured.idle_rss_mib, 1),
        "after_load_mib": round(measured.final_rss_mib, 1),
        "peak_mib": round(measured.peak_rss_mib, 1),
    }
    one, eight = latency["one_claim_prepare"], latency["eight_claim_prepare"]
    ratios = {
        "one_claim_prepare_vs_api_get_p50": ratio(one.p50, latency["api_get"].p50),
        "one_claim_prepare_vs_empty_prepare_p50": ratio(one.p50, latency["empty_prepare"].p50),
        "eight_claim_vs_one_claim_prepare_p50": ratio(eight.p50, one.p50),
        "concurrent_vs_serial_throughput": ratio(
            throughput["concurrent_claims_per_s"], throughput["serial_claims_per_s"]
        ),
        "admin_vs_exclusive_one_claim_prepare_p50": ratio(latency["one_claim_admin_prepare"].p50, one.p50),
        "serial_last_vs_first_claims_of_burst_p50": ratio(
            latency["burst_serial_last"].p50, latency["burst_serial_first"].p50
        ),
        "startup_registered_vs_python_imports": ratio(startup["registered"], floors.python_imports_s),
        "startup_registered_vs_bare_python": ratio(startup["registered"], floors.python_bare_s),
        "rss_after_load_vs_idle": ratio(rss["after_load_mib"], rss["idle_mib"]),
        "rss_idle_vs_imports_only": ratio(rss["idle_mib"], floors.imports_only_rss_mib),
    }
    achieved = {
        "one_claim_prepare_p50_ms": one.p50,
        "concurrent_claims_per_s": throughput["concurrent_claims_per_s"],
        "startup_to_registered_s": startup["registered"],
        "rss_after_load_mib": rss["after_load_mib"],
    }
    aims = {
        name: {
            "aim": f"{op} {limit:g}",
            "measured": round(achieved[name], 2),
            "met": _meets(achieved[name], op, limit),
        }
        for name, (op, limit) in AIMS.items()
    }
    return {
        "machine": _machine(kube_version, workload.gpus),
        "load_average": {
            "before": [round(x, 2) for x in load_before],
            "after": [round(x, 2) for x in load_after],
        },
        "design": workload.design,
        "samples": {
            name: value for name, value in asdict(workload).items() if name not in ("gpus", "design")
        },
        "latency_ms": {name: _rounded(dist, 3) for name, dist in latency.items()},
        "throughput": {**throughput, "rounds": [_rounded(r, 2) for r in rounds]},
        "startup_s": {
            **startup,
            "runs": [_rounded(s, 3) for s in startups],
            "python_bare": round(floors.python_bare_s, 3),
            "python_imports": round(floors.python_imports_s, 3),
        },
        "memory_mib": {
            **rss,
            "after_each_burst_round": measured.load.rss_after_rounds,
            "imports_only": round(floors.imports_only_rss_mib, 1),
        },
        "ratios": ratios,
        "aims": aims,
    }


def _rounded(figures: Latency | BurstRound | StartupTimes, digits: int) -> dict[str, float | None]:
    return {name: None if value is None else round(value, digits) for name, value in asdict(figures).items()}


def _meets(value: float, op: str, limit: float) -> bool:
    return value <= limit if op == "<=" else value >= limit


def _machine(kube_version: str, gpus: str) -> dict[str, Any]:
    cpuinfo = Path("/proc/cpuinfo").read_text()
    model = next(
        (line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")), ""
    )
    return {
        "cpus_online": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "cpu_model": model,
        "python": sys.version.split()[0],
        "grpcio": grpc.__version__,
        "kubernetes": kube_version,
        "platform": platform.platform(),
        "gpus": gpus,
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def table(report: dict[str, Any]) -> str:
    m, lat, thr, st, mem, r = (
        report[k] for k in ("machine", "latency_ms", "throughput", "startup_s", "memory_mib", "ratios")
    )
    load, samples = report["load_average"], report["samples"]
    burst, window = samples["burst_claims"], samples["growth_window"]
    rows = [
        f"dra-driver benchmark: {m['gpus']}, Kubernetes {m['kubernetes']}, Python {m['python']}, "
        f"{m['cpus_usable']} CPUs; load average (1/5/15 min) {load['before']} before, {load['after']} after",
        "",
        f"{'latency, ms':44}{'p50':>9}{'p95':>9}{'p99':>9}{'max':>9}{'samples':>9}",
    ]
    labels = {
        "empty_prepare": "NodePrepareResources, no claim (gRPC floor)",
        "api_get": "GET ResourceClaim, same client (API floor)",
        "one_claim_prepare": "prepare, 1-claim pod",
        "one_claim_unprepare": "unprepare, 1-claim pod",
        "one_claim_admin_prepare": "prepare, 1-claim pod, admin access",
        "eight_claim_prepare": "prepare, 8-claim pod",
        "eight_claim_unprepare": "unprepare, 8-claim pod",
        "burst_serial_prepare": f"prepare, {burst} claims one at a time",
        "burst_serial_first": f"  of which the first {window}",
        "burst_serial_last": f"  of which the last {window}",
        "burst_concurrent_prepare": f"prepare, {burst} claims all at once",
    }
    for key, label in labels.items():
        d = lat[key]
        rows.append(
            f"  {label:42}{d['p50']:9.2f}{d['p95']:9.2f}{d['p99']:9.2f}{d['max']:9.2f}{d['samples']:9d}"
        )
    rows += [
        "",
        f"throughput, {burst} claims (median of {samples['burst_rounds']} rounds)",
        f"  prepare, all at once        {thr['concurrent_claims_per_s']:9.1f} claims/s   "
        f"daemon CPU {thr['concurrent_cpu_ms_per_claim']:.2f} ms/claim",
        f"  prepare, one at a time      {thr['serial_claims_per_s']:9.1f} claims/s   "
        f"daemon CPU {thr['serial_cpu_ms_per_claim']:.2f} ms/claim",
        f"  unprepare, all at once      {thr['concurrent_unprepare_claims_per_s']:9.1f} claims/s",
        "",
        f"start-up, s (median of {samples['startups']})   socket {st['socket']:.3f}   "
        f"registered {st['registered']:.3f}   "
        f"ready {st['ready']:.3f}   |  bare python {st['python_bare']:.3f}, "
        f"python + imports {st['python_imports']:.3f}",
        f"memory, MiB (VmRSS)          idle {mem['idle_mib']:.1f}   after load {mem['after_load_mib']:.1f}   "
        f"peak {mem['peak_mib']:.1f}   |  imports only {mem['imports_only']:.1f}",
        f"  after each burst round     {mem['after_each_burst_round']}",
        "",
        "ratios (same run)",
    ]
    rows += [f"  {name:44}{value:8.2f}" for name, value in r.items()]
    rows += ["", "aims (issue 3)"]
    for name, aim in report["aims"].items():
        verdict = "met" if aim["met"] else "MISSED"
        rows.append(f"  {name:32}{aim['aim']:>10}   measured {aim['measured']:>9}   {verdict}")
    return "\n".join(rows)
