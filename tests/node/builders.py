"""Builders for ResourceClaim JSON, and a NodePreparer on a simulated node with real files."""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dra_driver.cdi.spec import common_edits
from dra_driver.cdi.store import SpecStore
from dra_driver.node.claim_fetcher import ClaimFetcher
from dra_driver.node.config import API_VERSION
from dra_driver.node.preparer import NodePreparer
from dra_driver.node.records import ClaimRecord, NodeState
from dra_driver.node.store import STORE_FILE, Release, Reserve, open_read_only, open_store
from dra_driver.node.types import ClaimRef
from dra_driver.simulated.gpus import STATE_FILE_NAME, SimulatedBackend
from dra_driver.simulated.mps_daemons import LocalMpsDaemons

DRIVER = "gpu.dra-driver.dev"
NODE = "node-a"


def new_ref(name: str = "claim", namespace: str = "default") -> ClaimRef:
    return ClaimRef(namespace=namespace, name=name, uid=str(uuid.uuid4()))


def result(
    device: str,
    request: str = "gpu",
    *,
    driver: str = DRIVER,
    pool: str = NODE,
    admin_access: bool | None = None,
    share_id: str | None = None,
    consumed: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    entry: dict[str, Any] = {"request": request, "driver": driver, "pool": pool, "device": device}
    if admin_access is not None:
        entry["adminAccess"] = admin_access
    if share_id is not None:
        entry["shareID"] = share_id
    if consumed is not None:
        entry["consumedCapacity"] = dict(consumed)
    return entry


def opaque(
    parameters: Any, *, source: str = "FromClaim", requests: Sequence[str] = (), driver: str = DRIVER
) -> dict[str, Any]:
    entry: dict[str, Any] = {"source": source, "opaque": {"driver": driver, "parameters": parameters}}
    if requests:
        entry["requests"] = list(requests)
    return entry


def gpu_config(sharing: Mapping[str, Any] | None = None) -> dict[str, Any]:
    config: dict[str, Any] = {"apiVersion": API_VERSION, "kind": "GpuConfig"}
    if sharing is not None:
        config["sharing"] = dict(sharing)
    return config


def claim_json(
    ref: ClaimRef,
    results: Sequence[Mapping[str, Any]] | None = None,
    configs: Sequence[Mapping[str, Any]] = (),
    *,
    uid: str | None = None,
) -> dict[str, Any]:
    """A ResourceClaim as the API server returns it; ``results=None``: not allocated."""
    claim: dict[str, Any] = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"namespace": ref.namespace, "name": ref.name, "uid": uid or ref.uid},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu"}}]}},
        "status": {},
    }
    if results is not None:
        claim["status"]["allocation"] = {
            "devices": {"results": [dict(r) for r in results], "config": [dict(c) for c in configs]}
        }
    return claim


class InMemoryClaims:
    """The ResourceClaims the API server would return, by namespace/name (unit tests only)."""

    def __init__(self) -> None:
        self.claims: dict[tuple[str, str], Mapping[str, Any]] = {}
        self.gets = 0

    def put(self, claim: Mapping[str, Any]) -> None:
        meta = claim["metadata"]
        self.claims[(meta["namespace"], meta["name"])] = claim

    async def get(self, namespace: str, name: str) -> Mapping[str, Any] | None:
        self.gets += 1
        return self.claims.get((namespace, name))


@dataclass
class RecordingObserver:
    prepares: list[bool] = field(default_factory=list)
    unprepares: list[bool] = field(default_factory=list)

    def prepare_done(self, seconds: float, ok: bool) -> None:
        assert seconds >= 0
        self.prepares.append(ok)

    def unprepare_done(self, seconds: float, ok: bool) -> None:
        assert seconds >= 0
        self.unprepares.append(ok)


@dataclass
class Node:
    """One simulated node's driver state: files under ``root``."""

    root: Path
    backend: SimulatedBackend
    claims: InMemoryClaims
    observer: RecordingObserver

    @property
    def cdi_dir(self) -> Path:
        return self.root / "cdi"

    @property
    def state_dir(self) -> Path:
        """The plugin's data directory: what the node remembers."""
        return self.root / "state"

    @property
    def store_path(self) -> Path:
        """The node's store (sqlite3)."""
        return self.state_dir / STORE_FILE

    @property
    def checkpoint_path(self) -> Path:
        """Where versions before the store kept their state (schema 2), imported at start."""
        return self.state_dir / "checkpoint.json"

    @property
    def boot_id_path(self) -> Path:
        return self.root / "boot_id"

    @property
    def mps(self) -> LocalMpsDaemons:
        """The node's stand-in MPS control daemons (processes), under ``root/mps``."""
        return LocalMpsDaemons(self.root / "mps", self.root / "sim" / STATE_FILE_NAME)

    def stop_mps_daemons(self) -> None:
        """End every stand-in daemon a test left running."""
        self.mps.stop_all()

    @property
    def specs(self) -> SpecStore:
        return SpecStore(self.cdi_dir, DRIVER)

    def preparer(self, claims: ClaimFetcher | None = None, **options: Any) -> NodePreparer:
        """A plugin instance; call it twice for two instances sharing the node (rolling update).

        ``claims`` replaces the API server stand-in, e.g. with one that fails; ``options`` are
        further NodePreparer arguments, or replace the defaults (e.g. ``inventory``).
        """
        arguments: dict[str, Any] = {
            "driver_name": DRIVER,
            "node_name": NODE,
            "backend": self.backend,
            "inventory": self.backend.inventory,
            "claims": claims or self.claims,
            "specs": self.specs,
            "common_edits": common_edits(self.backend.inventory(), None),
            "store_path": self.store_path,
            "boot_id_path": self.boot_id_path,
            "observer": self.observer,
            "mps": self.mps,
        }
        return NodePreparer(**(arguments | options))

    async def started(self, claims: ClaimFetcher | None = None, **options: Any) -> NodePreparer:
        preparer = self.preparer(claims, **options)
        await preparer.start()
        return preparer

    def on_disk(self) -> NodeState:
        """Every claim the node's store holds, read afresh (empty when there is no store)."""
        if not self.store_path.exists():
            return NodeState()
        store = open_read_only(self.store_path)
        try:
            return store.snapshot()
        finally:
            store.close()

    def write_records(self, claims: Mapping[str, ClaimRecord], boot_id: str | None = None) -> None:
        """Record ``claims`` in the node's store, as a plugin of boot ``boot_id`` (default: this one)."""
        boot = boot_id or self.boot_id_path.read_text().strip()
        store = open_store(self.store_path, boot).store
        try:
            for uid, record in claims.items():
                store.commit(Reserve(uid, record))
        finally:
            store.close()

    def drop_records(self, *uids: str) -> None:
        """Forget claims in the node's store, as a crash between a spec and its record leaves them."""
        store = open_store(self.store_path, self.boot_id_path.read_text().strip()).store
        try:
            for uid in uids:
                store.commit(Release(uid))
        finally:
            store.close()

    def spec_files(self) -> set[str]:
        return {p.name for p in self.cdi_dir.glob("*")} if self.cdi_dir.exists() else set()

    def reboot(self) -> None:
        self.boot_id_path.write_text(str(uuid.uuid4()) + "\n")

    def allocate(
        self, ref: ClaimRef, *devices: str, configs: Sequence[Mapping[str, Any]] = (), **result_options: Any
    ) -> dict[str, Any]:
        claim = claim_json(ref, [result(d, **result_options) for d in devices], configs)
        self.claims.put(claim)
        return claim


def make_node(root: Path) -> Node:
    (root / "boot_id").write_text(str(uuid.uuid4()) + "\n")
    backend = SimulatedBackend("mixed", NODE, root / "sim", boot_id_path=root / "boot_id")
    return Node(root, backend, InMemoryClaims(), RecordingObserver())


def spec_devices(path: Path) -> list[str]:
    return [d["name"] for d in json.loads(path.read_text())["devices"]]
