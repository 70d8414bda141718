"""Where the control-plane programs are: hack/build-kube.sh builds them when missing and says where.

The pinned versions and the cache layout live in hack/versions.env and hack/build-kube.sh only;
this module asks the script rather than knowing either.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO_ROOT / "hack" / "build-kube.sh"


@dataclass(frozen=True)
class ControlPlaneBinaries:
    kube_version: str  # what the API server's /version reports, e.g. "v1.37.2"
    etcd: Path
    kube_apiserver: Path
    kube_scheduler: Path
    kube_controller_manager: Path
    kubectl: Path


class BuildError(RuntimeError):
    pass


def build_outputs(*components: str) -> dict[str, str]:
    """Runs hack/build-kube.sh for `components` and returns its NAME=VALUE lines.

    Its progress goes to this process's stderr, so a cold build (many minutes) is visible.
    """
    result = subprocess.run([str(BUILD_SCRIPT), *components], stdout=subprocess.PIPE, text=True, check=False)
    if result.returncode != 0:
        raise BuildError(
            f"{BUILD_SCRIPT.relative_to(REPO_ROOT)} {' '.join(components)} failed "
            f"(exit {result.returncode}); its error is printed above"
        )
    return dict(line.split("=", 1) for line in result.stdout.splitlines() if "=" in line)


def ensure_control_plane_binaries() -> ControlPlaneBinaries:
    """The programs of the pinned (or overridden) versions, built first if missing or stale."""
    outputs = build_outputs("kube", "etcd")
    kube = Path(outputs["KUBE_BIN_DIR"])
    return ControlPlaneBinaries(
        kube_version=outputs["KUBE_VERSION"],
        etcd=Path(outputs["ETCD_BIN_DIR"]) / "etcd",
        kube_apiserver=kube / "kube-apiserver",
        kube_scheduler=kube / "kube-scheduler",
        kube_controller_manager=kube / "kube-controller-manager",
        kubectl=kube / "kubectl",
    )
