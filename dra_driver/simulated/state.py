"""The simulated hardware's state: one JSON file that survives restarts, like a GPU does.

It holds what real GPUs keep between driver restarts: MIG mode, live MIG devices,
injected faults and "processes attached" flags; and the state of the host's own
IMEX service. The daemon and the ``simulate`` CLI change it from separate
processes, so every change is a read-modify-write under an exclusive ``flock`` on
a sibling lock file, and every write is atomic (temp file, fsync, rename, fsync of
the directory). Readers take no lock: a rename is atomic, so they always see one
whole version.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.alias_generators import to_camel

from dra_driver.devices.backend import DeviceError

STATE_VERSION = 1


class _Record(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


class SimMigDevice(_Record):
    uuid: str
    profile_id: int
    start: int  # first memory slice; the size comes from the profile
    gpu_instance_id: int
    compute_instance_id: int
    busy: bool = False  # processes attached: destroying it fails with DeviceInUseError


class SimGpu(_Record):
    mig_enabled: bool = False
    busy: bool = False  # processes use the full GPU: MIG mode cannot be switched on
    xids: list[int] = Field(default_factory=list)  # injected Xid events, oldest first
    compute_mode: str = "Default"  # a ComputeMode value
    time_slice: str = "Default"  # a TimeSlice value
    mps_broken: bool = False  # an MPS server cannot start on this GPU (the `simulate mps` fault)
    mps_held: bool = False  # an MPS server on this GPU is slow to start: not ready until this is cleared
    # How creating a MIG device goes (the `simulate mig-creation` fault): ok; held (the call waits
    # until it is ok or failing again: slow hardware); failing (the call fails).
    mig_creation: Literal["ok", "held", "failing"] = "ok"
    mig_devices: list[SimMigDevice] = Field(default_factory=list)


class SimState(_Record):
    version: int = STATE_VERSION
    # Whose GPUs these are: GPU uuids derive from the node name, models from the profile; a
    # file written before these were recorded has them empty and is taken as its reader's.
    profile: str = ""
    node_name: str = ""
    boot_id: str = ""  # the boot this state belongs to; see SimulatedBackend for what a reboot clears
    mig_serial: int = 0  # MIG devices ever created: makes every MIG uuid unique
    # The host's own nvidia-imex service, which the host-managed IMEX mode relies on (the `simulate
    # host-imex` command): ready, or stopped (its status query fails).
    host_imex: Literal["ready", "stopped"] = "ready"
    gpus: dict[str, SimGpu] = Field(default_factory=dict)  # by GPU uuid

    def gpu(self, uuid: str) -> SimGpu:
        return self.gpus.setdefault(uuid, SimGpu())


class StateFile:
    """The state file at ``path``; a missing file is hardware in its power-on state."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock_path = path.with_name(path.name + ".lock")

    def read(self) -> SimState:
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return SimState()
        except OSError as e:
            raise DeviceError(f"cannot read simulated GPU state {self.path}: {e}") from e
        try:
            state = SimState.model_validate_json(text)
        except ValidationError as e:
            raise DeviceError(
                f"simulated GPU state {self.path} is unreadable ({e.error_count()} errors, first: "
                f"{e.errors()[0]['msg']}); delete the file to power-cycle the simulated GPUs"
            ) from e
        if state.version != STATE_VERSION:
            raise DeviceError(
                f"simulated GPU state {self.path} has version {state.version}, this driver writes "
                f"{STATE_VERSION}; delete the file to power-cycle the simulated GPUs"
            )
        return state

    @contextlib.contextmanager
    def update(self) -> Iterator[SimState]:
        """Yield the current state to change in place; it is written back when the block succeeds.

        DeviceError when the state cannot be written (a file in the way, a full disk): the
        simulated GPUs then stay as they were, as real ones do when a command fails.
        """
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            lock = open(self._lock_path, "a")  # noqa: SIM115 -- closed below, after the block
        except OSError as e:
            raise self._unwritable(e) from e
        with lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed
            state = self.read()
            yield state
            try:
                self._write(state)
            except OSError as e:
                raise self._unwritable(e) from e

    def _unwritable(self, error: OSError) -> DeviceError:
        # mkdir says "File exists" when a file is in the way of the directory.
        problem = f"{self.path.parent} is not a directory" if isinstance(error, FileExistsError) else None
        return DeviceError(
            f"cannot write simulated GPU state {self.path}: {problem or error.strerror or error}; "
            "point --data-dir / DRA_DATA_DIR at a writable directory"
        )

    def _write(self, state: SimState) -> None:
        data = state.model_dump_json(by_alias=True, indent=2).encode()
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name + ".", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        dir_fd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
