"""``dra-driver compute-domain-controller``: the cluster-level half of ComputeDomains.

Shaped like a controller-runtime controller: list-and-watch loops (with a periodic resync) on
ComputeDomains and on what they own turn every change into the key ``namespace/name`` of a domain on
a rate-limited work queue; workers reconcile one key at a time, each from a fresh read, so a missed
or duplicated event costs nothing and a failing key is retried with exponential backoff.

Reconciling a domain (see :mod:`dra_driver.computedomain.controller.objects` for the objects):

1. add the finalizer, so deletion waits for the clean-up below;
2. pick an NVLink clique with room for ``numNodes`` nodes (once: the channel template pins it), or
   say in the status why none fits (no fabric, domain larger than every clique, cliques taken). What
   is taken comes from the controller's own record of the cliques it gave to domains (rebuilt from
   the channel templates when it starts to lead), not only from the node labels, which appear only
   once a workload lands: two domains created together get a clique each;
3. create the daemon's ResourceClaimTemplate and DaemonSet and the workload channel's
   ResourceClaimTemplate, re-creating any that was removed (in the host-managed IMEX mode only the
   channel's, asking for channel 0, and the domain is Ready: the hosts run ``nvidia-imex``, each
   node checks its own when it prepares a channel, and steps 4 and the DaemonSet's deletion below
   do not apply);
4. copy the daemons' entries of the domain's ComputeDomainCliques into ``status.nodes``, after
   dropping the entries of nodes the domain's workloads left, and judge readiness: Ready once
   ``numNodes`` daemons on the clique report Ready; a daemon that stays not ready past the timeout
   gets a condition and an event.

Deleting a domain deletes its channel template at once (no new workloads), waits until no node
serves the domain any more (each node drops the label when the kubelet unprepares the workload's
channel), then deletes the DaemonSet, the daemon template and the cliques and releases the
finalizer.

Only one replica reconciles at a time: the command runs the controller under a Lease
(:mod:`dra_driver.computedomain.controller.leader`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Coroutine
from datetime import UTC, datetime
from typing import Any

import structlog

from dra_driver.apiserver.informer import list_and_watch
from dra_driver.apiserver.kube import ApiClient
from dra_driver.apiserver.rest import ApiError, Json, JsonApi
from dra_driver.computedomain.api import (
    CLIQUE_PLURAL,
    DAEMON_FAILED,
    PLURAL,
    ComputeDomain,
    DomainStatus,
    InvalidComputeDomain,
    Names,
    daemon_failures_message,
    parse_compute_domain,
)
from dra_driver.computedomain.controller.objects import (
    Placement,
    channel_template,
    choose_clique,
    condition,
    daemon_failures,
    daemon_object_name,
    daemon_set,
    daemon_template,
    event,
    fabric_from_slices,
    merge_conditions,
    nodes_from_cliques,
    overall_status,
    pruned_daemons,
)
from dra_driver.computedomain.controller.workqueue import WorkQueue

log = structlog.get_logger(__name__)

READY = "Ready"
_CLIQUE_WAIT_S = 30.0  # a domain waiting for a clique looks again this often (slices wake it too)
_DELETE_POLL_S = 2.0
_RECALL_RETRY_S = 0.5  # doubling up to the cap while the API server cannot list the domains
_RECALL_RETRY_MAX_S = 10.0


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class ComputeDomainController:
    def __init__(
        self,
        api: ApiClient,
        *,
        gpu_driver: str,
        namespace: str,
        daemon_image: str,
        daemon_ready_timeout: float = 300.0,
        resync_seconds: float = 600.0,
        workers: int = 2,
        dns_names: bool = True,
        host_managed_imex: bool = False,
    ) -> None:
        self.names = Names(gpu_driver)
        self._kube = JsonApi(api)
        self._namespace = namespace
        self._image = daemon_image
        self._ready_timeout = daemon_ready_timeout
        self._resync = resync_seconds
        self._workers = workers
        self._dns_names = dns_names
        self._host_managed = host_managed_imex  # the hosts run nvidia-imex: no daemons of ours
        self.queue = WorkQueue()
        self._keys: dict[str, str] = {}  # domain uid -> namespace/name
        self._not_ready_since: dict[tuple[str, str], float] = {}  # (uid, node) -> monotonic time
        # The record of placement, by domain uid: written in the same step as the choice (no await
        # between them), so a worker placing another domain next already counts this one.
        self.placed: dict[str, Placement] = {}
        self._cd_path = f"/apis/{self.names.api_version}/{PLURAL}"
        self._cliques_path = f"/apis/{self.names.api_version}/namespaces/{namespace}/{CLIQUE_PLURAL}"

    # --- the loops ---------------------------------------------------------------------------------

    async def run(self) -> None:
        await self.recall_placements()
        loops: list[Coroutine[Any, Any, None]] = [
            list_and_watch(self._kube, self._cd_path, self._on_domain, resync_seconds=self._resync),
            list_and_watch(
                self._kube,
                "/apis/resource.k8s.io/v1/resourceslices",
                self._on_slice,
                resync_seconds=self._resync,
            ),
            *(self._worker() for _ in range(self._workers)),
        ]
        if not self._host_managed:  # the nodes' labels, the daemons' cliques and their DaemonSets
            owned = (
                "/api/v1/nodes",
                self._cliques_path,
                f"/apis/apps/v1/namespaces/{self._namespace}/daemonsets",
            )
            loops += [
                list_and_watch(
                    self._kube,
                    path,
                    self._on_owned,
                    resync_seconds=self._resync,
                    label_selector=self.names.label,
                )
                for path in owned
            ]
        log.info(
            "compute-domain controller running",
            group=self.names.group,
            namespace=self._namespace,
            imex="host-managed" if self._host_managed else "driver-managed",
        )
        try:
            async with asyncio.TaskGroup() as tasks:
                for loop in loops:
                    tasks.create_task(loop)
        finally:
            self.queue.close()

    async def recall_placements(self) -> None:
        """Rebuild the record of placement from the channel templates of the domains there are.

        Before any worker runs: a new leader (or a restarted one) must not place a new domain on a
        clique that an existing domain holds while that domain's workload has not landed yet. An API
        server that cannot answer yet (starting, its storage initializing) is asked again.
        """
        delay = _RECALL_RETRY_S
        while True:
            try:
                placed: dict[str, Placement] = {}
                listed = await self._kube.list(self._cd_path)
                for obj in listed.get("items") or []:
                    try:
                        domain = parse_compute_domain(obj)
                    except InvalidComputeDomain:
                        continue  # never placed
                    template = await self._kube.get(self._template_path(domain))
                    clique = self._pinned_clique(domain, template)
                    if clique:
                        placed[domain.metadata.uid] = Placement.of(domain, clique)
                break
            except Exception as error:  # an outage: ask again, as the watches do
                log.warning("cannot recall placements yet", error=str(error) or type(error).__name__)
                await asyncio.sleep(delay)
                delay = min(delay * 2, _RECALL_RETRY_MAX_S)
        self.placed = placed
        log.info("placements recalled", domains=len(placed))

    def _on_domain(self, kind: str, obj: Json) -> None:
        meta = obj.get("metadata") or {}
        key = f"{meta.get('namespace')}/{meta.get('name')}"
        if meta.get("uid"):
            if kind == "DELETED":
                self._keys.pop(meta["uid"], None)
                self._release(meta["uid"])
            else:
                self._keys[meta["uid"]] = key
        self.queue.add(key)

    def _on_slice(self, kind: str, obj: Json) -> None:
        if kind != "SYNC" and (obj.get("spec") or {}).get("driver") == self.names.driver:
            for key in list(self._keys.values()):  # a clique appeared or changed: domains may fit now
                self.queue.add(key)

    def _on_owned(self, kind: str, obj: Json) -> None:
        uid = ((obj.get("metadata") or {}).get("labels") or {}).get(self.names.label)
        key = self._keys.get(uid or "")
        if key:
            self.queue.add(key)

    async def _worker(self) -> None:
        while True:
            key = await self.queue.get()
            try:
                again = await self.reconcile(key)
                self.queue.forget(key)
                if again is not None:
                    self.queue.add_after(key, again)
            except Exception as error:
                delay = self.queue.add_rate_limited(key)
                if not (isinstance(error, ApiError) and error.status == 409):
                    log.warning(
                        "reconcile failed",
                        domain=key,
                        error=str(error) or type(error).__name__,
                        retry_in_s=delay,
                    )
            finally:
                self.queue.done(key)

    # --- one domain --------------------------------------------------------------------------------

    async def reconcile(self, key: str) -> float | None:
        """Bring one domain's objects and status in line; returns when to look again (None: on change)."""
        namespace, _, name = key.partition("/")
        path = f"/apis/{self.names.api_version}/namespaces/{namespace}/{PLURAL}/{name}"
        obj = await self._kube.get(path)
        if obj is None:
            return None
        try:
            domain = parse_compute_domain(obj)
        except InvalidComputeDomain as error:
            await self._set_status(
                path, obj, None, "InvalidSpec", f"the ComputeDomain is invalid: {error}", False
            )
            return None
        if domain.metadata.deletion_timestamp:
            return await self._finalize(path, obj, domain)
        if self.names.finalizer not in domain.metadata.finalizers:
            finalizers = [*domain.metadata.finalizers, self.names.finalizer]
            await self._kube.merge_patch(
                path,
                {"metadata": {"finalizers": finalizers, "resourceVersion": domain.metadata.resource_version}},
            )
            return 0.0  # read the new version afresh

        template_path = self._template_path(domain)
        template = await self._kube.get(template_path)
        if template is not None:
            owner = ((template.get("metadata") or {}).get("labels") or {}).get(self.names.label)
            if owner != domain.metadata.uid:
                message = (
                    f"ResourceClaimTemplate {namespace}/{domain.spec.channel.resource_claim_template.name} "
                    "exists and does not belong to this ComputeDomain; choose another "
                    "spec.channel.resourceClaimTemplate.name"
                )
                await self._set_status(path, obj, domain, "TemplateNameTaken", message, False)
                return None
            clique = self._pinned_clique(domain, template)
            if clique:
                self.placed[domain.metadata.uid] = Placement.of(domain, clique)
        else:
            slices = await self._kube.list(
                "/apis/resource.k8s.io/v1/resourceslices", fieldSelector=f"spec.driver={self.names.driver}"
            )
            busy = await self._busy_nodes()
            fabric = fabric_from_slices(self.names, slices.get("items") or [])
            # No await from here to the record: another worker's choice sees this one.
            choice = choose_clique(domain, fabric, self.placed, busy)
            if not choice.clique:
                await self._set_status(path, obj, domain, choice.reason, choice.message, False)
                return _CLIQUE_WAIT_S
            clique = choice.clique
            self.placed[domain.metadata.uid] = Placement.of(domain, clique)

        if self._host_managed:
            await self._set_up_host_managed(path, obj, domain, template, clique)
            return None
        await self._ensure(
            self._daemon_template_path(domain), daemon_template(self.names, domain, self._namespace, clique)
        )
        await self._ensure(
            self._daemon_set_path(domain),
            daemon_set(self.names, domain, self._namespace, self._image, dns_names=self._dns_names),
        )
        if template is None:
            await self._ensure(template_path, channel_template(self.names, domain, clique), as_kubectl=True)
            log.info("ComputeDomain set up", domain=key, clique=clique)

        members = await self._member_nodes(domain.metadata.uid)
        listed = await self._kube.list(
            self._cliques_path, labelSelector=f"{self.names.label}={domain.metadata.uid}"
        )
        cliques: list[Json] = listed.get("items") or []
        if await self._sync_nodes(path, domain, members, cliques):
            return 0.0  # read the new status afresh
        failures = {node: why for node, why in daemon_failures(cliques).items() if node in members}
        return await self._judge(path, obj, domain, clique, members, failures)

    async def _set_up_host_managed(
        self, path: str, obj: Json, domain: ComputeDomain, template: Json | None, clique: str
    ) -> None:
        """The host-managed IMEX mode: the channel template alone, and the domain Ready at once.

        No DaemonSet, no daemon template, no cliques: the hosts' own nvidia-imex daemons serve the
        domain, and each node checks its daemon when it prepares a channel (NVIDIA's controller
        likewise reports such a domain Ready once its template exists).
        """
        if template is None:
            template_path = self._template_path(domain)
            await self._ensure(
                template_path,
                channel_template(self.names, domain, clique, host_managed=True),
                as_kubectl=True,
            )
            log.info(
                "ComputeDomain set up",
                domain=f"{domain.metadata.namespace}/{domain.metadata.name}",
                clique=clique,
            )
        message = (
            f"placed on clique {clique}; the nodes' own nvidia-imex daemons serve it (host-managed IMEX), "
            "each checked when a workload's channel is prepared"
        )
        await self._set_status(path, obj, domain, "HostManagedIMEX", message, True)

    async def _judge(
        self,
        path: str,
        obj: Json,
        domain: ComputeDomain,
        clique: str,
        members: set[str],
        failures: dict[str, str],
    ) -> float | None:
        """The domain's Ready condition: ready, a daemon failed (at once, with its reason), a daemon
        late (after the timeout), or waiting for daemons."""
        uid = domain.metadata.uid
        ready = {n.name for n in domain.status.nodes if n.status is DomainStatus.READY}
        now = time.monotonic()
        for key in [
            k for k in self._not_ready_since if k[0] == uid and (k[1] in ready or k[1] not in members)
        ]:
            del self._not_ready_since[key]
        late: list[str] = []
        soonest: float | None = None
        for node in sorted(members - ready):
            since = self._not_ready_since.setdefault((uid, node), now)
            left = self._ready_timeout - (now - since)
            if left <= 0:
                late.append(node)
            else:
                soonest = left if soonest is None else min(soonest, left)
        status = overall_status(domain, clique)
        if status is DomainStatus.READY:
            reason, message = "DaemonsReady", f"{len(ready)} IMEX daemon(s) ready on clique {clique}"
        elif failures:
            reason, message = DAEMON_FAILED, daemon_failures_message(failures)
        elif late:
            reason = "DaemonNotReady"
            message = (
                f"the IMEX daemon on node(s) {', '.join(late)} is not ready after "
                f"{self._ready_timeout:.0f}s; see its pod's log in namespace {self._namespace}"
            )
        else:
            wanted = domain.spec.num_nodes or max(len(members), 1)
            reason = "WaitingForDaemons"
            message = f"{len(ready)} of {wanted} IMEX daemon(s) ready on clique {clique}"
        await self._set_status(path, obj, domain, reason, message, status is DomainStatus.READY)
        return soonest

    async def _finalize(self, path: str, obj: Json, domain: ComputeDomain) -> float | None:
        if self.names.finalizer not in domain.metadata.finalizers:
            return None
        template = await self._kube.get(self._template_path(domain))
        owner = (((template or {}).get("metadata") or {}).get("labels") or {}).get(self.names.label)
        if owner == domain.metadata.uid:
            await self._kube.delete(self._template_path(domain))
        members = await self._member_nodes(domain.metadata.uid)
        if members:
            message = f"waiting for the workloads on node(s) {', '.join(sorted(members))} to end"
            await self._set_status(path, obj, domain, "Deleting", message, False)
            return _DELETE_POLL_S
        if not self._host_managed:  # which made none of these
            await self._kube.delete(self._daemon_set_path(domain))
            await self._kube.delete(self._daemon_template_path(domain))
            cliques = await self._kube.list(
                self._cliques_path, labelSelector=f"{self.names.label}={domain.metadata.uid}"
            )
            for item in cliques.get("items") or []:
                await self._kube.delete(f"{self._cliques_path}/{item['metadata']['name']}")
        finalizers = [f for f in domain.metadata.finalizers if f != self.names.finalizer]
        await self._kube.merge_patch(
            path,
            {"metadata": {"finalizers": finalizers, "resourceVersion": domain.metadata.resource_version}},
        )
        for key in [k for k in self._not_ready_since if k[0] == domain.metadata.uid]:
            del self._not_ready_since[key]
        self._release(domain.metadata.uid)
        log.info("ComputeDomain cleaned up", domain=f"{domain.metadata.namespace}/{domain.metadata.name}")
        return None

    # --- helpers -----------------------------------------------------------------------------------

    def _pinned_clique(self, domain: ComputeDomain, template: Json | None) -> str:
        """The clique the domain's channel template pins ("" if there is none of the domain's)."""
        meta = (template or {}).get("metadata") or {}
        if (meta.get("labels") or {}).get(self.names.label) != domain.metadata.uid:
            return ""
        return str((meta.get("annotations") or {}).get(f"{self.names.group}/clique", ""))

    def _release(self, uid: str) -> None:
        """The domain's clique is free again: the domains waiting for one look at once."""
        if self.placed.pop(uid, None) is None:
            return
        for other, key in self._keys.items():
            if other != uid and other not in self.placed:
                self.queue.add(key)

    def _template_path(self, domain: ComputeDomain) -> str:
        name = domain.spec.channel.resource_claim_template.name
        return (
            f"/apis/resource.k8s.io/v1/namespaces/{domain.metadata.namespace}/resourceclaimtemplates/{name}"
        )

    def _daemon_template_path(self, domain: ComputeDomain) -> str:
        name = daemon_object_name(domain)
        return f"/apis/resource.k8s.io/v1/namespaces/{self._namespace}/resourceclaimtemplates/{name}"

    def _daemon_set_path(self, domain: ComputeDomain) -> str:
        return f"/apis/apps/v1/namespaces/{self._namespace}/daemonsets/{daemon_object_name(domain)}"

    async def _ensure(self, path: str, body: Json, *, as_kubectl: bool = False) -> None:
        """Create the object unless it exists (its spec is never changed afterwards, as NVIDIA's).

        ``as_kubectl`` for the channel template: its claims' opaque config must arrive as kubectl
        sends it, or the API server refuses their status writes, the binding conditions' among them
        (:meth:`dra_driver.apiserver.rest.JsonApi.create_as_kubectl`).
        """
        if await self._kube.get(path) is not None:
            return
        collection = path.rsplit("/", 1)[0]
        try:
            if as_kubectl:
                await self._kube.create_as_kubectl(collection, body)
            else:
                await self._kube.create(collection, body)
        except ApiError as error:
            if error.status != 409:
                raise

    async def _member_nodes(self, uid: str) -> set[str]:
        listed = await self._kube.list("/api/v1/nodes", labelSelector=f"{self.names.label}={uid}")
        return {item["metadata"]["name"] for item in listed.get("items") or []}

    async def _busy_nodes(self) -> dict[str, str]:
        listed = await self._kube.list("/api/v1/nodes", labelSelector=self.names.label)
        return {
            item["metadata"]["name"]: item["metadata"]["labels"][self.names.label]
            for item in listed.get("items") or []
        }

    async def _sync_nodes(
        self, path: str, domain: ComputeDomain, members: set[str], cliques: list[Json]
    ) -> bool:
        """Mirror the domain's ComputeDomainCliques into ``status.nodes``; True if anything changed.

        An entry of a node that left the domain (its workload ended, the node label went) is first
        removed from its clique, as NVIDIA's controller removes the entries of departed daemons.
        """
        for item in cliques:
            kept = pruned_daemons(item, members)
            if kept is not None:
                # With the resourceVersion read: a daemon writing meanwhile makes this a 409, retried.
                await self._kube.replace(
                    f"{self._cliques_path}/{item['metadata']['name']}", {**item, "daemons": kept}
                )
                return True
        nodes = nodes_from_cliques(cliques)
        if nodes == [n.model_dump(by_alias=True, mode="json") for n in domain.status.nodes]:
            return False
        await self._kube.merge_patch(f"{path}/status", {"status": {"nodes": nodes}})
        return True

    async def _set_status(
        self, path: str, obj: Json, domain: ComputeDomain | None, reason: str, message: str, ready: bool
    ) -> None:
        """Write status.status and the Ready condition; a changed reason is also an Event."""
        old = (obj.get("status") or {}).get("conditions") or []
        generation = int((obj.get("metadata") or {}).get("generation") or 0)
        now = _now()
        new = merge_conditions(old, [condition(READY, ready, reason, message, generation, now)])
        wanted = (DomainStatus.READY if ready else DomainStatus.NOT_READY).value
        current = obj.get("status") or {}
        if current.get("status") == wanted and _same(old, new):
            return
        await self._kube.merge_patch(f"{path}/status", {"status": {"status": wanted, "conditions": new}})
        before: Json = next((c for c in old if c.get("type") == READY), {})
        if before.get("reason") != reason and domain is not None:
            with contextlib.suppress(ApiError):  # an event is a courtesy; the status is the record
                body = event(
                    self.names,
                    domain,
                    reason,
                    message,
                    now,
                    warning=not ready and reason != "WaitingForDaemons",
                )
                await self._kube.create(f"/api/v1/namespaces/{domain.metadata.namespace}/events", body)
            log.info(
                "ComputeDomain status",
                domain=f"{domain.metadata.namespace}/{domain.metadata.name}",
                reason=reason,
                message=message,
            )


def _same(old: list[Json], new: list[Json]) -> bool:
    strip = ("lastTransitionTime",)
    return [{k: v for k, v in c.items() if k not in strip} for c in old] == [
        {k: v for k, v in c.items() if k not in strip} for c in new
    ]
