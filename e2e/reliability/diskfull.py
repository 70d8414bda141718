"""The data and CDI directories out of space (ENOSPC), on a small tmpfs this scenario mounts.

Each round leaves a different amount of free space (none, a little, a few pages), so that the
failure hits a different step: the node's store (its write-ahead log), the CDI spec, the simulated GPU
state behind a MIG device. A prepare and an unprepare are tried while the disk is full, then the
space is given back and the kubelet's retries must succeed. Figures: calls that failed with a
clear error (the claim's answer names the lack of space); calls that failed otherwise, or hung;
damaged files (a store that fails sqlite's integrity check, a spec that is not whole JSON) and temporary
files left behind; claims not recovered once there was space again.

The tmpfs is unmounted whatever happens (the daemon is stopped first). Mounting needs root;
without it the scenario reports itself skipped and why.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import sqlite3
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from e2e.driver import DriverPaths
from e2e.reliability.env import Env
from e2e.reliability.plugin import STORE_FILE_NAME, NodeState

TMPFS_BYTES = 1024 * 1024
FREE_BYTES = (0, 512, 2048, 6144, 12288)  # left free in successive rounds


@dataclass
class DiskFullFigures:
    skipped: str = ""
    rounds: int = 0
    failed_clearly: int = 0
    failed_unclearly: int = 0
    succeeded_while_full: int = 0  # enough space was left for this step: not a fault
    damaged_files: int = 0
    temp_files_left: int = 0
    not_recovered: int = 0
    problems: list[str] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return {
            "diskfull.skipped": self.skipped or None,
            "diskfull.rounds": self.rounds,
            "diskfull.failed_clearly": self.failed_clearly,
            "diskfull.failed_unclearly": self.failed_unclearly,
            "diskfull.succeeded_while_full": self.succeeded_while_full,
            "diskfull.damaged_files": self.damaged_files,
            "diskfull.temp_files_left": self.temp_files_left,
            "diskfull.not_recovered": self.not_recovered,
            "diskfull.problems": self.problems[:20],
        }


def can_mount() -> str:
    """Empty when this process may mount a tmpfs; else why not."""
    if os.geteuid() != 0:
        return "mounting a tmpfs needs root"
    return ""


@contextlib.contextmanager
def tmpfs(path: Path, size: int) -> Iterator[Path]:
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(directory: Path, leave: int) -> Path:
    """A filler file that takes every free byte of ``directory``'s file system but ``leave``."""
    filler = directory / "filler"
    stat = os.statvfs(directory)
    size = max(0, stat.f_bavail * stat.f_frsize - leave)
    with filler.open("wb") as file:
        chunk = b"\0" * 65536
        written = 0
        try:
            while written < size:
                written += file.write(chunk[: min(len(chunk), size - written)])
                file.flush()
        except OSError as error:
            if error.errno != errno.ENOSPC:
                raise
    return filler


async def run(env: Env, rounds: int) -> DiskFullFigures:
    figures = DiskFullFigures(skipped=can_mount())
    if figures.skipped:
        return figures
    node = env.node("rel-diskfull")
    base = env.base / node.name
    with tmpfs(base / "small", TMPFS_BYTES) as small:
        plain = node.paths()
        paths = DriverPaths(
            plugins=plain.plugins,
            registry=plain.registry,
            cdi=small / "cdi",
            data=small / "data",
            driver_root=plain.driver_root,
            boot_id_file=plain.boot_id_file,
        )
        plugin = node.plugin(paths=paths)
        await plugin.start()
        try:
            for number in range(rounds):
                await _round(
                    node, plugin, paths, small, FREE_BYTES[number % len(FREE_BYTES)], figures, number
                )
                figures.rounds += 1
        finally:
            await plugin.stop()
    return figures


async def _round(
    node: Any, plugin: Any, paths: DriverPaths, small: Path, leave: int, figures: DiskFullFigures, number: int
) -> None:
    label = f"round {number} ({leave} bytes free)"
    held, fresh, mig = await asyncio.to_thread(
        lambda: (node.claim("gpu-0"), node.claim("gpu-1"), node.claim(f"gpu-2-mig-1g10gb-19-{number % 7}"))
    )
    if not (await plugin.prepare([held])).ok(held.uid):
        figures.problems.append(f"{label}: could not prepare before filling the disk")
    filler = await asyncio.to_thread(fill, small, leave)
    try:
        for operation, claims in (("prepare", [fresh, mig]), ("unprepare", [held])):
            call = plugin.prepare if operation == "prepare" else plugin.unprepare
            try:
                result = await asyncio.wait_for(call(claims), timeout=50)
            except TimeoutError:
                figures.failed_unclearly += len(claims)
                figures.problems.append(f"{label}: {operation} hung")
                continue
            for claim in claims:
                error = (
                    result.errors.get(claim.uid) if result.transport_error is None else result.transport_error
                )
                if error is None and claim.uid in result.errors:
                    figures.succeeded_while_full += 1
                elif error and "No space left on device" in error:
                    figures.failed_clearly += 1
                else:
                    figures.failed_unclearly += 1
                    figures.problems.append(f"{label}: {operation} of {claim.name}: {error!r}")
        _check_files(paths, figures, label)
    finally:
        filler.unlink()
    # Space again: the kubelet's retries go through.
    for operation, claims in (("prepare", [fresh, mig]), ("unprepare", [held, fresh, mig])):
        call = plugin.prepare if operation == "prepare" else plugin.unprepare
        result = await call(claims)
        for claim in claims:
            if not result.ok(claim.uid):
                figures.not_recovered += 1
                figures.problems.append(
                    f"{label}: {operation} of {claim.name} after space returned: {result}"
                )
    _check_files(paths, figures, label)
    state = NodeState.read(paths, node.name)
    if state.specs or state.records or state.mig_devices:
        figures.not_recovered += 1
        figures.problems.append(f"{label}: left behind {state}")


def _check_files(paths: DriverPaths, figures: DiskFullFigures, label: str) -> None:
    store = paths.data / STORE_FILE_NAME
    if store.exists():
        try:
            db = sqlite3.connect(f"{store.resolve().as_uri()}?mode=ro", uri=True)
            try:
                (verdict,) = db.execute("PRAGMA integrity_check").fetchone()
            finally:
                db.close()
        except sqlite3.Error as error:
            verdict = str(error)
        if verdict != "ok":
            figures.damaged_files += 1
            figures.problems.append(f"{label}: the node's store is damaged: {verdict}")
    for spec in paths.cdi.glob("*.json"):
        try:
            json.loads(spec.read_text())
        except ValueError as error:
            figures.damaged_files += 1
            figures.problems.append(f"{label}: spec {spec.name} damaged: {error}")
    temps = [
        p.name for d in (paths.data, paths.cdi) if d.exists() for p in d.iterdir() if p.name.endswith(".tmp")
    ]
    figures.temp_files_left += len(temps)
    if temps:
        figures.problems.append(f"{label}: temporary files left: {temps}")
        for directory in (paths.data, paths.cdi):  # counted once, not again in the next check
            for name in temps:
                (directory / name).unlink(missing_ok=True)
