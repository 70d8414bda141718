"""The model-based test of the node's state (tests/node/test_state_model.py) at the suite's size.

CI runs a fixed, derandomized handful of its sequences with the unit tests; here it runs many
more, each new, and reports how many examples and steps it ran, how many crashes it simulated
(also during a restart's recovery) and which claim kinds were prepared at least once.
"""

from __future__ import annotations

from typing import Any

from tests.node import test_state_model as model


def run(examples: int, steps: int) -> dict[str, Any]:
    model.TOTALS.clear()
    model.KINDS_SEEN.clear()
    failure = model.run_many(examples, steps)
    return {
        "model.examples": model.TOTALS["examples"],
        "model.steps": model.TOTALS["steps"],
        "model.crash_attempts": model.TOTALS["crash_attempts"],  # armed; not every point is reached
        "model.crashes": model.TOTALS["crashes"],
        "model.crashes_during_start": model.TOTALS["crashes_during_start"],
        "model.kinds": sorted(model.KINDS_SEEN),
        "model.kinds_not_prepared": sorted(set(model.Kind) - model.KINDS_SEEN),
        "model.failures": int(failure is not None),
        "model.problems": [failure] if failure else [],
    }
