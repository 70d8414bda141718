"""What every scenario shares: the real control plane, a fake Node per scenario, allocated claims."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.claims import AllocatedClaims
from dra_driver.node.types import ClaimRef
from e2e.cluster import (
    ClusterInfo,
    ControlPlane,
    JsonObject,
    create_fake_node,
    ensure_control_plane_binaries,
)
from e2e.driver import DriverPaths
from e2e.reliability.plugin import DRIVER, Plugin

_names = itertools.count()


@dataclass
class Env:
    """A running control plane and a scratch directory for the scenarios' nodes."""

    cluster: ClusterInfo
    base: Path

    def node(self, prefix: str) -> SimNode:
        """A new Ready fake Node and a namespace of the same name for its claims."""
        name = f"{prefix}-{next(_names)}"
        with self.cluster.api_client() as api:
            create_fake_node(api, name)
        claims = AllocatedClaims(self.cluster.rest(), DRIVER, name)
        claims.namespace(name, admin_access=False)
        claims.namespace(f"{name}-admin", admin_access=True)  # monitoring pods' claims
        return SimNode(self, name, claims)


@dataclass
class SimNode:
    env: Env
    name: str
    claims: AllocatedClaims

    def paths(self) -> DriverPaths:
        """The node's host paths; every instance of the node shares them (but not the sockets)."""
        base = self.env.base / self.name
        return DriverPaths.under(base, registry=base / "registry")

    def plugin(
        self, pod_uid: str = "", paths: DriverPaths | None = None, extra_args: Sequence[str] = ()
    ) -> Plugin:
        log = self.env.base / self.name / f"daemon{'-' + pod_uid if pod_uid else ''}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        return Plugin(
            kubeconfig=self.env.cluster.kubeconfig,
            node=self.name,
            paths=paths or self.paths(),
            log=log,
            pod_uid=pod_uid,
            extra_args=extra_args,
        )

    def claim(
        self,
        device: str,
        *,
        share_id: str | None = None,
        consumed: Mapping[str, str] | None = None,
        config: JsonObject | None = None,
    ) -> ClaimRef:
        """A new claim in the node's namespace, allocated ``device`` of this node (or a share of it,
        with ``share_id`` and ``consumed``), with the driver's opaque ``config`` if given."""
        return self.claims.create(
            self.name,
            f"c{next(_names)}",
            device,
            admin_access=False,
            share_id=share_id,
            consumed=consumed,
            config=config,
        )

    def admin_claim(self, device: str) -> ClaimRef:
        """A claim with admin access to ``device`` (a monitoring pod's), in the admin namespace."""
        return self.claims.create(f"{self.name}-admin", f"a{next(_names)}", device, admin_access=True)


@contextlib.contextmanager
def environment(base: Path) -> Iterator[Env]:
    """Starts the control plane under ``base`` and stops it again, also on failure."""
    binaries = ensure_control_plane_binaries()
    control_plane = ControlPlane(binaries, base / "cluster", die_with_parent=True)
    with control_plane:
        yield Env(cluster=control_plane.info, base=base)
