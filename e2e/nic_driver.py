"""A second DRA driver of the test suite's own: fake NICs, one per PCIe root, beside our GPUs.

What another vendor's NIC driver (dranet, a SR-IOV driver) does, cut to what a claim pairing a GPU
with a NIC needs: it publishes the node's NICs in a ResourceSlice with the standard
``resource.kubernetes.io/pcieRoot`` attribute, registers with the node's kubelet (the kubelet refuses
to start a pod whose claim names a driver it has no plugin of) and prepares each claim by answering
that there is nothing to hand the container. Run as ``python -m e2e.nic_driver``; it logs
``NIC driver running`` once the kubelet accepted it and its slice is published.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
from kubernetes import client, config

from dra_driver.kubelet.pb.dra.v1 import dra_pb2, dra_pb2_grpc
from dra_driver.kubelet.pb.pluginregistration import registration_pb2, registration_pb2_grpc

RUNNING = "NIC driver running"


class Registration(registration_pb2_grpc.RegistrationServicer):
    def __init__(self, driver: str, endpoint: Path) -> None:
        self.info = registration_pb2.PluginInfo(
            type="DRAPlugin", name=driver, endpoint=str(endpoint), supported_versions=["v1.DRAPlugin"]
        )
        self.accepted = threading.Event()

    def GetInfo(self, request: Any, context: Any) -> registration_pb2.PluginInfo:
        return self.info

    def NotifyRegistrationStatus(
        self, request: Any, context: Any
    ) -> registration_pb2.RegistrationStatusResponse:
        if request.plugin_registered:
            self.accepted.set()
        else:
            print(f"the kubelet refused the NIC driver: {request.error}", flush=True)
        return registration_pb2.RegistrationStatusResponse()


class Nics(dra_pb2_grpc.DRAPluginServicer):
    """Prepares every claim with nothing to add: a fake NIC has no device node to hand over."""

    def NodePrepareResources(self, request: Any, context: Any) -> dra_pb2.NodePrepareResourcesResponse:
        print(f"prepared {[claim.name for claim in request.claims]}", flush=True)
        return dra_pb2.NodePrepareResourcesResponse(
            claims={claim.uid: dra_pb2.NodePrepareResourceResponse() for claim in request.claims}
        )

    def NodeUnprepareResources(self, request: Any, context: Any) -> dra_pb2.NodeUnprepareResourcesResponse:
        return dra_pb2.NodeUnprepareResourcesResponse(
            claims={claim.uid: dra_pb2.NodeUnprepareResourceResponse() for claim in request.claims}
        )


def resource_slice(driver: str, node: str, nics: dict[str, str]) -> dict[str, Any]:
    """The node's NICs, each with the PCIe root it sits behind."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": f"{node}-{driver}"},
        "spec": {
            "driver": driver,
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": [
                {
                    "name": name,
                    "attributes": {
                        "type": {"string": "nic"},
                        "resource.kubernetes.io/pcieRoot": {"string": root},
                    },
                }
                for name, root in nics.items()
            ],
        },
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.nic_driver", description=__doc__)
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--node-name", required=True)
    parser.add_argument("--driver", required=True)
    parser.add_argument("--registry-dir", type=Path, required=True)
    parser.add_argument("--plugins-dir", type=Path, required=True)
    parser.add_argument("--nic", action="append", default=[], metavar="NAME=PCIE_ROOT")
    args = parser.parse_args(argv)
    nics = dict(nic.split("=", 1) for nic in args.nic)

    endpoint = args.plugins_dir / args.driver / "dra.sock"
    endpoint.parent.mkdir(parents=True, exist_ok=True)
    endpoint.unlink(missing_ok=True)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    dra_pb2_grpc.add_DRAPluginServicer_to_server(Nics(), server)
    server.add_insecure_port(f"unix:{endpoint}")
    registration = Registration(args.driver, endpoint)
    registration_pb2_grpc.add_RegistrationServicer_to_server(registration, server)
    socket = args.registry_dir / f"{args.driver}-reg.sock"
    socket.unlink(missing_ok=True)
    server.add_insecure_port(f"unix:{socket}")
    server.start()

    stopped = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    if not registration.accepted.wait(timeout=60):
        print("the kubelet did not register the NIC driver within 60s", flush=True)
        return 1
    # The kubelet wipes a node's slices when it starts; a driver publishes once registered.
    with config.new_client_from_config(config_file=args.kubeconfig) as api:
        resource = client.ResourceV1Api(api)
        body = resource_slice(args.driver, args.node_name, nics)
        try:
            resource.delete_resource_slice(body["metadata"]["name"])
        except client.ApiException as error:
            if error.status != 404:
                raise
        resource.create_resource_slice(body)
    print(RUNNING, flush=True)
    stopped.wait()
    server.stop(grace=1).wait()
    socket.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
