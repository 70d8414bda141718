"""Fixtures of the node layer's tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from .builders import Node, make_node


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    """A simulated node (2x H100, 2x A100, 2x L4) with its CDI dir, checkpoint and boot id in tmp_path."""
    made = make_node(tmp_path)
    yield made
    made.stop_mps_daemons()  # no stand-in MPS daemon outlives its test
