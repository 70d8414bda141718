"""Shared helpers: a scripted ClaimPreparer (the layer below) and a running plugin on real sockets."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest

from dra_driver.kubelet.server import KubeletPlugin
from dra_driver.node.types import ClaimError, ClaimRef, PrepareOutcome

DRIVER = "gpu.dra-driver.dev"


class ScriptedPreparer:
    """Answers with fixed outcomes (or raises) and records every call it gets."""

    def __init__(
        self,
        prepared: Mapping[str, PrepareOutcome] | None = None,
        unprepared: Mapping[str, ClaimError | None] | None = None,
        raises: Exception | None = None,
    ) -> None:
        self.prepared = dict(prepared or {})
        self.unprepared = dict(unprepared or {})
        self.raises = raises
        self.prepare_calls: list[list[ClaimRef]] = []
        self.unprepare_calls: list[list[ClaimRef]] = []

    async def prepare(self, claims: Sequence[ClaimRef]) -> dict[str, PrepareOutcome]:
        self.prepare_calls.append(list(claims))
        if self.raises is not None:
            raise self.raises
        return dict(self.prepared)

    async def unprepare(self, claims: Sequence[ClaimRef]) -> dict[str, ClaimError | None]:
        self.unprepare_calls.append(list(claims))
        if self.raises is not None:
            raise self.raises
        return dict(self.unprepared)


@asynccontextmanager
async def running_plugin(
    tmp_path: Path, preparer: Any = None, **options: Any
) -> AsyncIterator[KubeletPlugin]:
    plugin = KubeletPlugin(
        DRIVER,
        preparer if preparer is not None else ScriptedPreparer(),
        plugins_dir=tmp_path / "plugins",
        registry_dir=tmp_path / "registry",
        **options,
    )
    await plugin.start()
    try:
        yield plugin
    finally:
        await plugin.stop(grace=None)


@asynccontextmanager
async def channel_to(path: Path) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(f"unix:{path}") as channel:
        yield channel


@pytest.fixture
def make_plugin(tmp_path: Path) -> Callable[..., Any]:
    """``async with make_plugin(preparer, **options) as plugin``: a started plugin under tmp_path."""

    def make(preparer: Any = None, **options: Any) -> Any:
        return running_plugin(tmp_path, preparer, **options)

    return make
