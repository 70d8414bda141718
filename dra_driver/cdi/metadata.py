"""Device metadata (KEP-5304): a JSON file per request that tells the container what it was given.

A workload that must configure what it holds -- KubeVirt's virt-launcher above all, which passes
a GPU through to a virtual machine by its PCI address -- reads the file at a well-known path
instead of looking up its claim's status and the ResourceSlices through the API. Go drivers get
it from the kubelet plugin helper (``k8s.io/dynamic-resource-allocation/kubeletplugin``, option
``EnableDeviceMetadata``); this module writes the same files at the same paths, byte for byte:

* on the host, ``<plugins-dir>/<driver>/dra-device-metadata/<namespace>_<claim>/<request>/metadata.json``;
* in the container, ``/var/run/kubernetes.io/dra-device-attributes/resourceclaims/<claim>/<request>/
  <driver>-metadata.json``, or ``.../resourceclaimtemplates/<podClaimName>/...`` for a claim made from
  a template (its name is generated, so the pod's own name for it stands in; the claim carries it
  in the annotation ``resource.kubernetes.io/pod-claim-name``);
* the content, a JSON stream: the same ``DeviceMetadata`` object once per API version, newest
  first (``metadata.resource.k8s.io/v1beta1``, then ``v1alpha1`` for readers built against 1.36),
  each indented by two spaces and followed by a newline, as Go's ``json.MarshalIndent`` writes it.

``<request>`` is the request's own name, also for a ``firstAvailable`` request whose result names
a subrequest (``gpus/large``): the file is per request, the object names the subrequest.

How it reaches the container differs, and nothing a container sees does: the helper writes a
second CDI spec per request and adds its device to the first device of the request; here each
device of the request mounts the file itself, in the claim's one spec (:mod:`dra_driver.cdi.spec`).
A container gets the devices of the requests it names, so it sees exactly their files, as with the
helper; the runtime applies one mount per container path, so a request of two devices mounts its
file once. The claim's spec thus stays the one file that says what a claim holds.

The files are plain files under the kubelet's plugin directory, written atomically (a temporary
file renamed into place) before the spec that mounts them, and removed with the claim's spec.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

GROUP = "metadata.resource.k8s.io"
# Newest first: a reader takes the first object of the stream whose apiVersion it knows.
API_VERSIONS = (f"{GROUP}/v1beta1", f"{GROUP}/v1alpha1")
KIND = "DeviceMetadata"
HOST_SUBDIR = "dra-device-metadata"
CONTAINER_DIR = PurePosixPath("/var/run/kubernetes.io/dra-device-attributes")
POD_CLAIM_NAME_ANNOTATION = "resource.kubernetes.io/pod-claim-name"
MOUNT_OPTIONS = ("ro", "bind")  # the helper's
_FILE_MODE = 0o644  # readable in any container, writable by none
_DIR_MODE = 0o755
# What Go's encoding/json escapes beyond JSON's own rules, so that the bytes match its writer's.
_GO_ESCAPES = str.maketrans(
    {"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "\u2028": "\\u2028", "\u2029": "\\u2029"}
)

Attributes = Mapping[str, Mapping[str, Any]]  # resource.k8s.io/v1 DeviceAttribute values by name


@dataclass(frozen=True)
class MetadataDevice:
    """One allocated device as the file describes it: its slice identity and published attributes."""

    driver: str
    pool: str
    name: str
    attributes: Attributes


@dataclass(frozen=True)
class ClaimIdentity:
    """The claim a file belongs to; ``pod_claim_name`` is set when a template made it."""

    namespace: str
    name: str
    uid: str
    pod_claim_name: str | None = None


def base_request(request: str) -> str:
    """``gpus/large`` (a subrequest of ``firstAvailable``) -> ``gpus``; the file is per request."""
    return request.partition("/")[0]


def host_path(plugin_dir: Path, claim: ClaimIdentity, request: str) -> Path:
    """Where the file of ``request`` lives on the host; ``plugin_dir`` is ``<plugins-dir>/<driver>``."""
    return _claim_dir(plugin_dir, claim.namespace, claim.name) / base_request(request) / "metadata.json"


def container_path(driver: str, claim: ClaimIdentity, request: str) -> str:
    """Where a container reads the file of ``request``."""
    if claim.pod_claim_name:
        where = CONTAINER_DIR / "resourceclaimtemplates" / claim.pod_claim_name
    else:
        where = CONTAINER_DIR / "resourceclaims" / claim.name
    return str(where / base_request(request) / f"{driver}-metadata.json")


def metadata_stream(claim: ClaimIdentity, request: str, devices: Sequence[MetadataDevice]) -> bytes:
    """The file's content: one ``DeviceMetadata`` per API version, as the helper encodes it.

    ``request`` is the result's request name, with its subrequest if it has one. Generation 1:
    the file is written once per prepare and never updated (network drivers update theirs).
    """
    body: dict[str, Any] = {
        "metadata": {"name": claim.name, "namespace": claim.namespace, "uid": claim.uid, "generation": 1}
    }
    if claim.pod_claim_name:
        body["podClaimName"] = claim.pod_claim_name
    entry: dict[str, Any] = {"name": request}
    if devices:
        entry["devices"] = [_device(device) for device in devices]
    body["requests"] = [entry]
    return b"".join(
        (_go_indented({"kind": KIND, "apiVersion": version, **body}) + "\n").encode()
        for version in API_VERSIONS
    )


def _device(device: MetadataDevice) -> dict[str, Any]:
    out: dict[str, Any] = {"driver": device.driver, "pool": device.pool, "name": device.name}
    if device.attributes:
        # Go writes a map's keys sorted; each value keeps its one field.
        out["attributes"] = {name: dict(device.attributes[name]) for name in sorted(device.attributes)}
    return out


def _go_indented(value: object) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False).translate(_GO_ESCAPES)


class MetadataFiles:
    """The metadata files of this driver's prepared claims, under ``<plugin_dir>/dra-device-metadata``."""

    def __init__(self, plugin_dir: Path) -> None:
        self._plugin_dir = plugin_dir

    @property
    def plugin_dir(self) -> Path:
        return self._plugin_dir

    def write(self, files: Mapping[Path, bytes]) -> None:
        """Write each file atomically: a container never reads half of one."""
        for path, data in files.items():
            path.parent.mkdir(mode=_DIR_MODE, parents=True, exist_ok=True)
            fd, temp = tempfile.mkstemp(dir=path.parent, prefix=".metadata.", suffix=".tmp")
            try:
                with os.fdopen(fd, "wb") as out:
                    out.write(data)
                    os.fchmod(out.fileno(), _FILE_MODE)
                os.replace(temp, path)
            except BaseException:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(temp)
                raise

    def remove(self, namespace: str, name: str) -> None:
        """Remove the claim's files; none there is fine (a claim prepared without metadata)."""
        shutil.rmtree(_claim_dir(self._plugin_dir, namespace, name), ignore_errors=True)

    def remove_all(self) -> None:
        """Remove every claim's files: after a reboot no claim of the earlier boot is prepared."""
        shutil.rmtree(self._plugin_dir / HOST_SUBDIR, ignore_errors=True)


def _claim_dir(plugin_dir: Path, namespace: str, name: str) -> Path:
    return plugin_dir / HOST_SUBDIR / f"{namespace}_{name}"
