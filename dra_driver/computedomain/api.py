"""The ComputeDomain API: names, the custom resource and the opaque configs of its claims.

A ComputeDomain asks for a set of nodes on one NVLink clique that run an IMEX daemon each, so that
the workload pods on them can share GPU memory across nodes. It has NVIDIA's shape field for field
(``resource.nvidia.com/v1beta1``, see NVIDIA's ``api/nvidia.com/resource/v1beta1/computedomain.go``),
so that manifests written for NVIDIA's driver work unchanged when this driver is deployed under the
name ``gpu.nvidia.com``. Deployed under its own name, the same resource lives in the group
``resource.<domain>``, version ``v1beta1``.

Every name is derived from the GPU driver's name here, in one place:

=====================  ==================================  ======================================
                       gpu.nvidia.com                      gpu.dra-driver.dev (our default)
=====================  ==================================  ======================================
CRD group              resource.nvidia.com                 resource.dra-driver.dev
second driver          compute-domain.nvidia.com           compute-domain.dra-driver.dev
node label             resource.nvidia.com/computeDomain   resource.dra-driver.dev/computeDomain
=====================  ==================================  ======================================

Beside each ComputeDomain live its **ComputeDomainCliques** (NVIDIA's
``api/nvidia.com/resource/v1beta1/computedomainclique.go``): one object per domain and NVLink
clique, in the driver's namespace, named ``<domainUID>.<cliqueID>``, whose top-level ``daemons``
list is written by the IMEX daemons of that clique (each its own entry: node, IP address, clique,
index, readiness). The daemons talk to each other through it; the controller copies the entries
into the domain's ``status.nodes``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.alias_generators import to_camel

VERSION = "v1beta1"
KIND = "ComputeDomain"
PLURAL = "computedomains"
CLIQUE_KIND = "ComputeDomainClique"
CLIQUE_PLURAL = "computedomaincliques"
CHANNEL_CONFIG_KIND = "ComputeDomainChannelConfig"
DAEMON_CONFIG_KIND = "ComputeDomainDaemonConfig"
CHANNEL_TYPE = "channel"
DAEMON_TYPE = "daemon"
CLIQUE_ATTRIBUTE = "cliqueID"
FINALIZER_SUFFIX = "computeDomain"


@dataclass(frozen=True)
class Names:
    """Every name the ComputeDomain machinery uses, derived from the GPU driver's name."""

    gpu_driver: str

    @property
    def domain(self) -> str:
        """``nvidia.com`` for ``gpu.nvidia.com``; the driver name without a leading ``gpu.``."""
        return self.gpu_driver.removeprefix("gpu.")

    @property
    def group(self) -> str:
        return f"resource.{self.domain}"

    @property
    def api_version(self) -> str:
        return f"{self.group}/{VERSION}"

    @property
    def driver(self) -> str:
        """The second driver name, for channel and daemon devices."""
        return f"compute-domain.{self.domain}"

    @property
    def label(self) -> str:
        """Node, DaemonSet and template label naming the domain (by UID) they belong to."""
        return f"{self.group}/computeDomain"

    @property
    def clique_label(self) -> str:
        """NVIDIA's ``resource.nvidia.com/computeDomain.cliqueID`` on a ComputeDomainClique."""
        return f"{self.label}.cliqueID"

    @property
    def finalizer(self) -> str:
        return f"{self.group}/{FINALIZER_SUFFIX}"

    @property
    def channel_class(self) -> str:
        """NVIDIA's ``compute-domain-default-channel.nvidia.com``: channel 0 of a node."""
        return f"compute-domain-default-channel.{self.domain}"

    @property
    def daemon_class(self) -> str:
        return f"compute-domain-daemon.{self.domain}"

    def crd_name(self) -> str:
        return f"{PLURAL}.{self.group}"


class ChannelAllocationMode(StrEnum):
    SINGLE = "Single"  # one IMEX channel per workload claim
    ALL = "All"  # every channel of the node


class DomainStatus(StrEnum):
    READY = "Ready"
    NOT_READY = "NotReady"


class _Model(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")


class ResourceClaimTemplateRef(_Model):
    name: Annotated[str, Field(min_length=1, max_length=253)]


class ChannelSpec(_Model):
    resource_claim_template: ResourceClaimTemplateRef
    allocation_mode: ChannelAllocationMode = ChannelAllocationMode.SINGLE


class ComputeDomainSpec(_Model):
    num_nodes: Annotated[int, Field(ge=0)] = 0
    channel: ChannelSpec


class ComputeDomainNode(_Model):
    """One member node, written by the IMEX daemon running there."""

    name: str
    ip_address: str = ""
    clique_id: str = Field(default="", alias="cliqueID")
    index: int = 0
    status: DomainStatus = DomainStatus.NOT_READY


class ComputeDomainStatus(_Model):
    status: DomainStatus = DomainStatus.NOT_READY
    nodes: list[ComputeDomainNode] = []
    conditions: list[dict[str, Any]] = []


class Metadata(_Model):
    name: str
    namespace: str = ""
    uid: str = ""
    resource_version: str = ""
    generation: int = 0
    deletion_timestamp: str | None = None
    finalizers: list[str] = []


class ComputeDomainDaemonInfo(_Model):
    """One IMEX daemon in a :class:`ComputeDomainClique`, as that daemon wrote it."""

    node_name: str
    ip_address: str = ""
    clique_id: str = Field(default="", alias="cliqueID")
    index: int = 0
    status: DomainStatus = DomainStatus.NOT_READY
    # Ours, beside NVIDIA's fields: why the daemon is not ready when it knows (its IMEX part failed).
    message: str = ""

    def as_node(self) -> dict[str, Any]:
        """The same daemon as an entry of the ComputeDomain's ``status.nodes``."""
        return {
            "name": self.node_name,
            "ipAddress": self.ip_address,
            "cliqueID": self.clique_id,
            "index": self.index,
            "status": self.status.value,
        }


def clique_object_name(domain_uid: str, clique: str) -> str:
    """NVIDIA's name of a ComputeDomainClique (in the driver's namespace): ``<domainUID>.<cliqueID>``."""
    return f"{domain_uid}.{clique}"


class ComputeDomain(_Model):
    metadata: Metadata
    spec: ComputeDomainSpec
    status: ComputeDomainStatus = ComputeDomainStatus()


DAEMON_FAILED = "DaemonFailed"  # the reason of the domain's Ready condition while a daemon fails


def daemon_failures_message(failures: dict[str, str]) -> str:
    """The message of the domain's ``DaemonFailed`` condition: each failing node's daemon and why."""
    return "; ".join(f"{_FAILED_PREFIX.format(node=node)}{why}" for node, why in sorted(failures.items()))


def daemon_failure(domain: ComputeDomain, node: str) -> str | None:
    """Why the IMEX daemon on ``node`` fails, as the controller reports it in the domain's Ready
    condition; None while it does not (or not yet: the controller copies it from the daemon).

    A node's channel waits on this: the node may not read the ComputeDomainCliques, where the
    daemon itself writes why, so it reads the domain the controller keeps.
    """
    ready = next((c for c in domain.status.conditions if c.get("type") == "Ready"), None)
    if ready is None or ready.get("reason") != DAEMON_FAILED:
        return None
    message = str(ready.get("message") or "")
    prefix = _FAILED_PREFIX.format(node=node)
    start = message.find(prefix)
    if start < 0:
        return None
    why = message[start + len(prefix) :]
    end = why.find(f"; {_FAILED_START}")  # the next node's failure
    return why if end < 0 else why[:end]


_FAILED_START = "the IMEX daemon on node "
_FAILED_PREFIX = _FAILED_START + "{node} failed: "


class InvalidComputeDomain(ValueError):
    """The object is not a ComputeDomain this driver can act on; the message says which field."""


def parse_compute_domain(obj: dict[str, Any]) -> ComputeDomain:
    """The ComputeDomain of an API object; :class:`InvalidComputeDomain` names the first bad field."""
    try:
        return ComputeDomain.model_validate(obj)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise InvalidComputeDomain(f"{where}: {first['msg']}") from None


# --- the opaque configs the controller puts into the claim templates it creates ----------------------


class _Config(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")

    api_version: str
    domain_id: Annotated[str, Field(alias="domainID", min_length=1)]


class ChannelConfig(_Config):
    kind: Literal["ComputeDomainChannelConfig"]
    allocation_mode: ChannelAllocationMode = ChannelAllocationMode.SINGLE


class DaemonConfig(_Config):
    kind: Literal["ComputeDomainDaemonConfig"]


def parse_config(parameters: Any, names: Names) -> ChannelConfig | DaemonConfig:
    """The opaque config of a channel or daemon claim; ValueError says what is wrong with it."""
    if not isinstance(parameters, dict):
        raise ValueError("the opaque config's parameters are not a JSON object")
    if parameters.get("apiVersion") != names.api_version:
        raise ValueError(
            f"apiVersion {parameters.get('apiVersion')!r} is not {names.api_version!r}, the API of "
            f"the ComputeDomains of driver {names.driver}"
        )
    kinds: dict[str, type[ChannelConfig | DaemonConfig]] = {
        CHANNEL_CONFIG_KIND: ChannelConfig,
        DAEMON_CONFIG_KIND: DaemonConfig,
    }
    model = kinds.get(str(parameters.get("kind")))
    if model is None:
        raise ValueError(f"kind {parameters.get('kind')!r} is not one of {', '.join(kinds)}")
    try:
        return model.model_validate(parameters)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise ValueError(f"{parameters['kind']}.{where}: {first['msg']}") from None


def channel_config(names: Names, domain_uid: str, mode: ChannelAllocationMode) -> dict[str, Any]:
    return {
        "apiVersion": names.api_version,
        "kind": CHANNEL_CONFIG_KIND,
        "domainID": domain_uid,
        "allocationMode": mode.value,
    }


def daemon_config(names: Names, domain_uid: str) -> dict[str, Any]:
    return {"apiVersion": names.api_version, "kind": DAEMON_CONFIG_KIND, "domainID": domain_uid}
