"""The Go reference driver, run beside ours by ``make bench-go`` (bench/compare_go.py).

The reference is the kubelet plugin of sigs.k8s.io/dra-example-driver: the upstream example on
k8s.io/dynamic-resource-allocation's ``kubeletplugin`` helper, the helper NVIDIA's Go driver is built
on too. hack/build-go-reference.sh fetches it through the Go module proxy and builds it into the
cache; nothing of it is in this repository.

It is started with 8 devices (``gpu-0`` .. ``gpu-7``, as ours) and with its API rate limit raised
(``--kube-api-qps``/``--kube-api-burst`` 1000): at its defaults (5 QPS, burst 10) client-go's
limiter throttles its claim GETs to about 5 claims/s, which would measure the limiter and not the
driver. It has no readiness endpoint, so its start-up is timed to registration only.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from bench.daemon import Daemon, DaemonConfig
from bench.kubelet import BenchFailure

REPO = Path(__file__).resolve().parent.parent
DRIVER_NAME = "gpu.example.com"  # the example driver's name for its gpu profile
API_QPS = 1000


def build() -> Path:
    """The reference driver's binary, built into the cache when missing (hack/build-go-reference.sh)."""
    done = subprocess.run(
        [REPO / "hack" / "build-go-reference.sh"], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise BenchFailure(f"could not build the Go reference driver:\n{done.stderr.strip()}")
    for line in done.stdout.splitlines():
        if line.startswith("GO_REFERENCE_DRIVER_BIN="):
            return Path(line.split("=", 1)[1])
    raise BenchFailure(f"hack/build-go-reference.sh printed no GO_REFERENCE_DRIVER_BIN:\n{done.stdout}")


class GoReferenceDaemon(Daemon):
    """One running ``dra-example-kubeletplugin``, in the same directory layout as our daemon."""

    def __init__(self, binary: Path, config: DaemonConfig, base: Path) -> None:
        self.binary = binary
        super().__init__(config, base)

    def command(self) -> list[str]:
        config, paths = self.config, self.paths
        return [
            str(self.binary),
            f"--driver-name={config.driver}",
            f"--node-name={config.node}",
            "--device-profile=gpu",
            "--num-devices=8",
            f"--kubeconfig={config.kubeconfig}",
            f"--kube-api-qps={API_QPS}",
            f"--kube-api-burst={API_QPS}",
            f"--kubelet-plugins-directory-path={paths.plugins}",
            f"--kubelet-registrar-directory-path={paths.registry}",
            f"--cdi-root={paths.cdi}",
        ]

    @property
    def has_readyz(self) -> bool:
        return False
