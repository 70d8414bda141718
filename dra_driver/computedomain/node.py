"""The node side of ComputeDomains: the second driver's devices and its prepare/unprepare.

A node on an NVLink clique publishes, under the driver ``compute-domain.<domain>``, the two devices
NVIDIA's compute-domain plugin publishes: ``channel-0`` (IMEX channel 0, what a workload pod gets)
and ``daemon-0`` (what the domain's IMEX daemon pod gets), both with the node's clique as the
attribute ``cliqueID``. Each is one device per node, so the scheduler never gives one node's channel
to two domains, and one node never runs two domains' daemons.

Prepare, for a **channel** claim: check the domain exists in the claim's namespace and has room for
this node, label the node with the domain's UID (the label the domain's IMEX DaemonSet selects, so
the daemon starts here), and succeed only once that daemon reports Ready in the domain's status:
until then the kubelet retries and the pod waits, as with NVIDIA's driver. The CDI spec gives the
container ``/dev/nvidia-caps-imex-channels/channel0`` (all channels for allocationMode All).

With **binding conditions** on (Kubernetes 1.36+, :mod:`dra_driver.node.binding`) the channel says
``bindingConditions: [Ready]``: the scheduler holds the workload pod in binding, and the node does
the channel's prepare ahead (:meth:`ComputeDomainPreparer.prepare_ahead`) -- label, then poll the
domain every second until the daemon is Ready -- and answers Ready, or PrepareFailed when the daemon
keeps failing, is not ready in time, or the domain goes; the scheduler then places the pod again, with
the reason in its events, instead of a pod stuck on the node. The record says ``PreparingAhead`` and
``PreparedAhead`` meanwhile; the kubelet's prepare takes the latter over, and the watcher undoes a
claim whose pod never comes.

In the **host-managed IMEX mode** (NVIDIA's ``HostManagedIMEXDaemon``) the host runs ``nvidia-imex``
itself: the node publishes only ``channel-0``, labels nothing, refuses daemon claims, and a channel
claim gets channel 0 once the host's daemon answers READY (:mod:`dra_driver.devices.host_imex`);
until then prepare fails with the check's reason and the kubelet retries.

For a **daemon** claim: write the daemon's configuration directory (``imexd.cfg`` and
``nodes_config.cfg``, the IP addresses of the domain's nodes on this clique known so far, which a
daemon with DNS names replaces by its fixed names when it starts) and mount it into the daemon's
container at ``/imexd``, with the domain's identity as environment variables.

Each claim is a row of the node's store (``domain_claims``, :mod:`dra_driver.node.store`), written
*before* the node is labelled or the daemon's files are written, so that unprepare -- after a crash
or a restart too -- knows to remove the label or the directory again. The row holds the claim's
device: a unique index refuses a second claim of the node's one channel (or daemon) device while
the first is recorded, waiting for its daemon included, as NVIDIA's driver refuses a second claim of
channel 0 whatever its allocationMode. Each step is one short transaction, never across an API
call: record the claim, label the node, write the spec, mark the record prepared; on unprepare,
remove the label (or directory) and the spec, then the row.

**At start** (:meth:`ComputeDomainPreparer.start`): the files of earlier versions (one JSON file per
claim under ``claims/``) are imported into the store once and moved aside (``claims.imported``);
after a reboot the claims' specs and configuration directories are removed (nothing prepared
survives one); otherwise a CDI spec of this driver with no row is a claim the store lost (deleted,
corrupt), rebuilt from the spec as the GPUs' are (:mod:`dra_driver.node.recovery`): its device from
the spec's device name, a daemon's domain from its ``COMPUTE_DOMAIN_UUID``. A channel's spec does not
name its domain; none is needed, because the node's label can only be that claim's (one channel
device), so its unprepare removes the label whichever domain it names. A channel claim still
*waiting* for its daemon has no spec yet and is lost with the store: an unprepare of a claim with no
row removes a label no recorded channel claim explains. A daemon directory no row names is left from
such a prepare, and removed.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import structlog

from dra_driver.cdi.spec import CdiDevice, CommonEdits, Mount, cdi_device_id, claim_spec
from dra_driver.cdi.store import SpecStore
from dra_driver.computedomain.api import (
    CHANNEL_TYPE,
    CLIQUE_ATTRIBUTE,
    DAEMON_TYPE,
    ChannelAllocationMode,
    ChannelConfig,
    ComputeDomain,
    DaemonConfig,
    DomainStatus,
    Names,
    daemon_failure,
    parse_config,
)
from dra_driver.devices.host_imex import HostImex
from dra_driver.devices.types import DeviceNode
from dra_driver.node.claim_fetcher import ClaimFetcher
from dra_driver.node.claims import AllocationResult, ClaimRejected, allocated_claim, check_ref
from dra_driver.node.records import MutationRejected, Phase
from dra_driver.node.recovery import CONFLICT_ADVICE, Conflict
from dra_driver.node.store import DomainClaim, DomainPhase, Store
from dra_driver.node.types import ClaimError, ClaimRef, PreparedDevice, PrepareOutcome
from dra_driver.resources.devices import FAILED_CONDITION, READY_CONDITION
from dra_driver.resources.slices import SliceContent
from dra_driver.resources.wire import Device

log = structlog.get_logger(__name__)

CHANNEL_DEVICE = "channel-0"
DAEMON_DEVICE = "daemon-0"
CHANNEL_DIR = "/dev/nvidia-caps-imex-channels"
# The driver's default NVreg_ImexChannelCount: channels 0..2047 exist.
MAX_CHANNELS = 2048
DAEMON_CONFIG_DIR = "/imexd"  # where the daemon container finds its configuration
IMEX_SERVER_PORT = 50000  # IMEX's default peer port (SERVER_PORT)
NODES_CONFIG = "nodes_config.cfg"
DAEMON_CONFIG = "imexd.cfg"
# A channel prepared ahead of binding (ComputeDomainPreparer.prepare_ahead): how often the domain is
# read while its daemon starts; how long a failing daemon is given to recover; how long the wait
# lasts at most (the controller's default daemonReadyTimeoutSeconds, and well within the
# scheduler's 10-minute bindingTimeout, so the pod goes back to the scheduler with the reason).
AHEAD_POLL_S = 1.0
DAEMON_FAILURE_GRACE_S = 60.0
DAEMON_READY_TIMEOUT_S = 300.0
AHEAD_PHASES = ("PreparingAhead", "PreparedAhead")


def compute_domain_slices(
    clique: str, *, daemon: bool = True, binding_conditions: bool = False
) -> list[SliceContent]:
    """The node's pool for the compute-domain driver: one channel and one daemon device.

    Without the daemon device (``daemon=False``) in the host-managed IMEX mode, as NVIDIA's plugin
    publishes it: the host runs the IMEX daemon, so no daemon pod's claim can be allocated here.
    With ``binding_conditions`` (KEP-5007, :mod:`dra_driver.node.binding`) the channel says
    ``bindingConditions: [Ready]`` and ``bindingFailureConditions: [PrepareFailed]``: the scheduler
    binds a workload pod only once this node's IMEX daemon for its domain is Ready
    (:meth:`ComputeDomainPreparer.prepare_ahead`), and schedules it again if the daemon fails. The
    daemon device has none: its pod is what the channel waits for.
    """

    def device(name: str, kind: str) -> Device:
        return {
            "name": name,
            "attributes": {
                "type": {"string": kind},
                "id": {"int": 0},
                CLIQUE_ATTRIBUTE: {"string": clique},
            },
            "capacity": {},
        }

    channel = device(CHANNEL_DEVICE, CHANNEL_TYPE)
    if binding_conditions:
        channel["bindingConditions"] = [READY_CONDITION]
        channel["bindingFailureConditions"] = [FAILED_CONDITION]
    devices = [channel]
    if daemon:
        devices.append(device(DAEMON_DEVICE, DAEMON_TYPE))
    return [SliceContent(devices=tuple(devices))]


def channel_node(channel: int, major: int) -> DeviceNode:
    return DeviceNode(f"{CHANNEL_DIR}/channel{channel}", major, channel)


def nodes_config(domain: ComputeDomain, clique: str) -> str:
    """``nodes_config.cfg``: one IP address per line, the domain's daemons on ``clique``, by index."""
    members = sorted(
        (node for node in domain.status.nodes if node.clique_id == clique and node.ip_address),
        key=lambda node: (node.index, node.name),
    )
    return "".join(f"{node.ip_address}\n" for node in members)


def daemon_config_text(server_port: int) -> str:
    """The part of ``nvidia-imex``'s configuration file the driver decides (the rest are defaults)."""
    return (
        "# Written by the DRA driver for this ComputeDomain's IMEX daemon.\n"
        "LOG_FILE_NAME=\n"
        "DAEMONIZE=0\n"
        f"SERVER_PORT={server_port}\n"
        f"IMEX_NODE_CONFIG_FILE={DAEMON_CONFIG_DIR}/{NODES_CONFIG}\n"
        "IMEX_WAIT_FOR_QUORUM=RECOVERY\n"
        "IMEX_CMD_ENABLED=1\n"
        "IMEX_CMD_PORT=50005\n"
    )


class Domains(Protocol):
    """What the preparer needs of the API server."""

    async def by_uid(self, uid: str) -> ComputeDomain | None: ...
    async def member_nodes(self, uid: str) -> set[str]: ...
    async def label_node(self, uid: str) -> str | None:
        """Label this node with the domain; returns the other domain's UID if it holds the label."""
        ...

    async def unlabel_node(self, uid: str | None) -> None:
        """Remove this node's label if it names ``uid`` (None: whichever domain it names)."""
        ...


class ComputeDomainPreparer:
    """:class:`~dra_driver.node.types.ClaimPreparer` of the compute-domain driver on one node."""

    def __init__(
        self,
        *,
        names: Names,
        node_name: str,
        clique: str,
        claims: ClaimFetcher,
        domains: Domains,
        specs: SpecStore,
        store: Store,
        state_dir: Path,
        channel_major: int,
        server_port: int = IMEX_SERVER_PORT,
        host_imex: HostImex | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        poll_s: float = AHEAD_POLL_S,
        daemon_failure_grace_s: float = DAEMON_FAILURE_GRACE_S,
        daemon_ready_timeout_s: float = DAEMON_READY_TIMEOUT_S,
    ) -> None:
        self._names = names
        self._node = node_name
        self._clique = clique
        self._claims = claims
        self._domains = domains
        self._specs = specs
        self._store = store
        self._legacy_records = state_dir / "claims"  # one JSON file per claim, before the store
        self._configs = state_dir / "domains"
        self._channel_major = channel_major
        self._server_port = server_port
        self._host_imex = host_imex  # set: the host-managed IMEX mode (see the module doc)
        self._locks: dict[str, asyncio.Lock] = {}
        self._clock = clock
        self._sleep = sleep  # the wait for a channel's daemon ahead of binding polls (no event to await)
        self._poll_s = poll_s
        self._daemon_failure_grace_s = daemon_failure_grace_s
        self._daemon_ready_timeout_s = daemon_ready_timeout_s
        # Claims the start rebuilt (from their specs, or the earlier version's files) that the
        # store refused: the plugin posts each as a Node Event, as the GPU driver's start does.
        self.recovery_conflicts: list[Conflict] = []

    async def prepare(self, claims: Sequence[ClaimRef]) -> dict[str, PrepareOutcome]:
        results = await asyncio.gather(*(self._prepare_one(ref) for ref in claims))
        return {ref.uid: outcome for ref, outcome in zip(claims, results, strict=True)}

    async def unprepare(self, claims: Sequence[ClaimRef]) -> dict[str, ClaimError | None]:
        results = await asyncio.gather(*(self._unprepare_one(ref) for ref in claims))
        return {ref.uid: outcome for ref, outcome in zip(claims, results, strict=True)}

    def prepared_claim_uids(self) -> set[str]:
        """The claims the store records, those still waiting for their daemon included."""
        return {claim.uid for claim in self._store.domain_claims()}

    # --- start ---------------------------------------------------------------------------------------

    def start(self, boot_id: str) -> None:
        """Bring the store up to date with the node (see the module doc); blocking, before serving."""
        self._specs.remove_leftover_temps()
        imported = self._read_legacy_records()
        earlier, refused = self._store.start_domain_claims(boot_id, imported)
        self.recovery_conflicts = [_conflict(claim.uid, error) for claim, error in refused]
        if earlier:
            for uid in self._specs.claim_uids():
                self._specs.remove(uid)
            shutil.rmtree(self._configs, ignore_errors=True)
            log.info("cleared the compute-domain claims of an earlier boot")
        else:
            self._recover_from_specs()
        if self._legacy_records.exists():
            self._legacy_records.replace(self._legacy_records.with_name("claims.imported"))
            log.info("imported the compute-domain claims of the earlier version", claims=len(imported))
        # The directories first: the other instance of a rolling update records a daemon claim
        # before it writes its directory, so one found here has its row by the time they are read.
        directories = list(self._configs.glob("*")) if self._configs.is_dir() else []
        named = {c.domain_uid for c in self._store.domain_claims() if c.kind == DAEMON_TYPE}
        for directory in directories:
            if directory.name not in named:
                shutil.rmtree(directory, ignore_errors=True)

    def _read_legacy_records(self) -> list[DomainClaim]:
        """The earlier version's ``claims/<uid>.json`` files (``{"kind", "domainUID"}``)."""
        found = []
        for path in sorted(self._legacy_records.glob("*.json")) if self._legacy_records.is_dir() else ():
            try:
                data = json.loads(path.read_text())
                kind, domain_uid = str(data["kind"]), str(data["domainUID"])
                if kind not in (CHANNEL_TYPE, DAEMON_TYPE):
                    raise ValueError(f"unknown kind {kind!r}")
            except (OSError, ValueError, TypeError, KeyError) as error:
                log.warning(
                    "skipping an unreadable compute-domain claim record", file=str(path), error=str(error)
                )
                continue
            # A claim with its spec was prepared; one without was waiting for its daemon.
            phase: Phase = (
                "PrepareCompleted" if self._specs.path_for(path.stem).exists() else "PrepareStarted"
            )
            device = CHANNEL_DEVICE if kind == CHANNEL_TYPE else DAEMON_DEVICE
            found.append(DomainClaim(path.stem, "", "", kind, device, domain_uid, phase=phase))
        return found

    def _recover_from_specs(self) -> None:
        """Rebuild the row of each spec of ours the store lacks, oldest uid first, through the checks."""
        recorded = {claim.uid for claim in self._store.domain_claims()}
        for uid in sorted(self._specs.claim_uids() - recorded):
            if self._specs.held_by_a_writer(uid):
                continue  # the other instance of a rolling update is preparing it
            try:
                claim = _claim_of_spec(uid, self._specs.read(uid))
            except ValueError as error:
                log.warning("removing an unreadable compute-domain spec", claim_uid=uid, error=str(error))
                self._specs.remove(uid)
                continue
            if claim is None:
                continue
            try:
                self._store.reserve_domain_claim(claim)
            except MutationRejected as error:
                self.recovery_conflicts.append(_conflict(uid, error))
                continue
            log.info("rebuilt a compute-domain claim from its CDI spec", claim_uid=uid, device=claim.device)

    # --- one claim -----------------------------------------------------------------------------------

    async def _prepare_one(self, ref: ClaimRef) -> PrepareOutcome:
        try:
            check_ref(ref)
            async with self._lock(ref.uid):
                return await self._prepare(ref)
        except (ClaimRejected, ValueError) as error:
            return ClaimError(str(error))
        except Exception as error:  # the API server unreachable: the kubelet retries
            log.warning("preparing a compute-domain claim failed", claim=str(ref), error=str(error))
            return ClaimError(f"preparing claim {ref} failed: {error}")

    async def _prepare(self, ref: ClaimRef) -> PrepareOutcome:
        result, config = await self._allocated(ref)
        if self._prepared_before(ref, result.device, config.domain_id):
            # The kubelet's repeat (it restarted, or lost our answer), or a channel prepared ahead of
            # binding: what was done stands, and the record is not written again (a crash then would
            # leave it half-done).
            return (self._prepared(ref, result),)
        domain = await self._domain(ref, config)
        kind = CHANNEL_TYPE if isinstance(config, ChannelConfig) else DAEMON_TYPE
        if result.device != (CHANNEL_DEVICE if kind == CHANNEL_TYPE else DAEMON_DEVICE):
            raise ClaimRejected(f"claim {ref}: a {kind} config for device {result.device}")
        record = DomainClaim(
            ref.uid,
            ref.namespace,
            ref.name,
            kind,
            result.device,
            domain.metadata.uid,
            config.allocation_mode.value if isinstance(config, ChannelConfig) else None,
            attempt=secrets.token_hex(8),
        )
        if isinstance(config, ChannelConfig) and self._host_imex is not None:
            cdi = await self._prepare_host_managed_channel(ref, domain, record, self._host_imex)
        elif isinstance(config, ChannelConfig):
            cdi = await self._prepare_channel(ref, domain, config, record)
        elif self._host_imex is not None:
            raise ClaimRejected(
                f"claim {ref}: ComputeDomain daemon claims are not supported in the host-managed IMEX "
                "mode (the host runs nvidia-imex; this node publishes no daemon device)"
            )
        else:
            cdi = await self._prepare_daemon(ref, domain, record)
        self._complete(ref, record.attempt, "PrepareCompleted")
        return (self._prepared(ref, result, cdi),)

    async def _allocated(self, ref: ClaimRef) -> tuple[AllocationResult, ChannelConfig | DaemonConfig]:
        """The claim's one device of this driver and its config, checked."""
        claim = await self._claims.get(ref.namespace, ref.name)
        if claim is None:
            raise ClaimRejected(f"claim {ref} no longer exists")
        allocated = allocated_claim(ref, claim, self._names.driver, self._node)
        if len(allocated.results) != 1:
            raise ClaimRejected(
                f"claim {ref} has {len(allocated.results)} devices of {self._names.driver}; "
                "a ComputeDomain claim has exactly one"
            )
        result = allocated.results[0]
        return result, self._config_of(ref, result.device, [c.parameters for c in allocated.configs])

    async def _domain(self, ref: ClaimRef, config: ChannelConfig | DaemonConfig) -> ComputeDomain:
        domain = await self._domains.by_uid(config.domain_id)
        if domain is None:
            raise ClaimRejected(
                f"claim {ref} belongs to ComputeDomain {config.domain_id}, which does not exist (any more)"
            )
        return domain

    def _prepared(self, ref: ClaimRef, result: AllocationResult, cdi: str | None = None) -> PreparedDevice:
        return PreparedDevice(
            requests=(result.parent_request,),
            pool=self._node,
            device=result.device,
            cdi_device_ids=(cdi or cdi_device_id(self._names.driver, ref.uid, result.device),),
        )

    def _complete(self, ref: ClaimRef, attempt: str, phase: DomainPhase) -> None:
        try:
            self._store.complete_domain_claim(ref.uid, attempt, phase)
        except MutationRejected as taken:
            raise ClaimRejected(str(taken)) from None

    def _prepared_before(self, ref: ClaimRef, device: str, domain_uid: str, *, ahead: bool = False) -> bool:
        """Whether the claim is prepared already: by an earlier prepare, or ahead of its pod's binding.

        A channel prepared ahead is the kubelet's from its prepare on (the pod is bound): its record
        becomes PrepareCompleted, so that the binding watcher no longer undoes it.
        """
        record = self._store.domain_claim(ref.uid)
        if (
            record is None
            or record.phase not in ("PrepareCompleted", "PreparedAhead")
            or (record.device, record.domain_uid) != (device, domain_uid)
            or not self._specs.path_for(ref.uid).exists()
        ):
            return False
        if record.phase == "PreparedAhead" and not ahead:
            self._complete(ref, record.attempt, "PrepareCompleted")
            log.info("channel prepared ahead of binding; the kubelet takes it over", claim=str(ref))
        return True

    # --- ahead of binding (binding conditions, dra_driver.node.binding) ------------------------------

    async def prepare_ahead(self, ref: ClaimRef) -> tuple[PreparedDevice, ...] | ClaimError:
        """Prepare a channel claim before its pod is bound: the binding watcher's call.

        What the kubelet's prepare does, done as soon as the scheduler allocates the channel, which
        holds the pod in binding meanwhile: record the claim (PreparingAhead), label the node (the
        domain's DaemonSet then starts its IMEX daemon here), wait until that daemon is Ready in the
        domain's status, write the CDI spec and record the claim PreparedAhead, which the kubelet's
        prepare takes over once the pod is bound. The wait fails when the daemon keeps failing
        (``daemon_failure_grace_s``), is not Ready in time (``daemon_ready_timeout_s``, shorter
        than the scheduler's bindingTimeout, so the pod goes back with a reason rather than a
        timeout), or the domain goes; a failure undoes what was done, since the scheduler then
        schedules the pod again, maybe elsewhere. The claim's lock is not held while it waits.
        """
        record: DomainClaim | None = None
        try:
            check_ref(ref)
            async with self._lock(ref.uid):
                result, config = await self._allocated(ref)
                if self._prepared_before(ref, result.device, config.domain_id, ahead=True):
                    return (self._prepared(ref, result),)  # its answer was not written: again
                if not isinstance(config, ChannelConfig) or result.device != CHANNEL_DEVICE:
                    raise ClaimRejected(f"claim {ref}: only a ComputeDomain's channel is prepared ahead")
                if self._host_imex is not None:  # publishes no binding conditions (module doc)
                    raise ClaimRejected(f"claim {ref}: the host-managed IMEX mode prepares nothing ahead")
                domain = await self._domain(ref, config)
                what = self._check_channel(ref, domain, await self._domains.member_nodes(domain.metadata.uid))
                record = DomainClaim(
                    ref.uid,
                    ref.namespace,
                    ref.name,
                    CHANNEL_TYPE,
                    CHANNEL_DEVICE,
                    domain.metadata.uid,
                    config.allocation_mode.value,
                    phase="PreparingAhead",
                    attempt=secrets.token_hex(8),
                )
                await self._reserve_and_label(record)
            await self._until_daemon_ready(ref, record.domain_uid, what)
            async with self._lock(ref.uid):
                cdi = await self._write_channel_spec(ref.uid, config)
                self._complete(ref, record.attempt, "PreparedAhead")
            log.info("channel prepared ahead of binding: the node's IMEX daemon is ready", claim=str(ref))
            return (self._prepared(ref, result, cdi),)
        except (ClaimRejected, ValueError) as error:
            failure = ClaimError(str(error))
        except Exception as error:
            log.warning("preparing a channel ahead of binding failed", claim=str(ref), error=str(error))
            failure = ClaimError(f"preparing claim {ref} ahead of binding failed: {error}")
        if record is not None:
            await self._undo_ahead(ref, record.attempt)
        return failure

    def ahead_of_binding(self) -> dict[str, DomainClaim]:
        """The channels prepared (or being prepared) ahead of binding that the kubelet has not asked for."""
        return {c.uid: c for c in self._store.domain_claims() if c.phase in AHEAD_PHASES}

    def prepared_ahead(self, uid: str) -> DomainClaim | None:
        """``uid``'s record if it is being prepared or was prepared ahead, and the kubelet has not asked."""
        record = self._store.domain_claim(uid)
        return record if record is not None and record.phase in AHEAD_PHASES else None

    async def _until_daemon_ready(self, ref: ClaimRef, domain_uid: str, what: str) -> None:
        """Poll the domain until this node's IMEX daemon is Ready; :class:`ClaimRejected` says why not.

        A daemon that fails is given ``daemon_failure_grace_s`` to recover (its wrapper restarts a
        crashed IMEX part every few seconds; a moment's trouble is not a reason to reschedule). An
        API error is one more poll: the timeout bounds the wait.
        """
        started = self._clock()
        failing_since: float | None = None
        state = "not started"
        while True:
            try:
                domain = await self._domains.by_uid(domain_uid)
            except Exception as error:
                log.warning(
                    "reading the ComputeDomain failed; reading it again", claim=str(ref), error=str(error)
                )
            else:
                if domain is None:
                    raise ClaimRejected(f"{what} no longer exists; claim {ref} cannot get its channel")
                _channel_domain(ref, domain)  # not being deleted meanwhile
                state = self._daemon_state(domain)
                if state == DomainStatus.READY:
                    return
                failure = daemon_failure(domain, self._node)
                now = self._clock()
                if failure is None:
                    failing_since = None
                elif failing_since is None:
                    failing_since = now
                elif now - failing_since >= self._daemon_failure_grace_s:
                    raise ClaimRejected(
                        f"the IMEX daemon of {what} on node {self._node} failed for "
                        f"{self._daemon_failure_grace_s:.0f}s: {failure}"
                    )
            if self._clock() - started >= self._daemon_ready_timeout_s:
                raise ClaimRejected(
                    f"the IMEX daemon of {what} on node {self._node} was not ready within "
                    f"{self._daemon_ready_timeout_s:.0f}s ({state})"
                )
            await self._sleep(self._poll_s)

    async def _undo_ahead(self, ref: ClaimRef, attempt: str) -> None:
        """Undo a failed prepare ahead (the node leaves the domain: its daemon goes with the label),
        unless another attempt took the record over meanwhile. What cannot be undone now is left to
        the binding watcher, which undoes a claim prepared ahead once its allocation is gone."""
        try:
            async with self._lock(ref.uid):
                record = self._store.domain_claim(ref.uid)
                if record is None or record.attempt != attempt:
                    return
                await self._domains.unlabel_node(record.domain_uid or None)
                await asyncio.to_thread(self._specs.remove, ref.uid)
                self._store.release_domain_claim(ref.uid)
        except Exception as error:
            log.warning("undoing a channel prepared ahead failed", claim=str(ref), error=str(error))

    def _config_of(self, ref: ClaimRef, device: str, parameters: list[Any]) -> ChannelConfig | DaemonConfig:
        if not parameters:
            raise ClaimRejected(
                f"claim {ref} asks for {device} of {self._names.driver} outside a ComputeDomain: it "
                "carries no ComputeDomainChannelConfig. Create a ComputeDomain "
                f"({self._names.api_version}) and use the ResourceClaimTemplate named in its "
                "spec.channel.resourceClaimTemplate.name"
            )
        return parse_config(parameters[-1], self._names)  # a later config overrides an earlier one

    def _reserve(self, record: DomainClaim) -> None:
        try:
            self._store.reserve_domain_claim(record)
        except MutationRejected as held:
            raise ClaimRejected(str(held)) from None

    async def _prepare_channel(
        self, ref: ClaimRef, domain: ComputeDomain, config: ChannelConfig, record: DomainClaim
    ) -> str:
        what = self._check_channel(ref, domain, await self._domains.member_nodes(domain.metadata.uid))
        await self._reserve_and_label(record)
        state = self._daemon_state(domain)
        if state != DomainStatus.READY:
            raise ClaimRejected(
                f"waiting for the IMEX daemon of {what} on node {self._node} to become ready ({state})"
            )
        return await self._write_channel_spec(ref.uid, config)

    def _daemon_state(self, domain: ComputeDomain) -> str:
        """This node's IMEX daemon of ``domain`` as the domain's status has it: Ready, NotReady, or
        "not started" while the status does not list the node yet."""
        mine = next((n for n in domain.status.nodes if n.name == self._node), None)
        return mine.status.value if mine else "not started"

    def _check_channel(self, ref: ClaimRef, domain: ComputeDomain, members: set[str]) -> str:
        """Whether this node may serve ``domain``'s channel to ``ref``; the domain as messages name it."""
        what = _channel_domain(ref, domain)
        wanted = domain.spec.num_nodes
        if self._node not in members and wanted and len(members) >= wanted:
            raise ClaimRejected(
                f"{what} already has its {wanted} node(s) ({', '.join(sorted(members))}); "
                f"node {self._node} waits until one of them leaves"
            )
        return what

    async def _reserve_and_label(self, record: DomainClaim) -> None:
        self._reserve(record)  # before the label: an unprepare, also after a crash, removes it
        other = await self._domains.label_node(record.domain_uid)
        if other is not None:
            raise ClaimRejected(
                f"node {self._node} already serves ComputeDomain {other}; one domain per node"
            )

    async def _write_channel_spec(self, claim_uid: str, config: ChannelConfig) -> str:
        count = MAX_CHANNELS if config.allocation_mode is ChannelAllocationMode.ALL else 1
        nodes = tuple(channel_node(i, self._channel_major) for i in range(count))
        return await self._write_spec(claim_uid, CdiDevice(name=CHANNEL_DEVICE, device_nodes=nodes), ())

    async def _prepare_host_managed_channel(
        self, ref: ClaimRef, domain: ComputeDomain, record: DomainClaim, host_imex: HostImex
    ) -> str:
        """A channel in the host-managed IMEX mode: channel 0 once the host's own daemon is ready.

        No node label and no daemon to wait for: the host's nvidia-imex serves every domain on this
        node. Its readiness is asked on every prepare, before anything is recorded, so a claim
        refused here leaves nothing behind and the kubelet's retry asks again. Channel 0 only,
        whatever the allocationMode, as NVIDIA's plugin does in this mode (the host's IMEX domain
        has that one channel to give; the controller's template asks for Single).
        """
        _channel_domain(ref, domain)
        reason = await asyncio.to_thread(host_imex.not_ready)
        if reason is not None:
            raise ClaimRejected(
                f"host nvidia-imex daemon readiness check failed on node {self._node}: {reason}"
            )
        self._reserve(record)
        device = CdiDevice(name=CHANNEL_DEVICE, device_nodes=(channel_node(0, self._channel_major),))
        return await self._write_spec(ref.uid, device, ())

    async def _prepare_daemon(self, ref: ClaimRef, domain: ComputeDomain, record: DomainClaim) -> str:
        meta = domain.metadata
        directory = self._configs / meta.uid
        self._reserve(record)  # before the files: an unprepare, also after a crash, removes them
        await asyncio.to_thread(self._write_daemon_files, directory, domain)
        env = (
            ("CLIQUE_ID", self._clique),
            ("COMPUTE_DOMAIN_UUID", meta.uid),
            ("COMPUTE_DOMAIN_NAME", meta.name),
            ("COMPUTE_DOMAIN_NAMESPACE", meta.namespace),
            ("COMPUTE_DOMAIN_NUM_NODES", str(domain.spec.num_nodes)),
        )
        device = CdiDevice(name=DAEMON_DEVICE, device_nodes=(), env=env)
        mount = Mount(str(directory), DAEMON_CONFIG_DIR, ("rw", "nosuid", "nodev", "bind"))
        return await self._write_spec(ref.uid, device, (mount,))

    def _write_daemon_files(self, directory: Path, domain: ComputeDomain) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        _write_atomically(directory / DAEMON_CONFIG, daemon_config_text(self._server_port))
        _write_atomically(directory / NODES_CONFIG, nodes_config(domain, self._clique))

    async def _write_spec(self, claim_uid: str, device: CdiDevice, mounts: tuple[Mount, ...]) -> str:
        spec = claim_spec(self._names.driver, claim_uid, [device], CommonEdits((), mounts, ()))
        await asyncio.to_thread(self._specs.write, claim_uid, spec)
        return cdi_device_id(self._names.driver, claim_uid, device.name)

    async def _unprepare_one(self, ref: ClaimRef) -> ClaimError | None:
        try:
            async with self._lock(ref.uid):
                record = self._store.domain_claim(ref.uid)
                if self._host_imex is not None:
                    pass  # no label and no daemon directory in the host-managed IMEX mode
                elif record is None:
                    await self._unlabel_if_unexplained()
                elif record.kind == CHANNEL_TYPE:
                    await self._domains.unlabel_node(record.domain_uid or None)
                elif record.domain_uid:  # a daemon's
                    await asyncio.to_thread(shutil.rmtree, self._configs / record.domain_uid, True)
                await asyncio.to_thread(self._specs.remove, ref.uid)
                self._store.release_domain_claim(ref.uid)
            return None
        except Exception as error:
            log.warning("unpreparing a compute-domain claim failed", claim=str(ref), error=str(error))
            return ClaimError(f"unpreparing claim {ref} failed: {error}")

    async def _unlabel_if_unexplained(self) -> None:
        """An unknown claim's unprepare: a label that no recorded channel claim explains goes.

        It is what a channel claim waiting for its daemon left when the store was lost: its row
        went, and with no spec yet nothing rebuilt it. While a channel claim is recorded, the
        label is that claim's (the node has one channel device) and stays.
        """
        if not any(c.kind == CHANNEL_TYPE for c in self._store.domain_claims()):
            await self._domains.unlabel_node(None)

    def _lock(self, claim_uid: str) -> asyncio.Lock:
        return self._locks.setdefault(claim_uid, asyncio.Lock())


def _claim_of_spec(uid: str, spec: dict[str, Any] | None) -> DomainClaim | None:
    """The record a spec of this driver tells of: its device, and a daemon's domain (see the module doc)."""
    if spec is None:
        return None  # removed meanwhile (the other instance's unprepare)
    for device in spec.get("devices") or []:
        name = str(device.get("name", "")).removeprefix(f"{uid}-")
        if name == CHANNEL_DEVICE:
            return DomainClaim(uid, "", "", CHANNEL_TYPE, name, "", phase="Recovered")
        if name == DAEMON_DEVICE:
            env = device.get("containerEdits", {}).get("env") or []
            prefix = "COMPUTE_DOMAIN_UUID="
            domain_uid = next((e.removeprefix(prefix) for e in env if e.startswith(prefix)), "")
            return DomainClaim(uid, "", "", DAEMON_TYPE, name, domain_uid, phase="Recovered")
    raise ValueError("it names neither a channel nor a daemon device")


def _write_atomically(path: Path, text: str) -> None:
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise


def _channel_domain(ref: ClaimRef, domain: ComputeDomain) -> str:
    """``domain`` as messages name it, once it may hand ``ref`` a channel in either IMEX mode: the
    claim is in the domain's namespace and the domain is not being deleted."""
    meta = domain.metadata
    what = f"ComputeDomain {meta.namespace}/{meta.name}"
    if meta.namespace != ref.namespace:
        raise ClaimRejected(f"claim {ref} is in namespace {ref.namespace}, but {what} is not")
    if meta.deletion_timestamp:
        raise ClaimRejected(f"{what} is being deleted; its channels are no longer handed out")
    return what


def _conflict(uid: str, refused: MutationRejected) -> Conflict:
    """A rebuilt claim the store refused, logged naming both claims (the GPU driver's wording)."""
    log.error(
        "a compute-domain claim rebuilt after a lost store conflicts",
        claim_uid=uid,
        holder=refused.holder,
        error=str(refused),
        what_to_do=CONFLICT_ADVICE,
    )
    return Conflict(uid, refused.holder or "", str(refused))
