"""IMEX daemons addressed by DNS names (NVIDIA's ``IMEXDaemonsWithDNSNames``, on by default).

Without DNS names, an IMEX daemon's nodes file lists its peers' IP addresses, so every change of a
peer's address (a daemon pod restarted elsewhere, a new pod IP) means a new nodes file and a restart
of the daemon, and the daemons have to wait until all ``numNodes`` of them are known before they can
start at all. With DNS names, as NVIDIA's compute-domain daemon does it:

* the nodes file is written once and never changes: ``compute-domain-daemon-0000`` up to
  ``compute-domain-daemon-0017``, one name per possible member of an IMEX domain (18, the compute
  trays of a GB200 NVL72 rack, NVIDIA's ``--max-nodes-per-imex-domain`` default);
* a daemon's name follows from its ``index`` in the domain's ComputeDomainClique, which stays one
  node's for as long as it is a member (:mod:`dra_driver.simulated.imex_daemon`);
* each daemon keeps its pod's ``/etc/hosts`` mapping those names to the current IP addresses of the
  clique's daemons, so a peer that comes back with a new address is found again by the same name.

Pure functions: what the files say, from the clique's entries.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from dra_driver.computedomain.api import ComputeDomainDaemonInfo

DNS_NAME_PREFIX = "compute-domain-daemon-"
MAX_NODES_PER_IMEX_DOMAIN = 18
HOSTS_COMMENT = "# ComputeDomain IMEX daemons (written by the compute-domain daemon)"


def dns_name(index: int) -> str:
    """The stable name of the daemon with ``index`` in its clique."""
    return f"{DNS_NAME_PREFIX}{index:04d}"


def static_nodes_config(max_nodes: int = MAX_NODES_PER_IMEX_DOMAIN) -> str:
    """The nodes file of a daemon with DNS names: every name a member can have, one per line."""
    return "".join(f"{dns_name(index)}\n" for index in range(max_nodes))


def name_to_address(
    daemons: Iterable[ComputeDomainDaemonInfo], clique: str, max_nodes: int = MAX_NODES_PER_IMEX_DOMAIN
) -> dict[str, str]:
    """The DNS name of each daemon of ``clique`` that has an address, mapped to that address.

    An entry whose index lies beyond ``max_nodes`` has no name in the nodes file: it is left out
    (NVIDIA's daemon refuses to take such an index in the first place).
    """
    return {
        dns_name(daemon.index): daemon.ip_address
        for daemon in daemons
        if daemon.clique_id == clique and daemon.ip_address and 0 <= daemon.index < max_nodes
    }


def hosts_file_text(current: str, names: Mapping[str, str]) -> str:
    """``current`` (a hosts file) with its daemon lines replaced by ``names`` (name -> address).

    Every other line is kept as it was: the pod's own entries, written by the kubelet.
    """
    kept = [
        line for line in current.splitlines() if DNS_NAME_PREFIX not in line and line.strip() != HOSTS_COMMENT
    ]
    while kept and not kept[-1].strip():
        kept.pop()
    ours = [f"{address}\t{name}" for name, address in sorted(names.items())]
    lines = [*kept, HOSTS_COMMENT, *ours] if ours else kept
    return "".join(f"{line}\n" for line in lines)


def resolve(hosts_text: str, name: str) -> str | None:
    """The address ``name`` has in a hosts file (the first line that lists it), as a resolver finds it."""
    for line in hosts_text.splitlines():
        fields = line.split("#", 1)[0].split()
        if len(fields) >= 2 and name in fields[1:]:
            return fields[0]
    return None
