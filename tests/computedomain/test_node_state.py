"""The compute-domain driver's claims in the node's store: one claim per device, restarts, a lost store,
a reboot, and the per-claim files of earlier versions."""

from __future__ import annotations

import asyncio
import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from dra_driver.cdi.store import SpecStore
from dra_driver.cdi.validate import minimum_version
from dra_driver.computedomain.api import (
    ChannelAllocationMode,
    ComputeDomain,
    channel_config,
    daemon_config,
    parse_compute_domain,
)
from dra_driver.node.store import STORE_FILE, DomainClaim, open_store
from dra_driver.node.types import ClaimError, ClaimRef
from tests.computedomain.test_node import (
    CLIQUE,
    NAMES,
    NODE,
    FakeDomains,
    domain,
    preparer,
)
from tests.node.builders import InMemoryClaims, claim_json, new_ref, opaque, result


def ready(cd: ComputeDomain) -> ComputeDomain:
    """``cd`` with this node's IMEX daemon Ready."""
    return parse_compute_domain(
        {
            **cd.model_dump(by_alias=True),
            "status": {
                "nodes": [{"name": NODE, "cliqueID": CLIQUE, "status": "Ready", "ipAddress": "10.0.0.1"}]
            },
        }
    )


_names = itertools.count()


def channel_claim(
    claims: InMemoryClaims, cd: ComputeDomain, mode: ChannelAllocationMode = ChannelAllocationMode.SINGLE
) -> ClaimRef:
    """A workload pod's channel claim, named apart from the others."""
    ref = new_ref(f"channel-{next(_names)}")
    config = opaque(channel_config(NAMES, cd.metadata.uid, mode), driver=NAMES.driver)
    claims.put(claim_json(ref, [result("channel-0", "channel", driver=NAMES.driver, pool=NODE)], [config]))
    return ref


def daemon_claim(claims: InMemoryClaims, cd: ComputeDomain) -> ClaimRef:
    ref = new_ref(f"daemon-{next(_names)}", "dra-driver")
    config = opaque(daemon_config(NAMES, cd.metadata.uid), driver=NAMES.driver)
    claims.put(claim_json(ref, [result("daemon-0", "daemon", driver=NAMES.driver, pool=NODE)], [config]))
    return ref


def specs(tmp_path: Path) -> set[str]:
    return SpecStore(tmp_path / "cdi", NAMES.driver).claim_uids()


def rows(tmp_path: Path) -> dict[str, DomainClaim]:
    store = open_store(tmp_path / STORE_FILE, "boot-1").store
    try:
        return {claim.uid: claim for claim in store.domain_claims()}
    finally:
        store.close()


@pytest.mark.parametrize("mode", list(ChannelAllocationMode))
def test_a_second_channel_claim_is_refused_while_the_first_holds_the_channel(
    tmp_path: Path, mode: ChannelAllocationMode
) -> None:
    """NVIDIA's rule: every channel claim is one of channel 0, allocationMode All too."""
    cd = ready(domain())
    domains, claims = FakeDomains(cd), InMemoryClaims()
    node = preparer(tmp_path, domains, claims)
    first, second = channel_claim(claims, cd, mode), channel_claim(claims, cd, mode)
    assert not isinstance(asyncio.run(node.prepare([first]))[first.uid], ClaimError)

    refused = asyncio.run(node.prepare([second]))[second.uid]

    assert isinstance(refused, ClaimError)
    assert (
        f"device channel-0 is already prepared for claim default/{first.name} ({first.uid})"
        in refused.message
    )
    assert specs(tmp_path) == {first.uid}
    assert asyncio.run(node.unprepare([first])) == {first.uid: None}
    assert not isinstance(asyncio.run(node.prepare([second]))[second.uid], ClaimError)
    assert domains.labels == {NODE: cd.metadata.uid}


def test_a_channel_claim_waiting_for_its_daemon_holds_the_channel(tmp_path: Path) -> None:
    cd = domain()  # its daemon on this node is not ready yet
    claims = InMemoryClaims()
    node = preparer(tmp_path, FakeDomains(cd), claims)
    waiting, second = channel_claim(claims, cd), channel_claim(claims, cd)
    assert "waiting for the IMEX daemon" in asyncio.run(node.prepare([waiting]))[waiting.uid].message  # type: ignore[union-attr]

    refused = asyncio.run(node.prepare([second]))[second.uid]

    assert isinstance(refused, ClaimError)
    assert "already prepared for claim" in refused.message
    assert rows(tmp_path)[waiting.uid].phase == "PrepareStarted"


def test_a_replaced_daemon_pod_waits_for_the_old_ones_unprepare_and_keeps_its_files(tmp_path: Path) -> None:
    """The old daemon claim's unprepare removes the domain's directory: it must not come after the new
    claim wrote it (one daemon device per node, so the scheduler's new allocation can only be stale)."""
    cd = ready(domain())
    claims = InMemoryClaims()
    node = preparer(tmp_path, FakeDomains(cd), claims)
    old, new = daemon_claim(claims, cd), daemon_claim(claims, cd)
    assert not isinstance(asyncio.run(node.prepare([old]))[old.uid], ClaimError)

    assert isinstance(asyncio.run(node.prepare([new]))[new.uid], ClaimError)
    assert asyncio.run(node.unprepare([old])) == {old.uid: None}
    assert not isinstance(asyncio.run(node.prepare([new]))[new.uid], ClaimError)

    directory = tmp_path / "compute-domains" / "domains" / cd.metadata.uid
    assert (directory / "nodes_config.cfg").read_text() == "10.0.0.1\n"


def test_a_restart_keeps_the_claims_and_their_unprepare_undoes_what_prepare_did(tmp_path: Path) -> None:
    cd = ready(domain())
    domains, claims = FakeDomains(cd), InMemoryClaims()
    channel, daemon = channel_claim(claims, cd), daemon_claim(claims, cd)
    asyncio.run(preparer(tmp_path, domains, claims).prepare([channel, daemon]))

    restarted = preparer(tmp_path, domains, claims)

    assert restarted.prepared_claim_uids() == {channel.uid, daemon.uid}
    assert asyncio.run(restarted.unprepare([channel, daemon])) == {channel.uid: None, daemon.uid: None}
    assert domains.labels == {}
    assert not (tmp_path / "compute-domains" / "domains" / cd.metadata.uid).exists()
    assert specs(tmp_path) == set()
    assert rows(tmp_path) == {}


def test_a_lost_store_is_rebuilt_from_the_specs_and_keeps_the_channel_held(tmp_path: Path) -> None:
    cd = ready(domain())
    domains, claims = FakeDomains(cd), InMemoryClaims()
    channel, daemon, later = channel_claim(claims, cd), daemon_claim(claims, cd), channel_claim(claims, cd)
    asyncio.run(preparer(tmp_path, domains, claims).prepare([channel, daemon]))
    (tmp_path / STORE_FILE).unlink()  # with the GPU driver's records: the data directory was wiped

    restarted = preparer(tmp_path, domains, claims)

    recovered = rows(tmp_path)
    assert (recovered[channel.uid].device, recovered[channel.uid].domain_uid) == ("channel-0", "")
    assert (recovered[daemon.uid].device, recovered[daemon.uid].domain_uid) == ("daemon-0", cd.metadata.uid)
    assert isinstance(asyncio.run(restarted.prepare([later]))[later.uid], ClaimError)
    assert not isinstance(asyncio.run(restarted.prepare([channel]))[channel.uid], ClaimError)  # the repeat
    assert rows(tmp_path)[channel.uid].domain_uid == cd.metadata.uid
    assert asyncio.run(restarted.unprepare([channel, daemon])) == {channel.uid: None, daemon.uid: None}
    assert domains.labels == {}
    assert not (tmp_path / "compute-domains" / "domains" / cd.metadata.uid).exists()


def test_two_specs_of_one_channel_after_a_lost_store_keep_one_claim_and_report_the_other(
    tmp_path: Path,
) -> None:
    """Both specs name channel-0 (the younger written by a driver without the store's index): the
    rebuild records one claim and reports the other, naming both, for the Event on the Node."""
    cd = ready(domain())
    domains, claims = FakeDomains(cd), InMemoryClaims()
    first, second = channel_claim(claims, cd), channel_claim(claims, cd)
    asyncio.run(preparer(tmp_path, domains, claims).prepare([first]))
    cdi = SpecStore(tmp_path / "cdi", NAMES.driver)
    copied = json.loads(json.dumps(cdi.read(first.uid)).replace(first.uid, second.uid))
    copied["cdiVersion"] = minimum_version(copied)  # a device name that starts with a digit needs 0.5.0
    cdi.write(second.uid, copied)
    (tmp_path / STORE_FILE).unlink()

    restarted = preparer(tmp_path, domains, claims)

    kept, refused = sorted([first.uid, second.uid])  # rebuilt in the order of their uids
    assert set(rows(tmp_path)) == {kept}
    (conflict,) = restarted.recovery_conflicts
    assert (conflict.uid, conflict.holder) == (refused, kept)
    assert "channel-0" in conflict.reason


def test_an_earlier_versions_claim_files_naming_one_channel_twice_report_the_second(tmp_path: Path) -> None:
    cd = ready(domain())
    domains, claims = FakeDomains(cd), InMemoryClaims()
    first, second = channel_claim(claims, cd), channel_claim(claims, cd)
    legacy = tmp_path / "compute-domains" / "claims"
    legacy.mkdir(parents=True)
    for ref in (first, second):
        (legacy / f"{ref.uid}.json").write_text(json.dumps({"kind": "channel", "domainUID": cd.metadata.uid}))

    upgraded = preparer(tmp_path, domains, claims)

    kept, refused = sorted([first.uid, second.uid])  # the files are read in the order of their names
    assert set(rows(tmp_path)) == {kept}
    (conflict,) = upgraded.recovery_conflicts
    assert (conflict.uid, conflict.holder) == (refused, kept)


def test_a_recovered_channels_unprepare_removes_the_label_of_its_unnamed_domain(tmp_path: Path) -> None:
    cd = ready(domain())
    domains, claims = FakeDomains(cd), InMemoryClaims()
    channel = channel_claim(claims, cd)
    asyncio.run(preparer(tmp_path, domains, claims).prepare([channel]))
    (tmp_path / STORE_FILE).unlink()

    assert asyncio.run(preparer(tmp_path, domains, claims).unprepare([channel])) == {channel.uid: None}

    assert domains.labels == {}


def test_a_waiting_channel_lost_with_the_store_leaves_no_label_after_its_unprepare(tmp_path: Path) -> None:
    cd = domain()
    domains, claims = FakeDomains(cd), InMemoryClaims()
    waiting = channel_claim(claims, cd)
    asyncio.run(preparer(tmp_path, domains, claims).prepare([waiting]))
    assert domains.labels == {NODE: cd.metadata.uid}
    (tmp_path / STORE_FILE).unlink()

    assert asyncio.run(preparer(tmp_path, domains, claims).unprepare([waiting])) == {waiting.uid: None}

    assert domains.labels == {}


def test_an_unknown_claims_unprepare_keeps_the_label_of_a_recorded_channel(tmp_path: Path) -> None:
    cd = ready(domain())
    domains, claims = FakeDomains(cd), InMemoryClaims()
    node = preparer(tmp_path, domains, claims)
    channel = channel_claim(claims, cd)
    asyncio.run(node.prepare([channel]))

    unknown = new_ref("never-prepared")
    assert asyncio.run(node.unprepare([unknown])) == {unknown.uid: None}

    assert domains.labels == {NODE: cd.metadata.uid}


def test_after_a_reboot_the_specs_and_daemon_files_of_the_earlier_boot_go(tmp_path: Path) -> None:
    cd = ready(domain())
    domains, claims = FakeDomains(cd), InMemoryClaims()
    channel, daemon = channel_claim(claims, cd), daemon_claim(claims, cd)
    asyncio.run(preparer(tmp_path, domains, claims).prepare([channel, daemon]))

    rebooted = preparer(tmp_path, domains, claims, boot_id="boot-2")

    assert rebooted.prepared_claim_uids() == set()
    assert specs(tmp_path) == set()
    assert not (tmp_path / "compute-domains" / "domains" / cd.metadata.uid).exists()


def test_the_per_claim_files_of_the_earlier_version_are_imported_once_and_moved_aside(tmp_path: Path) -> None:
    cd = ready(domain())
    domains, claims = FakeDomains(cd), InMemoryClaims()
    channel, daemon = channel_claim(claims, cd), daemon_claim(claims, cd)
    node = preparer(tmp_path, domains, claims)
    asyncio.run(node.prepare([channel, daemon]))
    # What the earlier version left: a JSON file per claim, and a store of schema 4 (or none).
    legacy = tmp_path / "compute-domains" / "claims"
    legacy.mkdir(parents=True)
    for ref, kind in ((channel, "channel"), (daemon, "daemon")):
        (legacy / f"{ref.uid}.json").write_text(json.dumps({"kind": kind, "domainUID": cd.metadata.uid}))
    (legacy / "broken.json").write_text("{")
    (tmp_path / STORE_FILE).unlink()

    upgraded = preparer(tmp_path, domains, claims)

    imported = rows(tmp_path)
    assert {uid: (c.kind, c.domain_uid, c.phase) for uid, c in imported.items()} == {
        channel.uid: ("channel", cd.metadata.uid, "PrepareCompleted"),
        daemon.uid: ("daemon", cd.metadata.uid, "PrepareCompleted"),
    }
    assert not legacy.exists()
    assert (legacy.parent / "claims.imported" / f"{channel.uid}.json").exists()
    assert asyncio.run(upgraded.unprepare([channel, daemon])) == {channel.uid: None, daemon.uid: None}
    assert domains.labels == {}


def test_a_daemon_directory_no_claim_names_is_removed_at_start(tmp_path: Path) -> None:
    """What a daemon prepare that died after writing the files leaves when the store is then lost."""
    leftover = tmp_path / "compute-domains" / "domains" / "8c5e2a6e-0000-4000-8000-000000000001"
    leftover.mkdir(parents=True)
    (leftover / "imexd.cfg").write_text("")

    preparer(tmp_path, FakeDomains(), InMemoryClaims())

    assert not leftover.exists()


def test_a_store_of_schema_4_is_upgraded_in_place_and_its_boot_kept_for_the_compute_domains(
    tmp_path: Path,
) -> None:
    """An upgraded node after a reboot: the compute-domain driver's files are of the store's boot."""
    cd = ready(domain())
    domains, claims = FakeDomains(cd), InMemoryClaims()
    channel = channel_claim(claims, cd)
    asyncio.run(preparer(tmp_path, domains, claims).prepare([channel]))
    store = open_store(tmp_path / STORE_FILE, "boot-1").store
    db = store._db  # made what schema 4 was: no table, no boot of its own
    db.execute("DROP TABLE domain_claims")
    db.execute("DELETE FROM meta WHERE key = 'compute_domains_boot_id'")
    db.execute("PRAGMA user_version = 4")
    store.close()

    preparer(tmp_path, domains, claims, boot_id="boot-2")

    assert specs(tmp_path) == set(), "the spec of the earlier boot stayed"
    assert rows(tmp_path) == {}


def test_dra_driver_state_shows_the_channel_and_daemon_claims(tmp_path: Path) -> None:
    cd = ready(domain())
    claims = InMemoryClaims()
    node = preparer(tmp_path, FakeDomains(cd), claims)
    channel, daemon = channel_claim(claims, cd, ChannelAllocationMode.ALL), daemon_claim(claims, cd)
    asyncio.run(node.prepare([channel, daemon]))

    def state(*args: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "dra_driver", "state", "--data-dir", str(tmp_path), *args],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        return done.stdout

    table, document = state().splitlines(), json.loads(state("-o", "json"))

    assert any(
        line.startswith(f"default/{channel.name} ")
        and "PrepareCompleted" in line
        and "channel-0 (allocationMode All)" in line
        and line.endswith(cd.metadata.uid)
        for line in table
    ), table
    assert {c["uid"]: (c["kind"], c["device"]) for c in document["computeDomainClaims"]} == {
        channel.uid: ("channel", "channel-0"),
        daemon.uid: ("daemon", "daemon-0"),
    }


def test_the_kubelets_repeat_of_a_prepared_channel_answers_from_the_store(tmp_path: Path) -> None:
    """Found by the model: a repeat that wrote the record again and died left a prepared claim half-done."""
    cd = ready(domain())
    domains, claims = FakeDomains(cd), InMemoryClaims()
    node = preparer(tmp_path, domains, claims)
    channel = channel_claim(claims, cd)
    (first,) = asyncio.run(node.prepare([channel]))[channel.uid]  # type: ignore[misc]

    async def unreachable(uid: str) -> str | None:
        raise OSError("the API server is unreachable")

    domains.label_node = unreachable  # type: ignore[method-assign]
    (again,) = asyncio.run(node.prepare([channel]))[channel.uid]  # type: ignore[misc]

    assert again == first
    assert rows(tmp_path)[channel.uid].phase == "PrepareCompleted"
