"""What a daemon with DNS names writes: the fixed nodes file and the hosts file entries."""

from __future__ import annotations

from dra_driver.computedomain.api import ComputeDomainDaemonInfo
from dra_driver.computedomain.dnsnames import hosts_file_text, name_to_address, resolve, static_nodes_config

CLIQUE = "6f1c2b7e-3d4a-4e5f-8a9b-0c1d2e3f4a5b.1"
KUBELETS = "# Kubernetes-managed hosts file.\n127.0.0.1\tlocalhost\n10.0.0.1\tdaemon-a1\n"


def info(node: str, ip: str, index: int, clique: str = CLIQUE) -> ComputeDomainDaemonInfo:
    return ComputeDomainDaemonInfo(node_name=node, ip_address=ip, clique_id=clique, index=index)


def test_the_nodes_file_lists_eighteen_fixed_names_as_nvidias_does() -> None:
    lines = static_nodes_config().splitlines()
    assert len(lines) == 18
    assert lines[0] == "compute-domain-daemon-0000"
    assert lines[-1] == "compute-domain-daemon-0017"


def test_names_follow_the_index_in_the_clique_and_other_cliques_are_left_out() -> None:
    daemons = [
        info("a1", "10.0.0.1", 0),
        info("a2", "10.0.0.2", 1),
        info("b1", "10.0.9.1", 0, clique="other.2"),
        info("a3", "", 2),  # not yet with an address
        info("a4", "10.0.0.4", 18),  # beyond the nodes file
    ]
    assert name_to_address(daemons, CLIQUE) == {
        "compute-domain-daemon-0000": "10.0.0.1",
        "compute-domain-daemon-0001": "10.0.0.2",
    }


def test_the_hosts_file_keeps_the_kubelets_lines_and_replaces_only_the_daemons() -> None:
    first = hosts_file_text(KUBELETS, {"compute-domain-daemon-0000": "10.0.0.1"})
    assert first.startswith(KUBELETS)
    assert resolve(first, "compute-domain-daemon-0000") == "10.0.0.1"
    # A peer comes back with a new address: same name, new line; the kubelet's lines stay.
    second = hosts_file_text(
        first, {"compute-domain-daemon-0000": "10.0.0.1", "compute-domain-daemon-0001": "10.0.0.22"}
    )
    assert second == (
        KUBELETS + "# ComputeDomain IMEX daemons (written by the compute-domain daemon)\n"
        "10.0.0.1\tcompute-domain-daemon-0000\n"
        "10.0.0.22\tcompute-domain-daemon-0001\n"
    )
    assert hosts_file_text(second, {}) == KUBELETS  # the last daemon left
    assert resolve(second, "daemon-a1") == "10.0.0.1"
    assert resolve(second, "compute-domain-daemon-0002") is None
