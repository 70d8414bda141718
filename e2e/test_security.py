"""The attack suite (e2e/security) in ``make test``: on the session's control plane, and on every
supported release (``kube_versions``). The suite is small enough to run whole: every attempt of
``make security`` is made here too, and it writes the same ``_output/security.json``."""

from __future__ import annotations

from pathlib import Path

import pytest

from e2e.cluster import ClusterInfo
from e2e.security import suite
from e2e.security.__main__ import OUTPUT

pytestmark = [pytest.mark.cluster, pytest.mark.kube_versions]


@pytest.fixture(scope="module")
def report(cluster: ClusterInfo) -> suite.JsonObject:
    result = suite.run(cluster)
    Path(OUTPUT).parent.mkdir(parents=True, exist_ok=True)
    Path(OUTPUT).write_text(suite.dumps(result))
    return result


def test_every_attack_of_the_charts_accounts_is_refused(report: suite.JsonObject) -> None:
    totals = report["totals"]
    assert totals["attempts"] >= 70
    assert not report["missed_goals"], "\n".join(report["missed_goals"])
    assert totals["refused"] == totals["attempts"]


def test_each_account_and_kind_is_attacked(report: suite.JsonObject) -> None:
    assert set(report["kinds"]) >= {
        "plugin.deployments",
        "plugin.slices",
        "plugin.nodes",
        "plugin.claim_status",
        "plugin-unbound",
        "controller.daemonsets",
        "controller.templates",
        "controller.cliques",
        "imex-daemon.cliques",
        "webhook",
        "tenant.admin_access",
        "tenant.sharing",
        "tenant.mps",
        "tenant.symlinks",
        "tenant.configs",
    }
    # Both credentials, the real pod-bound token and the impersonation, got the same verdicts.
    assert report["totals"]["mismatches"] == 0


def test_a_tenants_attempts_fail_for_its_own_claim_alone(report: suite.JsonObject) -> None:
    """The tenant's side (e2e/security/tenant.py): each attempt refused, by whom it must be, and the
    neighbours it could have hurt prepared as their class says (positive controls)."""
    tenant = [a for a in report["attempts"] if a["kind"].startswith("tenant.")]
    assert len(tenant) >= 17
    refusers = {a["what"]: set(a["refusers"].values()) for a in tenant}
    assert all(set(a["verdicts"].values()) == {"refused"} for a in tenant), tenant
    assert all(r <= {"api-server", "rbac", "driver", "driver (ignored)"} and r for r in refusers.values())
    controls = [c for c in report["controls"]["list"] if c["kind"].startswith("tenant.")]
    assert len(controls) == 7
    assert all(c["ok"] for c in controls), controls


def test_what_the_driver_writes_still_passes_the_policies(report: suite.JsonObject) -> None:
    controls = report["controls"]
    assert controls["failed"] == 0, controls["list"]
    assert controls["passed"] == 16
    policies = report["policies"]
    assert len(policies) >= 7, sorted(policies)
    assert all(p["bound"] and not p["warnings"] for p in policies.values()), policies
