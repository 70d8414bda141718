"""The tenant's attempts: a user who may create ResourceClaims in a namespace of their own.

Two levels, each as far as this machine runs it:

* **the real API server** (with the chart installed, as for the accounts' attempts): a claim or a
  template asking for admin access in a namespace without the label
  ``resource.kubernetes.io/admin-access``, labelling the namespace to get it, an opaque config over
  the API server's 10 KiB. They are judged as every other attempt (a refusal names who refused);
  the positive control is the same admin-access claim in a namespace an administrator labelled.
* **the node** (:class:`TenantNode`): the tenant's claims are real objects of that API server,
  created with the tenant's token and allocated by the admin as the scheduler would (class configs
  and the tenant's own, shares with their ``shareID`` and consumed capacity); the driver's own
  claim fetcher reads them and its preparer prepares them on a simulated node, with real CDI specs
  and real stand-in MPS control daemons (processes, pipe and shm directories). The tenant then
  does what its containers could: plant symlinks in the directories the CDI spec binds read-write.
  A refusal is a one-line error for that claim alone (or, for a share's strategy, the class's
  strategy kept); each attempt names the neighbour that must stay unaffected, as a positive control.

What this does not reach: the real MPS control daemon. Its control pipe is the one every client
needs, and no GPU runs here, so whether a client speaking that protocol could ``quit`` it is not
tested (docs/security.md says what is). The real node (e2e/real_node/test_nvml_mock.py) checks the
rest in containers: no ``nvidia-cuda-mps-control`` in a client, ``/dev/shm`` a tmpfs of the
configured size that refuses writes past it, symlinks in the client's directories not followed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import tempfile
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubernetes.aio.client import ApiClient, Configuration

from dra_driver.apiserver.bounded_json import MAX_DEPTH
from dra_driver.cdi.spec import common_edits
from dra_driver.cdi.store import SpecStore
from dra_driver.devices.driver_root import find_driver_files
from dra_driver.node.claim_fetcher import ApiServerClaimFetcher
from dra_driver.node.config import API_VERSION
from dra_driver.node.preparer import NodePreparer
from dra_driver.node.types import ClaimError, ClaimRef
from dra_driver.simulated.gpus import STATE_FILE_NAME, SimulatedBackend
from dra_driver.simulated.mps_daemons import LocalMpsDaemons
from e2e.cluster import ApiError, ClusterInfo, JsonObject, RestClient

ACCOUNT = "tenant"  # a ServiceAccount of the tenant's namespace, as a CI job's token would be
ADMIN_LABEL = "resource.kubernetes.io/admin-access"
OPAQUE_LIMIT = 10 * 1024  # bytes: the API server's limit of an opaque config's parameters
GIB = 2**30
# The simulated node (profile dgx-h100): its GPUs, as the tenant's claims are allocated them.
PROFILE = "dgx-h100"
DRIVER_VERSION = "580.95.05"
MPS_CONTROL = "nvidia-cuda-mps-control"


# --- the API server ---------------------------------------------------------------------------------


def rbac(namespace: str, account_namespace: str) -> list[tuple[str, JsonObject]]:
    """What the tenant's account (of `account_namespace`) may do in `namespace`: claims and
    templates, nothing else."""
    rbac_api = f"/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}"
    return [
        (
            f"{rbac_api}/roles",
            {
                "metadata": {"name": "tenant"},
                "rules": [
                    {
                        "apiGroups": ["resource.k8s.io"],
                        "resources": ["resourceclaims", "resourceclaimtemplates"],
                        "verbs": ["create", "get", "list", "delete"],
                    }
                ],
            },
        ),
        (
            f"{rbac_api}/rolebindings",
            {
                "metadata": {"name": "tenant"},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "tenant"},
                "subjects": [{"kind": "ServiceAccount", "name": ACCOUNT, "namespace": account_namespace}],
            },
        ),
    ]


def claim_body(name: str, device_class: str, *, admin: bool = False, config: Any = None) -> JsonObject:
    request: JsonObject = {"name": "gpu", "exactly": {"deviceClassName": device_class}}
    if admin:
        request["exactly"]["adminAccess"] = True
    devices: JsonObject = {"requests": [request]}
    if config is not None:
        devices["config"] = [{"requests": ["gpu"], "opaque": {"driver": device_class, "parameters": config}}]
    return {"metadata": {"name": name}, "spec": {"devices": devices}}


def template_body(name: str, device_class: str) -> JsonObject:
    return {"metadata": {"name": name}, "spec": {"spec": claim_body(name, device_class, admin=True)["spec"]}}


def oversized_config() -> JsonObject:
    """A GpuConfig whose parameters are just over the API server's 10 KiB (an unknown field's padding:
    the API server does not decode opaque parameters, so only their size can refuse them)."""
    config: JsonObject = {"apiVersion": API_VERSION, "kind": "GpuConfig", "padding": ""}
    config["padding"] = "x" * (OPAQUE_LIMIT + 1 - len(json.dumps(config, separators=(",", ":"))))
    return config


@dataclass(frozen=True)
class RawJson:
    """A config as JSON text, sent as it is: deeper than Python's own encoder goes."""

    text: str


def deep_config(depth: int) -> RawJson:
    """A GpuConfig whose ``sharing`` nests `depth` levels in all (lists: 2 bytes a level, so 3,000
    levels stay within the API server's 10 KiB and reach the driver)."""
    lists = depth - 1  # the config object is the first level
    head = json.dumps({"apiVersion": API_VERSION, "kind": "GpuConfig"})[:-1]
    return RawJson(f'{head}, "sharing": {"[" * lists}1{"]" * lists}}}')


_RAW = "@@raw-config@@"


def _encoded(body: JsonObject, config: object) -> JsonObject | bytes:
    """`body` to send: as it is, or, with a :class:`RawJson` config, as text with the config spliced in."""
    if not isinstance(config, RawJson):
        return body
    return json.dumps(body).replace(json.dumps(_RAW), config.text).encode()


# --- the node -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeAttempt:
    kind: str
    what: str
    verdict: str  # refused | succeeded | error
    refuser: str  # "driver" (a one-line error of that claim), "api-server", or what kept it out
    detail: str


@dataclass(frozen=True)
class NodeControl:
    kind: str
    what: str
    ok: bool
    error: str


class TenantNode:
    """A simulated node whose plugin reads the tenant's claims from the real API server."""

    def __init__(
        self,
        cluster: ClusterInfo,
        admin: RestClient,
        root: Path,
        *,
        driver: str,
        node: str,
        namespace: str,
        tenant: RestClient,
    ) -> None:
        self.cluster = cluster
        self.admin = admin
        self.tenant = tenant
        self.root = root
        self.driver = driver
        self.node = node
        self.namespace = namespace
        (root / "boot_id").write_text(f"{uuid.uuid4()}\n")
        self.backend = SimulatedBackend(PROFILE, node, root / "sim", boot_id_path=root / "boot_id")
        self.mps = LocalMpsDaemons(root / "mps", root / "sim" / STATE_FILE_NAME)
        self.specs = SpecStore(root / "cdi", driver)
        self.driver_root = _driver_root(root / "driver-root")

    @contextlib.asynccontextmanager
    async def preparer(self) -> AsyncIterator[NodePreparer]:
        """The node's plugin, reading claims with the admin's token (the plugin's RBAC is not tested
        here), consumable capacity on, its driver files from :func:`_driver_root`."""
        configuration = Configuration(
            host=self.cluster.server,
            api_key={"BearerToken": self.cluster.admin_token},
            api_key_prefix={"BearerToken": "Bearer"},
            ssl_ca_cert=str(self.cluster.ca_file),
        )
        async with ApiClient(configuration) as api:
            inventory = self.backend.inventory()
            files = find_driver_files(self.driver_root, DRIVER_VERSION)
            preparer = NodePreparer(
                driver_name=self.driver,
                node_name=self.node,
                backend=self.backend,
                inventory=self.backend.inventory,
                claims=ApiServerClaimFetcher(api),
                specs=self.specs,
                common_edits=common_edits(inventory, files),
                store_path=self.root / "state" / "store.sqlite3",
                boot_id_path=self.root / "boot_id",
                consumable=True,
                mps=self.mps,
            )
            await preparer.start()
            yield preparer

    def claim(
        self,
        name: str,
        device: str,
        *,
        config: Any = None,
        class_config: Any = None,
        share: str | None = None,
    ) -> ClaimRef:
        """The tenant's claim (its own `config`), allocated `device` as the scheduler would: the
        class's config first; with `share` (a quantity, e.g. 10Gi), as a share of that much memory."""
        parameters = _RAW if isinstance(config, RawJson) else config
        created = self._metadata_only(self.tenant).request(
            "POST",
            f"/apis/resource.k8s.io/v1/namespaces/{self.namespace}/resourceclaims",
            _encoded(claim_body(name, self.driver, config=parameters), config),
        )
        result: JsonObject = {"request": "gpu", "driver": self.driver, "pool": self.node, "device": device}
        if share is not None:
            result["shareID"] = str(uuid.uuid4())
            result["consumedCapacity"] = {"memory": share}
        configs = []
        if class_config is not None:
            configs.append(
                {"source": "FromClass", "opaque": {"driver": self.driver, "parameters": class_config}}
            )
        if config is not None:
            configs.append(
                {
                    "source": "FromClaim",
                    "requests": ["gpu"],
                    "opaque": {"driver": self.driver, "parameters": parameters},
                }
            )
        allocation = {
            "devices": {"results": [result], "config": configs},
            "nodeSelector": {
                "nodeSelectorTerms": [
                    {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [self.node]}]}
                ]
            },
        }
        self._metadata_only(self.admin).request(
            "PATCH",
            f"/apis/resource.k8s.io/v1/namespaces/{self.namespace}/resourceclaims/{name}/status",
            _encoded({"status": {"allocation": allocation}}, config),
            content_type="application/merge-patch+json",
        )
        return ClaimRef(self.namespace, name, created["metadata"]["uid"])

    def _metadata_only(self, client: RestClient) -> RestClient:
        """`client`, answered with the object's metadata only: a deep config would not decode."""
        return client.with_headers({"Accept": "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1"})

    def env(self, ref: ClaimRef) -> dict[str, str]:
        """The variables of the claim's CDI devices (one device per claim here)."""
        spec = json.loads(self.specs.path_for(ref.uid).read_text())
        return {
            k: v
            for d in spec["devices"]
            for k, _, v in (e.partition("=") for e in d["containerEdits"]["env"])
        }

    def mounts(self, ref: ClaimRef) -> list[JsonObject]:
        """Every mount a container of the claim gets: its spec's common edits (the driver's files)
        and its devices' own."""
        spec = json.loads(self.specs.path_for(ref.uid).read_text())
        mounts: list[JsonObject] = spec.get("containerEdits", {}).get("mounts", [])
        return mounts + [m for d in spec["devices"] for m in d["containerEdits"].get("mounts", [])]


def _driver_root(root: Path) -> Path:
    """A driver root with the files a host's has, the MPS control program among them."""
    libraries = root / "usr" / "lib" / "x86_64-linux-gnu"
    binaries = root / "usr" / "bin"
    libraries.mkdir(parents=True, exist_ok=True)
    binaries.mkdir(parents=True, exist_ok=True)
    for name in ("libcuda", "libnvidia-ml"):
        (libraries / f"{name}.so.{DRIVER_VERSION}").write_text(f"{name}\n")
    for name in ("nvidia-smi", MPS_CONTROL, "nvidia-cuda-mps-server"):
        (binaries / name).write_text("#!/bin/sh\n")
        (binaries / name).chmod(0o755)
    return root


def judged(
    kind: str, what: str, outcome: object, *, refused_when: Callable[[], bool] | None = None
) -> NodeAttempt:
    """A prepare's outcome as a verdict: a one-line error of the claim is a refusal; so is a prepared
    claim that `refused_when` says kept what the administrator set (the attempt ignored)."""
    if isinstance(outcome, ClaimError):
        if "\n" in outcome.message or "Traceback" in outcome.message:
            return NodeAttempt(kind, what, "error", "", f"not one line: {outcome.message[:300]}")
        return NodeAttempt(kind, what, "refused", "driver", outcome.message[:300])
    if refused_when is not None and refused_when():
        return NodeAttempt(kind, what, "refused", "driver (ignored)", "prepared as its class says")
    return NodeAttempt(kind, what, "succeeded", "", str(outcome)[:300])


def control(kind: str, what: str, check: Callable[[], object]) -> NodeControl:
    try:
        check()
    except Exception as error:  # any failure of a control is reported as such
        return NodeControl(kind, what, False, f"{type(error).__name__}: {error}")
    return NodeControl(kind, what, True, "")


@contextlib.contextmanager
def tenant_node(
    cluster: ClusterInfo, admin: RestClient, tenant: RestClient, *, driver: str, node: str, namespace: str
) -> Iterator[TenantNode]:
    with tempfile.TemporaryDirectory(prefix="dra-security-node-") as scratch:
        made = TenantNode(
            cluster, admin, Path(scratch), driver=driver, node=node, namespace=namespace, tenant=tenant
        )
        try:
            yield made
        finally:
            made.mps.stop_all()


def run_node(node: TenantNode) -> tuple[list[NodeAttempt], list[NodeControl]]:
    return asyncio.run(_run_node(node))


async def _run_node(node: TenantNode) -> tuple[list[NodeAttempt], list[NodeControl]]:
    attempts: list[NodeAttempt] = []
    controls: list[NodeControl] = []
    async with node.preparer() as preparer:

        async def prepare(*refs: ClaimRef) -> dict[str, object]:
            return dict(await preparer.prepare(list(refs)))

        # --- a share's strategy is its class's --------------------------------------------------------
        kind = "tenant.sharing"
        gpu_config = {"apiVersion": API_VERSION, "kind": "GpuConfig"}
        slicing = gpu_config | {"sharing": {"strategy": "TimeSlicing", "timeSlicing": {"interval": "Long"}}}
        mps = gpu_config | {"sharing": {"strategy": "MPS"}}
        exclusive = gpu_config | {"sharing": {"strategy": "Exclusive"}}
        loose = gpu_config | {
            "sharing": {"strategy": "MPS", "mps": {"defaultPinnedDeviceMemoryLimit": "40Gi"}}
        }

        first = node.claim("sliced-first", "gpu-0", config=slicing, share="10Gi")
        neighbour = node.claim("mps-neighbour", "gpu-0", share="10Gi")
        explicit = node.claim("sliced-vs-mps-class", "gpu-0", config=slicing, class_config=mps, share="10Gi")
        looser = node.claim("looser-limit", "gpu-0", config=loose, share="10Gi")
        whole = node.claim("exclusive-share", "gpu-0", config=exclusive, share="10Gi")
        outcomes = await prepare(first)
        outcomes |= await prepare(neighbour, explicit, looser, whole)
        limited = str(10 * GIB)
        attempts += [
            judged(
                kind,
                "a share asking TimeSlicing where its class says MPS (the default), first on the GPU",
                outcomes[first.uid],
            ),
            judged(kind, "a share asking TimeSlicing where a class config says MPS", outcomes[explicit.uid]),
            judged(
                kind,
                "a share asking MPS with a memory limit above its share (40Gi of 10Gi)",
                outcomes[looser.uid],
            ),
            judged(
                kind,
                "a share asking Exclusive (the whole GPU, no limits)",
                outcomes[whole.uid],
                refused_when=lambda: (
                    node.env(whole).get("DRA_GPU_MPS_PINNED_DEVICE_MEMORY_LIMIT_GPU_0") == limited
                ),
            ),
        ]

        def neighbour_has_its_limits() -> None:
            assert not isinstance(outcomes[neighbour.uid], ClaimError), outcomes[neighbour.uid]
            env = node.env(neighbour)
            assert env["DRA_GPU_SHARING_STRATEGY_GPU_0"] == "MPS", env
            assert env["DRA_GPU_MPS_PINNED_DEVICE_MEMORY_LIMIT_GPU_0"] == limited, env

        controls.append(
            control(kind, "the MPS share beside them prepared, with its limit", neighbour_has_its_limits)
        )

        # The reverse: the class time-slices its GPUs' shares, a tenant asks MPS.
        sliced_neighbour = node.claim("sliced-neighbour", "gpu-1", class_config=slicing, share="10Gi")
        asks_mps = node.claim("mps-vs-sliced-class", "gpu-1", config=mps, class_config=slicing, share="10Gi")
        reverse = await prepare(asks_mps, sliced_neighbour)
        attempts.append(
            judged(kind, "a share asking MPS where its class says TimeSlicing", reverse[asks_mps.uid])
        )

        def sliced_neighbour_time_sliced() -> None:
            assert not isinstance(reverse[sliced_neighbour.uid], ClaimError), reverse[sliced_neighbour.uid]
            env = node.env(sliced_neighbour)
            assert env["DRA_GPU_SHARING_STRATEGY_GPU_1"] == "TimeSlicing", env
            assert env["DRA_GPU_TIME_SLICE_INTERVAL_GPU_1"] == "Long", env

        controls.append(
            control(kind, "the share beside it time-sliced, as its class says", sliced_neighbour_time_sliced)
        )

        # --- the shared MPS daemon, from a client's container ------------------------------------------
        kind = "tenant.mps"
        client_mounts = node.mounts(neighbour)
        daemon = node.mps.paths(next(iter(await node.mps.running())))

        def found(mounted: bool, what: str) -> NodeAttempt:
            verdict = "succeeded" if mounted else "refused"
            return NodeAttempt(kind, what, verdict, "" if mounted else "driver", "")

        attempts += [
            found(
                any(m["containerPath"].endswith(f"/{MPS_CONTROL}") for m in client_mounts),
                f"`echo quit | {MPS_CONTROL}` in a client: the program mounted into it",
            ),
            found(
                any(m["hostPath"].startswith(str(daemon.log)) for m in client_mounts),
                "the daemon's log directory mounted into a client (to plant files the daemon writes)",
            ),
            found(
                any(str(node.specs.path_for("x").parent) in m["hostPath"] for m in client_mounts),
                "the CDI spec directory mounted into a client (to rewrite another claim's spec)",
            ),
        ]
        controls.append(
            control(
                kind,
                "a client gets the daemon's pipe and shm directories, read-write",
                lambda: _assert_binds(client_mounts, {str(daemon.pipe), str(daemon.shm)}),
            )
        )
        controls.append(
            control(
                kind,
                "a client gets the driver's tools from the same driver root (nvidia-smi)",
                lambda: _assert(
                    any(m["containerPath"] == "/usr/bin/nvidia-smi" for m in client_mounts),
                    f"no nvidia-smi among {[m['containerPath'] for m in client_mounts]}",
                ),
            )
        )

        # --- symlinks in every directory a client can write ----------------------------------------
        kind = "tenant.symlinks"
        # Each attempt aims at node files of its own, so that each is judged by what it alone did.
        canaries: dict[str, Path] = {}
        for name, directory in (("pipe", daemon.pipe), ("shm", daemon.shm)):
            canary = _canary(node.root / f"node-files-{name}")
            (directory / "to-node-dir").symlink_to(canary)
            (directory / "to-node-file").symlink_to(canary / "keep")
            what = f"symlinks in the daemon's {name} directory to a node directory and a node file"
            canaries[f"{what}, the daemon stopped and its directories removed"] = canary
        # The stand-in removes its control pipe when it stops, as the real daemon does.
        canary = _canary(node.root / "node-files-control")
        (daemon.pipe / "control").unlink()
        (daemon.pipe / "control").symlink_to(canary / "keep")
        canaries["the control pipe replaced by a symlink to a node file, the daemon stopped"] = canary
        # Every share of the GPU leaves: the daemon stops and its directories go.
        await preparer.unprepare([neighbour, whole])
        gone = not daemon.root.exists()
        for what, canary in canaries.items():
            left = sorted(os.listdir(canary))
            keep = canary / "keep"
            intact = left == ["keep"] and keep.is_file() and keep.read_text() == _KEPT
            attempts.append(
                NodeAttempt(
                    kind,
                    what,
                    "refused" if intact else "succeeded",
                    "driver" if intact else "",
                    "" if intact else f"the node's files now: {left}",
                )
            )
        controls.append(
            control(
                kind,
                "the daemon stopped and its directories removed all the same",
                lambda: _assert(gone, f"{daemon.root} is left"),
            )
        )

        # --- configs too deep for the driver (within the API server's size limit) ----------------------
        kind = "tenant.configs"
        deep_refs = {}
        for depth in (MAX_DEPTH + 1, 3000):
            try:
                deep_refs[depth] = node.claim(f"deep-{depth}", "gpu-3", config=deep_config(depth))
            except ApiError as error:
                attempts.append(
                    NodeAttempt(
                        kind, f"a config {depth} levels deep", "refused", "api-server", error.message[:300]
                    )
                )
        plain = node.claim("beside-the-deep-ones", "gpu-4")
        deep = await prepare(*deep_refs.values(), plain)
        for depth, ref in deep_refs.items():
            attempt = judged(
                kind, f"a config {depth} levels deep (the driver decodes {MAX_DEPTH})", deep[ref.uid]
            )
            if attempt.verdict == "refused" and f"deeper than {MAX_DEPTH} levels" not in attempt.detail:
                attempt = NodeAttempt(
                    kind, attempt.what, "error", "", f"refused without naming the limit: {attempt.detail}"
                )
            attempts.append(attempt)
        controls.append(
            control(
                kind,
                "a claim prepared in the same call as the deep ones",
                lambda: _assert(not isinstance(deep[plain.uid], ClaimError), str(deep[plain.uid])),
            )
        )
    return attempts, controls


_KEPT = "the node's\n"


def _canary(directory: Path) -> Path:
    """A directory of the node's with one file, for a tenant's links to aim at."""
    directory.mkdir()
    (directory / "keep").write_text(_KEPT)
    return directory


def _assert(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


def _assert_binds(mounts: list[JsonObject], wanted: set[str]) -> None:
    bound = {m["hostPath"] for m in mounts if "rw" in m.get("options", [])}
    _assert(wanted <= bound, f"read-write binds {sorted(bound)}, wanted {sorted(wanted)}")


def as_records(attempts: list[NodeAttempt]) -> list[JsonObject]:
    """The node's attempts in the suite's report format (one verdict each, by the node)."""
    return [
        {
            "kind": a.kind,
            "identity": "tenant@node",
            "what": a.what,
            "verdicts": {"node": a.verdict},
            "refusers": {"node": a.refuser} if a.verdict == "refused" else {},
            "wrong_refuser": False,
            "details": {"node": a.detail} if a.verdict != "refused" else {},
        }
        for a in attempts
    ]
