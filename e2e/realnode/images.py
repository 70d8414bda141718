"""The images a real node runs, from the OCI archives `make image` writes (hack/build-image.sh).

They are imported into the node's containerd under fixed names and never pulled: pods name them
with imagePullPolicy Never or IfNotPresent.
"""

from __future__ import annotations

import re
import tarfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from e2e.cluster.binaries import REPO_ROOT

ARCHIVE_DIR = REPO_ROOT / "_output" / "images"
_CHART = REPO_ROOT / "charts" / "dra-driver-gpu" / "Chart.yaml"


def chart_app_version() -> str:
    match = re.search(r'^appVersion:\s*"?([^"\s]+)"?', _CHART.read_text(), re.MULTILINE)
    if match is None:
        raise RuntimeError(f"no appVersion in {_CHART}")
    return match.group(1)


@dataclass(frozen=True)
class ImageArchive:
    name: str  # driver, pause, workload: the archive _output/images/<name>.oci.tar
    repository: str  # the name containerd knows it by
    path: Path
    tag: str

    @property
    def reference(self) -> str:
        return f"{self.repository}:{self.tag}"

    def check(self) -> None:
        """A clear error when the archive is missing or not an OCI layout (a failed build)."""
        from e2e.realnode.node import RealNodeError

        if not self.path.is_file():
            raise RealNodeError(f"no {self.name} image at {self.path}; build it with `make image` (as root)")
        try:
            with tarfile.open(self.path) as archive:
                names = {name.removeprefix("./") for name in archive.getnames()}
        except (tarfile.TarError, OSError):
            names = set()
        if not {"oci-layout", "index.json"} <= names:
            raise RealNodeError(
                f"{self.path} is not an OCI image archive (a failed build?); run `make image` again"
            )

    def import_args(self) -> list[str]:
        # The archive's one image is tagged `tag`; --base-name names it repository:tag.
        return ["images", "import", "--base-name", self.repository, "--digests=false", str(self.path)]


IMAGES: Mapping[str, str] = {
    "driver": "localhost/dra-driver-gpu",
    "pause": "localhost/dra-driver-pause",
    "workload": "localhost/dra-driver-workload",
}


def image_archives(directory: Path = ARCHIVE_DIR, tag: str | None = None) -> dict[str, ImageArchive]:
    version = tag or chart_app_version()
    return {
        name: ImageArchive(name, repository, directory / f"{name}.oci.tar", version)
        for name, repository in IMAGES.items()
    }
