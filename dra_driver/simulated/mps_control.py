"""A stand-in for ``nvidia-cuda-mps-control -d`` on a simulated node (started by :mod:`.mps_daemons`).

What it does, in the order the real daemon and NVIDIA's daemon pod do it:

1. logs its start to ``<root>/log/control.log``;
2. checks the simulated GPUs it serves (``--gpu-state``, the simulator's state file): an MPS server
   needs the full GPU in exclusive-process compute mode (for a MIG device: its parent GPU may be in
   any mode), and a GPU marked broken (``SimulatedBackend.set_mps_broken``) makes it fail -- it
   logs why and exits 1, as the real server does when it cannot create its context;
3. creates its control pipe ``<root>/pipe/control`` (a FIFO, like the real one), applies and logs
   its ``--control`` commands (the default client limits), then writes ``startup.log``: ready --
   after a wait while a GPU it serves is marked slow (``SimulatedBackend.set_mps_held``);
4. runs until SIGTERM, then removes its pipe and exits 0.

Nothing here shares a GPU: there is none. What is real is everything the plugin and the workload
containers see: the directories, the files in them, the process, its readiness and its failure.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

# As in dra_driver.node.sharing.mps; not imported, to keep this process's start small.
READY_FILE = "startup.log"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mps-standin", description=__doc__)
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--devices", required=True, help="comma-separated GPU or MIG uuids")
    parser.add_argument("--gpu-state", type=Path, default=None)
    parser.add_argument("--control", action="append", default=[], help="an nvidia-cuda-mps-control command")
    args = parser.parse_args(argv)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    say(f"starting MPS control daemon (stand-in) pid {os.getpid()} for {args.devices}")
    devices = [uuid for uuid in args.devices.split(",") if uuid]
    problem = check_devices(devices, args.gpu_state) if args.gpu_state else None
    if problem:
        say(f"MPS server failed to start: {problem}")
        return 1
    pipe = args.root / "pipe" / "control"
    if not pipe.exists():
        os.mkfifo(pipe, 0o600)
    for command in args.control:
        say(f"control: {command}")
    if args.gpu_state and held(devices, args.gpu_state):
        say("starting slowly (simulated): waiting until the GPU is no longer held")
        while held(devices, args.gpu_state):
            if stop.wait(0.2):
                return 0
    (args.root / "log" / READY_FILE).write_text("startup complete\n")
    say("startup complete")
    while not stop.wait(3600):
        pass
    pipe.unlink(missing_ok=True)
    say("exiting on SIGTERM")
    return 0


def _gpus(state_file: Path) -> dict[str, Any]:
    try:
        gpus: dict[str, Any] = json.loads(state_file.read_text()).get("gpus", {})
    except (OSError, ValueError):
        return {}  # unreadable: check_devices reports that; nothing is held
    return gpus


def held(devices: list[str], state_file: Path) -> bool:
    """Whether a GPU of ``devices`` (or a MIG device's parent) is marked slow to start MPS."""
    gpus = _gpus(state_file)
    parents = {mig["uuid"]: uuid for uuid, gpu in gpus.items() for mig in gpu.get("migDevices", [])}
    return any(gpus.get(parents.get(device, device), {}).get("mpsHeld") for device in devices)


def check_devices(devices: list[str], state_file: Path) -> str | None:
    """Why an MPS server could not start on ``devices``; None when it can."""
    try:
        state: dict[str, Any] = json.loads(state_file.read_text())
    except FileNotFoundError:
        state = {}
    except (OSError, ValueError) as e:
        return f"cannot read the simulated GPU state {state_file}: {e}"
    gpus: dict[str, Any] = state.get("gpus", {})
    parents = {mig["uuid"]: uuid for uuid, gpu in gpus.items() for mig in gpu.get("migDevices", [])}
    for device in devices:
        gpu_uuid = parents.get(device, device)
        gpu = gpus.get(gpu_uuid, {})
        if gpu.get("mpsBroken"):
            return f"device {device}: the MPS server could not create its context (simulated fault)"
        mode = gpu.get("computeMode", "Default")
        if device == gpu_uuid and mode != "ExclusiveProcess":
            return f"GPU {device} is in compute mode {mode}, not ExclusiveProcess"
    return None


def say(message: str) -> None:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    sys.stdout.write(f"[{stamp}] {message}\n")
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
