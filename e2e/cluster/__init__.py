"""A real, local Kubernetes control plane for the end-to-end tests and the demo.

Shell: `make cluster-up` / `make cluster-down` (python -m e2e.cluster up|down|status).
pytest: the session fixture `cluster` in e2e/conftest.py.
"""

from e2e.cluster.binaries import BuildError, ControlPlaneBinaries, ensure_control_plane_binaries
from e2e.cluster.controlplane import ClusterInfo, ControlPlane, Ports, StartupError, stop_processes
from e2e.cluster.nodes import GPU_NODE_LABELS, FakeNodeFactory, create_fake_node
from e2e.cluster.rest import ApiError, JsonObject, RestClient
from e2e.cluster.tokens import mint_service_account_token

__all__ = [
    "GPU_NODE_LABELS",
    "ApiError",
    "BuildError",
    "ClusterInfo",
    "ControlPlane",
    "ControlPlaneBinaries",
    "FakeNodeFactory",
    "JsonObject",
    "Ports",
    "RestClient",
    "StartupError",
    "create_fake_node",
    "ensure_control_plane_binaries",
    "mint_service_account_token",
    "stop_processes",
]
