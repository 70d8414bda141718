"""Percentiles and ratios: the only figures this machine measures reliably (see README.md)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Latency:
    """A latency distribution in milliseconds; percentiles interpolate between samples."""

    samples: int
    p50: float
    p95: float
    p99: float
    mean: float
    max: float

    @classmethod
    def of(cls, seconds: Sequence[float]) -> Latency:
        if len(seconds) < 2:
            raise ValueError("a distribution needs at least two samples")
        ms = sorted(s * 1000 for s in seconds)
        cuts = statistics.quantiles(ms, n=100, method="inclusive")
        return cls(
            samples=len(ms),
            p50=statistics.median(ms),
            p95=cuts[94],
            p99=cuts[98],
            mean=statistics.fmean(ms),
            max=ms[-1],
        )


def ratio(numerator: float, denominator: float) -> float:
    return round(numerator / denominator, 2) if denominator else float("inf")
