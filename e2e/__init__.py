"""End-to-end tests and the machinery they run on (a real local control plane: e2e.cluster)."""

import os

# These tests fork child processes (the control plane, the driver, the kubelet harness) from a
# process that is also a gRPC client. gRPC's fork handlers can then deadlock the fork itself (seen
# in the fault suite: the main thread stuck in __run_prefork_handlers). Nothing here needs gRPC in
# a forked child, so the handlers stay off. It must be set before gRPC starts.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
