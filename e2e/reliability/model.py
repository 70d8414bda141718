"""The model-based test of the node's state (tests/node/test_state_model.py) at the suite's size.

CI runs a fixed, derandomized handful of its sequences with the unit tests; here it runs many
more, each new, on each variant of the machine: the simulated node, and the NVML backend on the
mock libnvidia-ml.so.1 (tests/node/test_state_model_nvml.py), which is slower per step and runs
fewer. It reports, in total and per variant, how many examples and steps it ran, how many crashes
it simulated (also during a restart's recovery) and which claim kinds were prepared at least once.
"""

from __future__ import annotations

from typing import Any

from tests.node import test_state_model as model
from tests.node.test_state_model_nvml import NvmlNodeStateModel

COUNTS = ("examples", "steps", "crash_attempts", "crashes", "crashes_during_start")


def run(examples: int, steps: int, nvml_examples: int) -> dict[str, Any]:
    model.TOTALS.clear()
    model.KINDS_SEEN.clear()
    failures: list[str] = []
    per_variant: dict[str, dict[str, Any]] = {}
    for machine, count in ((model.NodeStateModel, examples), (NvmlNodeStateModel, nvml_examples)):
        failure = model.run_many(machine, count, steps)
        if failure is not None:
            failures.append(f"{machine.variant}: {failure}")
        seen = model.KINDS_SEEN[machine.variant]
        offered = {kind for kind, spec in model.KINDS.items() if getattr(spec, machine.variant)}
        per_variant[machine.variant] = {
            **{name: model.TOTALS[machine.variant][name] for name in COUNTS},
            "kinds": sorted(seen),
            "kinds_not_prepared": sorted(offered - seen),
            "failures": int(failure is not None),
        }
    variants = per_variant.values()
    return {
        # totals over the variants (the keys from before the NVML variant)
        **{f"model.{name}": sum(v[name] for v in variants) for name in COUNTS},
        "model.kinds": sorted(set().union(*(v["kinds"] for v in variants))),
        "model.kinds_not_prepared": sorted(set().union(*(v["kinds_not_prepared"] for v in variants))),
        "model.failures": len(failures),
        "model.problems": failures,
        "model.variants": per_variant,  # the same figures for each variant
    }
