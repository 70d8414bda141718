"""The device metadata file (KEP-5304): the bytes and paths of the Go kubelet plugin helper.

The expected stream below is what k8s.io/dynamic-resource-allocation v0.37.2 writes for the same
claim (its metadataWriter: the internal object encoded by the metadata scheme's pretty JSON
serializer for v1beta1, then v1alpha1, each followed by a newline), run once against this input;
a reader built on that library (KubeVirt, ``devicemetadata.ReadResourceClaimMetadata``) parses
exactly these bytes.
"""

from __future__ import annotations

import json
import stat
from pathlib import Path

from dra_driver.cdi.metadata import (
    ClaimIdentity,
    MetadataDevice,
    MetadataFiles,
    container_path,
    host_path,
    metadata_stream,
)

CLAIM = ClaimIdentity("ns1", "claim-a", "0f1e2d3c-aaaa-bbbb-cccc-000000000001")
FROM_TEMPLATE = ClaimIdentity(CLAIM.namespace, CLAIM.name, CLAIM.uid, pod_claim_name="my-gpu")
GPU_0 = MetadataDevice(
    "gpu.example.com",
    "node-1",
    "gpu-0",
    {
        "productName": {"string": "Tesla <T4> & co"},
        "resource.kubernetes.io/pciBusID": {"string": "0000:3b:00.0"},
        "resource.kubernetes.io/numaNode": {"int": 1},
        "driverVersion": {"version": "580.95.5"},
        "cudaComputeCapability": {"version": "9.0.0"},
        "brand": {"string": "Nvidia"},
    },
)
GPU_1 = MetadataDevice("gpu.example.com", "node-1", "gpu-1", {})

GO_V1BETA1 = """{
  "kind": "DeviceMetadata",
  "apiVersion": "metadata.resource.k8s.io/v1beta1",
  "metadata": {
    "name": "claim-a",
    "namespace": "ns1",
    "uid": "0f1e2d3c-aaaa-bbbb-cccc-000000000001",
    "generation": 1
  },
  "podClaimName": "my-gpu",
  "requests": [
    {
      "name": "gpus/big",
      "devices": [
        {
          "driver": "gpu.example.com",
          "pool": "node-1",
          "name": "gpu-0",
          "attributes": {
            "brand": {
              "string": "Nvidia"
            },
            "cudaComputeCapability": {
              "version": "9.0.0"
            },
            "driverVersion": {
              "version": "580.95.5"
            },
            "productName": {
              "string": "Tesla \\u003cT4\\u003e \\u0026 co"
            },
            "resource.kubernetes.io/numaNode": {
              "int": 1
            },
            "resource.kubernetes.io/pciBusID": {
              "string": "0000:3b:00.0"
            }
          }
        },
        {
          "driver": "gpu.example.com",
          "pool": "node-1",
          "name": "gpu-1"
        }
      ]
    }
  ]
}
"""


def test_the_stream_is_the_go_helpers_byte_for_byte() -> None:
    stream = metadata_stream(FROM_TEMPLATE, "gpus/big", [GPU_0, GPU_1])

    go_v1alpha1 = GO_V1BETA1.replace("metadata.resource.k8s.io/v1beta1", "metadata.resource.k8s.io/v1alpha1")
    assert stream.decode() == GO_V1BETA1 + go_v1alpha1


def test_a_reader_takes_the_first_object_it_understands() -> None:
    """How the helper's own decoder (and a jq user) reads it: a stream of whole JSON objects."""
    decoder = json.JSONDecoder()
    text = metadata_stream(CLAIM, "gpus", [GPU_0]).decode()
    first, end = decoder.raw_decode(text)
    second, _ = decoder.raw_decode(text, end + 1)

    assert [first["apiVersion"], second["apiVersion"]] == [
        "metadata.resource.k8s.io/v1beta1",
        "metadata.resource.k8s.io/v1alpha1",
    ]
    assert "podClaimName" not in first  # a claim referenced by name has none
    device = first["requests"][0]["devices"][0]
    assert device["attributes"]["resource.kubernetes.io/pciBusID"] == {"string": "0000:3b:00.0"}


def test_paths_on_the_host_and_in_the_container_are_the_helpers() -> None:
    plugin_dir = Path("/var/lib/kubelet/plugins/gpu.example.com")

    assert host_path(plugin_dir, CLAIM, "gpus/big") == Path(
        "/var/lib/kubelet/plugins/gpu.example.com/dra-device-metadata/ns1_claim-a/gpus/metadata.json"
    )
    assert container_path("gpu.example.com", CLAIM, "gpus/big") == (
        "/var/run/kubernetes.io/dra-device-attributes/resourceclaims/claim-a/gpus/gpu.example.com-metadata.json"
    )
    assert container_path("gpu.example.com", FROM_TEMPLATE, "gpus") == (
        "/var/run/kubernetes.io/dra-device-attributes/resourceclaimtemplates/my-gpu/gpus/"
        "gpu.example.com-metadata.json"
    )


def test_files_are_readable_by_all_and_removed_per_claim(tmp_path: Path) -> None:
    files = MetadataFiles(tmp_path)
    mine = host_path(tmp_path, CLAIM, "gpus")
    other = host_path(tmp_path, ClaimIdentity("ns1", "claim-b", "uid-b"), "gpus")
    files.write({mine: b"one\n", other: b"two\n"})

    assert mine.read_bytes() == b"one\n"
    assert stat.S_IMODE(mine.stat().st_mode) == 0o644
    assert [p.name for p in mine.parent.iterdir()] == ["metadata.json"]  # no temporary file left

    files.remove(CLAIM.namespace, CLAIM.name)
    files.remove(CLAIM.namespace, CLAIM.name)  # already gone: fine

    assert not mine.parent.parent.exists()
    assert other.read_bytes() == b"two\n"
