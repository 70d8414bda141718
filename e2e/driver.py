"""The driver daemon as a node runs it: `python -m dra_driver kubelet-plugin`, a separate process with
simulated GPUs, every path it uses under one directory of the test's.

The directories outlive a run: `restart()` starts the daemon again on the same store, CDI specs
and simulated GPU state, as a restarted DaemonSet pod finds its host paths.
"""

from __future__ import annotations

import sys
import urllib.error
import urllib.request
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from dra_driver.cdi.store import SpecStore
from dra_driver.devices.driver_root import REQUIRED_LIBRARIES
from dra_driver.devices.nvml import NvmlBackend
from dra_driver.devices.types import Inventory
from dra_driver.settings import DEFAULT_DRIVER_NAME
from dra_driver.simulated.gpus import DRIVER_VERSION, SimulatedBackend
from e2e.cluster.controlplane import free_ports
from e2e.daemon import Daemon
from tests.mock_nvml import MockNvml, install_driver_root, install_procfs, mock_environment

DRIVER_NAME = DEFAULT_DRIVER_NAME
MOCK_NVML_DRIVER_VERSION = "550.54.15"  # what NVIDIA's go-nvml DGX mocks report
MOCK_NVML_BLACKWELL_DRIVER_VERSION = "560.28.03"  # what its B200 mock (the GB200 tray) reports


@dataclass(frozen=True)
class DriverPaths:
    """The host paths of one node's driver; the registration directory is the kubelet's."""

    plugins: Path
    registry: Path
    cdi: Path
    data: Path
    driver_root: Path
    boot_id_file: Path

    @classmethod
    def under(cls, base: Path, registry: Path) -> DriverPaths:
        return cls(
            plugins=base / "plugins",
            registry=registry,
            cdi=base / "cdi",
            data=base / "data",
            driver_root=base / "driver-root",
            boot_id_file=base / "boot_id",
        )

    @property
    def mock_nvml_state(self) -> Path:
        """The mock NVML's hardware state, for a node on the NVML backend (shared with the test)."""
        return self.data.parent / "mock-nvml"

    @property
    def procfs(self) -> Path:
        """The kernel driver's /proc for a mock NVML node: the mock writes its capability files here."""
        return self.data.parent / "proc"

    def create(self, *, nvml: bool = False) -> None:
        """The directories, one boot id for every run, and a driver installation to mount from.

        ``nvml``: the driver root holds the mock libnvidia-ml.so.1 where a host keeps NVML, and
        /dev/nvidiactl, so the daemon runs its NVML backend on it.
        """
        for directory in (self.plugins, self.registry, self.cdi, self.data):
            directory.mkdir(parents=True, exist_ok=True)
        if not self.boot_id_file.exists():
            self.boot_id_file.write_text(f"{uuid.uuid4()}\n")
        # The daemon refuses to start without the user-space libraries of the (simulated) driver
        # version: it mounts them into every GPU container. Empty files are enough to be mounted.
        libraries = self.driver_root / "usr" / "lib64"
        libraries.mkdir(parents=True, exist_ok=True)
        versions = (
            (MOCK_NVML_DRIVER_VERSION, MOCK_NVML_BLACKWELL_DRIVER_VERSION) if nvml else (DRIVER_VERSION,)
        )
        for library in REQUIRED_LIBRARIES:
            for version in versions:
                (libraries / f"{library}.so.{version}").touch()
        if nvml:
            install_driver_root(self.driver_root)
            install_procfs(self.procfs)


class DriverProcess:
    """One node's driver daemon; `start()` returns once /readyz answers 200.

    Ready means registered with the kubelet and the node's ResourceSlices published, so a kubelet
    harness for the same registration directory must be running.
    """

    def __init__(
        self,
        *,
        kubeconfig: Path,
        node_name: str,
        paths: DriverPaths,
        log: Path,
        profile: str = "dgx-h100",
        extra_args: Sequence[str] = (),
        mock_nvml: str | None = None,
        driver_name: str = DRIVER_NAME,
        wrapper: Sequence[str] = (),
    ) -> None:
        """``mock_nvml``: a machine of the mock libnvidia-ml.so.1 (e.g. ``dgxh100``) to run the NVML
        backend on, instead of the simulator's ``profile``. ``wrapper``: a command line the daemon's
        own is appended to (e.g. ``env VAR=value``)."""
        self.node_name = node_name
        self.driver_name = driver_name
        self.paths = paths
        self.profile = profile
        self.mock_nvml = mock_nvml
        self._kubeconfig = kubeconfig
        self._extra_args = tuple(extra_args)
        self._wrapper = tuple(wrapper)
        self._daemon = Daemon(f"dra-driver[{node_name}]", log)
        self._port: int | None = None
        self.specs = SpecStore(paths.cdi, driver_name)

    @property
    def daemon(self) -> Daemon:
        return self._daemon

    @property
    def running(self) -> bool:
        return self._daemon.running

    def start(self, timeout_seconds: float = 60.0) -> None:
        self.paths.create(nvml=self.mock_nvml is not None)
        (self._port,) = free_ports(1)
        self._daemon.start(self._argv(self._port), lambda _: self._ready(), timeout_seconds=timeout_seconds)

    def stop(self) -> int | None:
        """SIGTERM; the exit status (0 for a clean shutdown), None if it was not running."""
        return self._daemon.stop()

    def restart(self) -> int | None:
        """Stops the daemon and starts it again on the same directories; the exit status of the stop."""
        status = self.stop()
        self.start()
        return status

    def readiness(self) -> tuple[int, str]:
        """/readyz: (HTTP status, body); (0, why) when nothing answers."""
        try:
            with urllib.request.urlopen(self._url("/readyz"), timeout=2) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as error:
            return error.code, error.read().decode(errors="replace")
        except OSError as error:
            return 0, str(error)

    def metric(self, name: str, **labels: str) -> float:
        """The value of one sample on /metrics, 0 when the daemon has not exported it yet."""
        with urllib.request.urlopen(self._url("/metrics"), timeout=5) as response:
            text = response.read().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and sample.labels == labels:
                    return float(sample.value)
        return 0.0

    def spec_path(self, claim_uid: str) -> Path:
        """Where the CDI spec of a claim prepared on this node lives."""
        return self.specs.path_for(claim_uid)

    def prepared_claim_uids(self) -> set[str]:
        """Claims with a CDI spec on this node: what the container runtime could still inject."""
        return self.specs.claim_uids()

    def simulated_gpus(self) -> Inventory:
        """The node's GPUs as the simulator (or the mock NVML) holds them now: what NVML would report
        on a real node."""
        backend: SimulatedBackend | NvmlBackend
        if self.mock_nvml is not None:
            MockNvml().configure(self.mock_nvml, self.paths.mock_nvml_state, proc_root=self.paths.procfs)
            root = self.paths.driver_root
            backend = NvmlBackend(driver_root=root, dev_root=root, procfs_root=self.paths.procfs)
            try:
                return backend.inventory()
            finally:
                backend.close()
        backend = SimulatedBackend(self.profile, self.node_name, self.paths.data)
        try:
            return backend.inventory()
        finally:
            backend.close()

    def _ready(self) -> bool:
        status, _ = self.readiness()
        return status == 200

    def _url(self, path: str) -> str:
        if self._port is None:
            raise RuntimeError(f"the driver of {self.node_name} was never started")
        return f"http://127.0.0.1:{self._port}{path}"

    def _argv(self, port: int) -> list[str]:
        paths = self.paths
        if self.mock_nvml is None:
            launcher = [sys.executable]
            backend = [f"--simulate={self.profile}"]
        else:  # the NVML backend, on the mock's machine whose state the test shares
            environment = mock_environment(paths.mock_nvml_state, self.mock_nvml, paths.procfs)
            launcher = [
                "env",
                *(f"{k}={environment[k]}" for k in sorted(environment) if k.startswith("MOCK_NVML_")),
            ]
            launcher.append(sys.executable)
            backend = [f"--procfs-root={paths.procfs}"]  # where the mock keeps the MIG capability files
        return [
            *self._wrapper,
            *launcher,
            "-m",
            "dra_driver",
            "kubelet-plugin",
            f"--node-name={self.node_name}",
            f"--driver-name={self.driver_name}",
            *backend,
            f"--kubeconfig={self._kubeconfig}",
            f"--plugins-dir={paths.plugins}",
            f"--registry-dir={paths.registry}",
            f"--cdi-dir={paths.cdi}",
            f"--data-dir={paths.data}",
            f"--driver-root={paths.driver_root}",
            f"--boot-id-file={paths.boot_id_file}",
            f"--http-address=127.0.0.1:{port}",
            "--log-format=console",
            *self._extra_args,
        ]
