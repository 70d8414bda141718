"""The kubelet of one simulated node: hack/kube/cmd/kubelet-harness, the kubelet's own DRA manager and
plugin manager (see its README.md for what it does and what tests observe of it)."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from pathlib import Path

from e2e.cluster import features
from e2e.cluster.binaries import build_outputs
from e2e.daemon import Daemon

# What the harness logs once it watches the registration directory and syncs its node's pods.
_RUNNING = "Kubelet harness running"


@functools.cache
def feature_gates_flag(binary: Path) -> str:
    """The wanted DRA gates the harness of this release can set. Like a real kubelet's, its alpha
    gates are off unless asked for: on 1.34 and 1.35 the kubelet side of extended resources, consumable
    capacity and device health would otherwise be off while the control plane has them on."""
    return features.feature_gates_flag(features.settable_gates(binary))


def ensure_harness_binary() -> Path:
    """The harness of the pinned Kubernetes version, built by hack/build-kube.sh when missing or stale."""
    return Path(build_outputs("harness")["KUBE_BIN_DIR"]) / "kubelet-harness"


class KubeletHarness:
    """One node's kubelet. Its checkpoint lives in `state_dir`, so a restart behaves like a kubelet's:
    it wipes the node's ResourceSlices, and prepares the claims of the pods it finds running again."""

    def __init__(
        self,
        binary: Path,
        *,
        kubeconfig: Path,
        node_name: str,
        registry_dir: Path,
        state_dir: Path,
        log: Path,
        labels: Mapping[str, str],
        heartbeat_interval: str = "5s",
    ) -> None:
        self.node_name = node_name
        self.registry_dir = registry_dir
        self._argv = [
            str(binary),
            f"--kubeconfig={kubeconfig}",
            f"--node-name={node_name}",
            f"--plugins-registry-dir={registry_dir}",
            f"--state-dir={state_dir}",
            f"--node-labels={','.join(f'{key}={value}' for key, value in sorted(labels.items()))}",
            f"--heartbeat-interval={heartbeat_interval}",
            f"--feature-gates={feature_gates_flag(binary)}",
        ]
        self._daemon = Daemon(f"kubelet-harness[{node_name}]", log)

    @property
    def daemon(self) -> Daemon:
        return self._daemon

    @property
    def running(self) -> bool:
        return self._daemon.running

    def start(self, timeout_seconds: float = 60.0) -> None:
        """Returns once the Node is registered and the harness watches for plugins and pods."""
        self.registry_dir.mkdir(parents=True, exist_ok=True)
        self._daemon.start(
            self._argv,
            lambda offset: _RUNNING in self._daemon.log_since(offset),
            timeout_seconds=timeout_seconds,
        )

    def stop(self) -> int | None:
        """SIGTERM: the harness exits without unpreparing anything, like a kubelet being restarted."""
        return self._daemon.stop()

    def restart(self) -> int | None:
        status = self.stop()
        self.start()
        return status
