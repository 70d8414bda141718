"""What the controller creates for one ComputeDomain, and how it judges the domain: pure functions.

For a domain the controller creates, as NVIDIA's controller does:

* the workload channel's **ResourceClaimTemplate**, in the domain's namespace, under the name the
  user chose (``spec.channel.resourceClaimTemplate.name``): one ``channel-0`` device of the domain's
  clique, with a ComputeDomainChannelConfig naming the domain;
* the IMEX daemon's **ResourceClaimTemplate** and **DaemonSet**, in the driver's namespace: the
  DaemonSet selects the nodes labelled with the domain's UID, which is the label a node gets when it
  prepares one of the domain's channels -- so a daemon runs exactly where the workload landed.

The clique is chosen once, when the channel template is created, and pinned by that template's CEL
selector: every workload pod of the domain lands on one NVLink clique. Which nodes of a clique are
free is judged from the controller's record of the domains it placed (:class:`Placement`) as well
as from the nodes' labels, which lag: a domain holds its nodes before its workload lands.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from dra_driver.computedomain.api import (
    CLIQUE_ATTRIBUTE,
    KIND,
    ChannelAllocationMode,
    ComputeDomain,
    ComputeDomainDaemonInfo,
    DomainStatus,
    Names,
    channel_config,
    daemon_config,
)

DAEMON_SERVICE_ACCOUNT = "compute-domain-daemon"
Json = dict[str, Any]


def daemon_object_name(domain: ComputeDomain) -> str:
    """The DaemonSet's and the daemon template's name (in the driver's namespace): by UID, unique."""
    return f"computedomain-daemon-{domain.metadata.uid}"


def labels(names: Names, domain: ComputeDomain) -> dict[str, str]:
    return {names.label: domain.metadata.uid}


def clique_selector(names: Names, clique: str) -> str:
    return f"device.attributes['{names.driver}'].{CLIQUE_ATTRIBUTE} == '{clique}'"


def channel_template(names: Names, domain: ComputeDomain, clique: str, *, host_managed: bool = False) -> Json:
    """The workload channel's ResourceClaimTemplate, pinned to ``clique``.

    In the host-managed IMEX mode it asks for channel 0 alone (``Single``) whatever the domain's
    allocationMode, as NVIDIA's controller does: the host's IMEX domain has that one channel to give.
    """
    spec = domain.spec
    mode = ChannelAllocationMode.SINGLE if host_managed else spec.channel.allocation_mode
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {
            "name": spec.channel.resource_claim_template.name,
            "namespace": domain.metadata.namespace,
            "labels": labels(names, domain),
            "annotations": {f"{names.group}/clique": clique},
        },
        "spec": {
            "spec": {
                "devices": {
                    "requests": [
                        {
                            "name": "channel",
                            "exactly": {
                                "deviceClassName": names.channel_class,
                                "selectors": [{"cel": {"expression": clique_selector(names, clique)}}],
                            },
                        }
                    ],
                    "config": [
                        {
                            "requests": ["channel"],
                            "opaque": {
                                "driver": names.driver,
                                "parameters": channel_config(names, domain.metadata.uid, mode),
                            },
                        }
                    ],
                }
            }
        },
    }


def daemon_template(names: Names, domain: ComputeDomain, namespace: str, clique: str) -> Json:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {
            "name": daemon_object_name(domain),
            "namespace": namespace,
            "labels": labels(names, domain),
        },
        "spec": {
            "spec": {
                "devices": {
                    "requests": [
                        {
                            "name": "daemon",
                            "exactly": {
                                "deviceClassName": names.daemon_class,
                                "selectors": [{"cel": {"expression": clique_selector(names, clique)}}],
                            },
                        }
                    ],
                    "config": [
                        {
                            "requests": ["daemon"],
                            "opaque": {
                                "driver": names.driver,
                                "parameters": daemon_config(names, domain.metadata.uid),
                            },
                        }
                    ],
                }
            }
        },
    }


def daemon_set(
    names: Names, domain: ComputeDomain, namespace: str, image: str, *, dns_names: bool = True
) -> Json:
    """The per-node IMEX daemons: on the nodes labelled with the domain, each with its daemon claim.

    ``dns_names`` (NVIDIA's IMEXDaemonsWithDNSNames) reaches the daemons through their environment,
    as NVIDIA's controller hands its feature gates to the daemon pods.
    """
    name = daemon_object_name(domain)

    def field_env(env: str, path: str) -> Json:
        return {"name": env, "valueFrom": {"fieldRef": {"fieldPath": path}}}

    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": name, "namespace": namespace, "labels": labels(names, domain)},
        "spec": {
            "selector": {"matchLabels": labels(names, domain)},
            "template": {
                "metadata": {"labels": labels(names, domain)},
                "spec": {
                    "serviceAccountName": DAEMON_SERVICE_ACCOUNT,
                    "nodeSelector": labels(names, domain),
                    "containers": [
                        {
                            "name": "compute-domain-daemon",
                            "image": image,
                            "command": ["dra-driver", "compute-domain-daemon"],
                            "env": [
                                {"name": "DRA_DRIVER_NAME", "value": names.gpu_driver},
                                {
                                    "name": "DRA_IMEX_DAEMONS_WITH_DNS_NAMES",
                                    "value": "true" if dns_names else "false",
                                },
                                field_env("NODE_NAME", "spec.nodeName"),
                                field_env("POD_IP", "status.podIP"),
                                field_env("POD_NAME", "metadata.name"),
                                field_env("POD_NAMESPACE", "metadata.namespace"),
                                field_env("POD_UID", "metadata.uid"),
                                {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"},
                            ],
                            "resources": {"claims": [{"name": "compute-domain-daemon"}]},
                        }
                    ],
                    # Like NVIDIA's: the daemon must run wherever the workload runs, taints or not.
                    "tolerations": [
                        {"operator": "Exists", "effect": effect}
                        for effect in ("NoSchedule", "NoExecute", "PreferNoSchedule")
                    ],
                    "resourceClaims": [{"name": "compute-domain-daemon", "resourceClaimTemplateName": name}],
                },
            },
        },
    }


# --- choosing a clique ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fabric:
    """The cliques the compute-domain driver's ResourceSlices announce: clique -> node names."""

    cliques: Mapping[str, frozenset[str]] = field(default_factory=dict)


def fabric_from_slices(names: Names, slices: Iterable[Json]) -> Fabric:
    cliques: dict[str, set[str]] = {}
    for item in slices:
        spec = item.get("spec") or {}
        if spec.get("driver") != names.driver or not spec.get("nodeName"):
            continue
        for device in spec.get("devices") or []:
            clique = (device.get("attributes") or {}).get(CLIQUE_ATTRIBUTE, {}).get("string")
            if clique:
                cliques.setdefault(clique, set()).add(spec["nodeName"])
    return Fabric({clique: frozenset(nodes) for clique, nodes in cliques.items()})


@dataclass(frozen=True)
class Placement:
    """Where the controller placed a domain: its clique, and how many of the clique's nodes it holds
    (``numNodes``, at least one: a domain of any size holds one node before its workload lands)."""

    clique: str
    nodes: int

    @staticmethod
    def of(domain: ComputeDomain, clique: str) -> Placement:
        return Placement(clique, max(domain.spec.num_nodes, 1))


@dataclass(frozen=True)
class Choice:
    clique: str = ""
    reason: str = ""  # the condition reason when no clique fits
    message: str = ""


def free_nodes(
    uid: str, fabric: Fabric, placed: Mapping[str, Placement], busy_nodes: Mapping[str, str]
) -> dict[str, int]:
    """Per clique, the nodes not held by a domain other than ``uid``.

    A placed domain holds ``numNodes`` nodes of its clique from the moment it is placed, or more
    once more of them serve it (``numNodes`` 0); a node serving any other domain is held, known to
    the record or not. The node labels alone would not do: they appear only once a workload lands, so
    two domains created together would both see every node free.
    """
    serving: dict[str, set[str]] = {}
    for node, owner in busy_nodes.items():
        if owner != uid:
            serving.setdefault(owner, set()).add(node)
    free = {}
    for clique, nodes in fabric.cliques.items():
        held = 0
        for labelled in serving.values():
            held += len(labelled & nodes)
        for owner, place in placed.items():
            if owner != uid and place.clique == clique:
                held += max(place.nodes - len(serving.get(owner, set()) & nodes), 0)
        free[clique] = max(len(nodes) - held, 0)
    return free


def choose_clique(
    domain: ComputeDomain,
    fabric: Fabric,
    placed: Mapping[str, Placement],
    busy_nodes: Mapping[str, str],
) -> Choice:
    """The clique with the most free nodes (see :func:`free_nodes`), if it has room for ``numNodes``.

    ``placed`` is the controller's record of the domains it placed (by UID); ``busy_nodes`` maps a
    node to the UID of the domain it serves now.
    """
    if not fabric.cliques:
        return Choice(
            reason="NoFabric",
            message="no node reports NVLink fabric info (cluster UUID and clique id): no node can join "
            "a ComputeDomain. Nodes need GPUs of a multi-node NVLink system (e.g. GB200 NVL72).",
        )
    free = free_nodes(domain.metadata.uid, fabric, placed, busy_nodes)
    best = max(sorted(fabric.cliques), key=lambda clique: free[clique])
    wanted = domain.spec.num_nodes
    largest = max(len(nodes) for nodes in fabric.cliques.values())
    if wanted > largest:
        return Choice(
            reason="DomainLargerThanClique",
            message=f"numNodes {wanted} is larger than every NVLink clique: the largest has {largest} "
            f"node(s); {len(fabric.cliques)} clique(s) known",
        )
    if wanted > free[best]:
        return Choice(
            reason="CliqueBusy",
            message=f"no NVLink clique has {wanted} node(s) free of other ComputeDomains (at most "
            f"{free[best]}); waiting",
        )
    return Choice(clique=best)


# --- status -----------------------------------------------------------------------------------------


def overall_status(domain: ComputeDomain, clique: str) -> DomainStatus:
    """Ready once ``numNodes`` daemons on the clique are ready (any number >= 1 when numNodes is 0)."""
    ready = [n for n in domain.status.nodes if n.status is DomainStatus.READY and n.clique_id == clique]
    wanted = domain.spec.num_nodes
    fine = bool(ready) and len(ready) == len(domain.status.nodes) if wanted == 0 else len(ready) >= wanted
    return DomainStatus.READY if fine else DomainStatus.NOT_READY


def daemon_failures(cliques: Iterable[Json]) -> dict[str, str]:
    """Node -> why its daemon failed, for each daemon that is not ready and says why."""
    failures = {}
    for clique in cliques:
        for item in clique.get("daemons") or []:
            with contextlib.suppress(ValidationError):
                daemon = ComputeDomainDaemonInfo.model_validate(item)
                if daemon.status is DomainStatus.NOT_READY and daemon.message:
                    failures[daemon.node_name] = daemon.message
    return failures


def nodes_from_cliques(cliques: Iterable[Json]) -> list[Json]:
    """``status.nodes`` of a domain: every daemon entry of its ComputeDomainCliques, in a stable order."""
    entries = []
    for clique in cliques:
        for item in clique.get("daemons") or []:
            with contextlib.suppress(ValidationError):  # a hand-edited entry: left out, not fatal
                entries.append(ComputeDomainDaemonInfo.model_validate(item).as_node())
    return sorted(entries, key=lambda n: (n["cliqueID"], n["index"], n["name"]))


def pruned_daemons(clique: Json, members: set[str]) -> list[Json] | None:
    """The clique's daemon entries without those of nodes no longer in the domain; None: none to drop."""
    daemons: list[Json] = list(clique.get("daemons") or [])
    kept = [d for d in daemons if d.get("nodeName") in members]
    return kept if len(kept) != len(daemons) else None


def condition(kind: str, ok: bool, reason: str, message: str, generation: int, now: str) -> Json:
    return {
        "type": kind,
        "status": "True" if ok else "False",
        "reason": reason,
        "message": message,
        "observedGeneration": generation,
        "lastTransitionTime": now,
    }


def merge_conditions(old: Sequence[Json], new: Sequence[Json]) -> list[Json]:
    """``new``, keeping the transition time of a condition whose status did not change."""
    previous = {c.get("type"): c for c in old}
    merged = []
    for item in new:
        before = previous.get(item["type"])
        if before and before.get("status") == item["status"] and before.get("lastTransitionTime"):
            item = {**item, "lastTransitionTime": before["lastTransitionTime"]}
        merged.append(item)
    return merged


def event(names: Names, domain: ComputeDomain, reason: str, message: str, now: str, warning: bool) -> Json:
    meta = domain.metadata
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{meta.name}.", "namespace": meta.namespace},
        "involvedObject": {
            "apiVersion": names.api_version,
            "kind": KIND,
            "name": meta.name,
            "namespace": meta.namespace,
            "uid": meta.uid,
        },
        "reason": reason,
        "message": message,
        "type": "Warning" if warning else "Normal",
        "source": {"component": "compute-domain-controller"},
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }
