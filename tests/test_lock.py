"""The supply chain: the lock files every install reads, and the image's audited package list.

make gen-check runs hack/check-lock.py on the repository; these tests show that it refuses what it
should (a pin pyproject.toml no longer allows, a pin without a hash) and that the package list
committed for audit names exactly the Python packages the image installs from the lock.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parent.parent


def _check_lock() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_lock", REPO / "hack" / "check-lock.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


check_lock = _check_lock()


def test_the_committed_lock_matches_pyproject() -> None:
    assert check_lock.main() == 0


def test_a_range_raised_in_pyproject_without_make_lock_is_refused() -> None:
    pins, problems = check_lock.read_lock(check_lock.RUNTIME)
    assert problems == []
    locked = pins["structlog"]
    stale = check_lock.check_roots([Requirement(f"structlog>{locked}")], pins, "runtime.txt")
    assert stale == [f"runtime.txt: structlog=={locked} does not satisfy structlog>{locked}"]
    missing = check_lock.check_roots([Requirement("not-a-locked-package")], pins, "runtime.txt")
    assert missing == ["runtime.txt: not-a-locked-package is not pinned"]


def test_a_pin_without_a_hash_is_refused(tmp_path: Path) -> None:
    lock = tmp_path / "runtime.txt"
    lock.write_text("grpcio==1.85.3\nstructlog==26.1.0 \\\n    --hash=sha256:" + "0" * 64 + "\n")
    pins, problems = check_lock.read_lock(lock)
    assert pins == {"grpcio": "1.85.3", "structlog": "26.1.0"}
    assert problems == ["runtime.txt: grpcio has no --hash"]


def test_the_audited_image_packages_are_the_locked_ones() -> None:
    """hack/build-image.sh compares each build with hack/image/driver-packages.txt; its Python part
    must be what requirements/runtime.txt pins, so a new lock comes with a reviewed list."""
    audited = (REPO / "hack" / "image" / "driver-packages.txt").read_text()
    listed = dict(re.findall(r"^pypi ([^=\s]+)==(\S+)$", audited, re.MULTILINE))
    pins, _ = check_lock.read_lock(check_lock.RUNTIME)
    assert listed == pins
    assert re.search(r"^deb python3\.11=\S+$", audited, re.MULTILINE), "the Debian part lists Python"
