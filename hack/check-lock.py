#!/usr/bin/env python3
"""Check that the lock files (requirements/*.txt, written by hack/lock.sh) match pyproject.toml.

make gen-check runs it without the network, in .venv (installed from requirements/dev.txt):
- every pin has at least one sha256, so `pip install --require-hashes` accepts the file;
- every requirement of pyproject.toml (dependencies, the dev extra, [build-system]) and of
  requirements/build.in is pinned, at a version its specifier allows: a range raised in
  pyproject.toml without `make lock` fails here, not at install;
- each lock holds exactly the closure of its roots, as the locked distributions' own metadata
  (read from .venv) declares it: nothing missing, nothing left over from a dependency since dropped;
- a package in both files has one version, so the tests run what the image ships.

Usage: hack/check-lock.py    exit 1, with one line per difference, when the lock is stale
"""

from __future__ import annotations

import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parent.parent
RUNTIME = REPO / "requirements" / "runtime.txt"
DEV = REPO / "requirements" / "dev.txt"
BUILD_IN = REPO / "requirements" / "build.in"
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)")


def read_lock(path: Path) -> tuple[dict[str, str], list[str]]:
    """{package: version} of a pip-compile output, and the problems found reading it."""
    pins: dict[str, str] = {}
    hashed: dict[str, bool] = {}
    problems: list[str] = []
    current = ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if match := _PIN.match(stripped):
            current = canonicalize_name(match[1])
            pins[current] = match[2]
            hashed[current] = "--hash=sha256:" in stripped
        elif stripped.startswith("--hash=sha256:") and current:
            hashed[current] = True
        elif stripped and not stripped.startswith("#"):
            current = ""
            problems.append(f"{path.name}: not a hashed pin: {stripped!r}")
    problems += [f"{path.name}: {name} has no --hash" for name, ok in hashed.items() if not ok]
    return pins, problems


def read_in(path: Path) -> list[Requirement]:
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return [Requirement(line) for line in lines if line]


def closure(roots: list[Requirement], pins: dict[str, str], lock: str) -> tuple[set[str], list[str]]:
    """The packages `roots` need on this interpreter's platform, following the metadata of the
    versions installed in .venv, which must be the locked ones."""
    needed: set[str] = set()
    problems: list[str] = []
    todo = [(requirement, "") for requirement in roots]
    done: set[tuple[str, str]] = set()
    while todo:
        requirement, extra = todo.pop()
        if requirement.marker and not requirement.marker.evaluate({**default_environment(), "extra": extra}):
            continue
        name = canonicalize_name(requirement.name)
        for wanted in ("", *sorted(requirement.extras)):
            if (name, wanted) in done:
                continue
            done.add((name, wanted))
            needed.add(name)
            try:
                installed = importlib.metadata.distribution(name)
            except importlib.metadata.PackageNotFoundError:
                problems.append(f"{lock}: {name} is needed but not installed in .venv: run make venv")
                continue
            if name in pins and installed.version != pins[name]:
                problems.append(
                    f"{lock}: .venv has {name} {installed.version}, the lock {pins[name]}: run make venv"
                )
            todo += [(Requirement(text), wanted) for text in installed.requires or []]
    return needed, problems


def check_roots(roots: list[Requirement], pins: dict[str, str], lock: str) -> list[str]:
    problems = []
    for requirement in roots:
        name = canonicalize_name(requirement.name)
        if name not in pins:
            problems.append(f"{lock}: {requirement} is not pinned")
        elif not requirement.specifier.contains(pins[name], prereleases=True):
            problems.append(f"{lock}: {name}=={pins[name]} does not satisfy {requirement}")
    return problems


def main() -> int:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    runtime_roots = [Requirement(text) for text in pyproject["project"]["dependencies"]]
    dev_roots = [
        *runtime_roots,
        *(Requirement(text) for text in pyproject["project"]["optional-dependencies"]["dev"]),
        *(Requirement(text) for text in pyproject["build-system"]["requires"]),
        *read_in(BUILD_IN),
    ]
    problems: list[str] = []
    locks = {}
    for path, roots in ((RUNTIME, runtime_roots), (DEV, dev_roots)):
        pins, read_problems = read_lock(path)
        locks[path.name] = pins
        problems += read_problems + check_roots(roots, pins, path.name)
        needed, closure_problems = closure(roots, pins, path.name)
        problems += closure_problems
        problems += [f"{path.name}: {name} is needed but not pinned" for name in sorted(needed - pins.keys())]
        extra = sorted(pins.keys() - needed)
        problems += [f"{path.name}: {name} is pinned but nothing needs it" for name in extra]
    runtime, dev = locks[RUNTIME.name], locks[DEV.name]
    problems += [
        f"{name}: {runtime[name]} in runtime.txt but {dev[name]} in dev.txt"
        for name in sorted(runtime.keys() & dev.keys())
        if runtime[name] != dev[name]
    ]
    for problem in problems:
        print(f"check-lock: {problem}", file=sys.stderr)
    if problems:
        print("check-lock: requirements/*.txt do not match pyproject.toml: run make lock", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
