"""The plugin's socket files: names, permissions, stale files, neighbours and path limits."""

from __future__ import annotations

import os
import re
import socket
import stat
from pathlib import Path
from typing import Any

import pytest

from dra_driver.kubelet.pb.dra.v1 import dra_pb2 as dra_v1
from dra_driver.kubelet.pb.dra.v1 import dra_pb2_grpc as dra_v1_grpc
from dra_driver.kubelet.pb.pluginregistration import registration_pb2 as pb
from dra_driver.kubelet.pb.pluginregistration import registration_pb2_grpc as pb_grpc
from dra_driver.kubelet.server import KubeletPlugin
from dra_driver.kubelet.sockets import KubeletSocketError

from .conftest import DRIVER, ScriptedPreparer, channel_to


def _bind_socket_file(path: Path) -> None:
    """Leave a socket file at ``path`` with nobody listening, as a crashed instance would."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(os.fspath(path))


def _files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


async def _answers(path: Path) -> bool:
    async with channel_to(path) as channel:
        info = await pb_grpc.RegistrationStub(channel).GetInfo(pb.InfoRequest(), timeout=5)
    return info.name == DRIVER


async def test_sockets_have_the_kubelet_names_and_owner_only_permissions(
    make_plugin: Any, tmp_path: Path
) -> None:
    async with make_plugin() as plugin:
        assert plugin.dra_socket == tmp_path / "plugins" / DRIVER / "dra.sock"
        assert plugin.registration_socket == tmp_path / "registry" / f"{DRIVER}-reg.sock"
        for path in (plugin.dra_socket, plugin.registration_socket):
            mode = path.lstat().st_mode
            assert stat.S_ISSOCK(mode)
            assert stat.S_IMODE(mode) == 0o600
        # No temporary names left for the plugin watcher to trip over.
        assert _files(tmp_path / "registry") == [f"{DRIVER}-reg.sock"]
        assert _files(tmp_path / "plugins" / DRIVER) == ["dra.sock"]


async def test_a_pod_uid_gives_the_instance_names_of_its_own(make_plugin: Any, tmp_path: Path) -> None:
    async with make_plugin(pod_uid="pod-a") as plugin:
        assert plugin.dra_socket == tmp_path / "plugins" / DRIVER / "dra-pod-a.sock"
        assert plugin.registration_socket == tmp_path / "registry" / f"{DRIVER}-pod-a-reg.sock"
        assert await _answers(plugin.registration_socket)


async def test_stop_removes_its_own_sockets_and_leaves_a_neighbours(make_plugin: Any, tmp_path: Path) -> None:
    neighbour_dra = tmp_path / "plugins" / DRIVER / "dra-pod-b.sock"
    neighbour_registration = tmp_path / "registry" / f"{DRIVER}-pod-b-reg.sock"
    _bind_socket_file(neighbour_dra)
    _bind_socket_file(neighbour_registration)

    async with make_plugin(pod_uid="pod-a"):
        pass

    assert _files(tmp_path / "plugins" / DRIVER) == ["dra-pod-b.sock"]
    assert _files(tmp_path / "registry") == [f"{DRIVER}-pod-b-reg.sock"]


async def test_stop_leaves_a_socket_another_instance_put_at_our_path(make_plugin: Any) -> None:
    async with make_plugin() as plugin:
        # A second instance (same names, no pod UIDs) starts and takes the paths over.
        for path in (plugin.dra_socket, plugin.registration_socket):
            path.unlink()
            _bind_socket_file(path)
        replaced = {path: path.lstat().st_ino for path in (plugin.dra_socket, plugin.registration_socket)}

    for path, inode in replaced.items():
        assert path.lstat().st_ino == inode


async def test_a_stale_socket_of_ours_is_replaced(make_plugin: Any, tmp_path: Path) -> None:
    stale = tmp_path / "registry" / f"{DRIVER}-reg.sock"
    _bind_socket_file(stale)
    _bind_socket_file(tmp_path / "plugins" / DRIVER / "dra.sock")
    stale_inode = stale.lstat().st_ino

    async with make_plugin() as plugin:
        assert plugin.registration_socket == stale
        assert stale.lstat().st_ino != stale_inode
        assert await _answers(stale)


async def test_a_file_that_is_not_a_socket_is_not_replaced(tmp_path: Path) -> None:
    blocker = tmp_path / "registry" / f"{DRIVER}-reg.sock"
    blocker.parent.mkdir()
    blocker.write_text("not a socket")
    plugin = KubeletPlugin(
        DRIVER, ScriptedPreparer(), plugins_dir=tmp_path / "plugins", registry_dir=tmp_path / "registry"
    )

    with pytest.raises(KubeletSocketError, match=re.escape(f"{blocker} exists and is not a socket")):
        await plugin.start()

    assert blocker.read_text() == "not a socket"
    # The DRA socket that was already serving is gone again.
    assert _files(tmp_path / "plugins" / DRIVER) == []


def _plugins_dir_for_dra_socket_of(length: int, tmp_path: Path) -> Path:
    """A plugins directory under tmp_path whose DRA socket path is exactly ``length`` bytes."""
    fixed = len(os.fsencode(tmp_path / "x" / DRIVER / "dra.sock")) - 1
    return tmp_path / ("x" * (length - fixed))


def test_a_socket_path_too_long_for_the_kernel_is_refused_up_front(tmp_path: Path) -> None:
    plugins_dir = _plugins_dir_for_dra_socket_of(108, tmp_path)
    too_long = plugins_dir / DRIVER / "dra.sock"
    with pytest.raises(KubeletSocketError, match=re.escape(f"unix socket path {too_long} is 108 bytes")):
        KubeletPlugin(DRIVER, ScriptedPreparer(), plugins_dir=plugins_dir, registry_dir=tmp_path)


async def test_a_socket_path_of_the_maximum_length_is_served(tmp_path: Path) -> None:
    plugins_dir = _plugins_dir_for_dra_socket_of(107, tmp_path)
    plugin = KubeletPlugin(DRIVER, ScriptedPreparer(), plugins_dir=plugins_dir, registry_dir=tmp_path / "r")
    await plugin.start()
    try:
        assert len(os.fsencode(plugin.dra_socket)) == 107
        async with channel_to(plugin.dra_socket) as channel:
            response = await dra_v1_grpc.DRAPluginStub(channel).NodeUnprepareResources(
                dra_v1.NodeUnprepareResourcesRequest()
            )
        assert dict(response.claims) == {}
    finally:
        await plugin.stop(grace=None)


def test_the_default_paths_fit_with_a_pod_uid() -> None:
    plugin = KubeletPlugin(DRIVER, ScriptedPreparer(), pod_uid="0f6a4c1e-9b2d-4e7a-8c3f-5d1e2b3a4c5d")
    assert plugin.registration_socket == Path(
        f"/var/lib/kubelet/plugins_registry/{DRIVER}-0f6a4c1e-9b2d-4e7a-8c3f-5d1e2b3a4c5d-reg.sock"
    )
    assert plugin.dra_socket == Path(
        f"/var/lib/kubelet/plugins/{DRIVER}/dra-0f6a4c1e-9b2d-4e7a-8c3f-5d1e2b3a4c5d.sock"
    )


async def test_stop_twice_is_harmless(tmp_path: Path) -> None:
    plugin = KubeletPlugin(
        DRIVER, ScriptedPreparer(), plugins_dir=tmp_path / "plugins", registry_dir=tmp_path / "registry"
    )
    await plugin.start()
    await plugin.stop(grace=None)
    await plugin.stop(grace=None)
    assert not plugin.dra_socket.exists()
    assert not plugin.registration_socket.exists()
