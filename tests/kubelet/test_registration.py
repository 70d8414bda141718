"""What the kubelet's plugin watcher sees on the registration socket."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

import pytest

from dra_driver.kubelet.health import HealthBoard
from dra_driver.kubelet.pb.dra.v1 import dra_pb2 as dra_v1
from dra_driver.kubelet.pb.dra.v1 import dra_pb2_grpc as dra_v1_grpc
from dra_driver.kubelet.pb.pluginregistration import registration_pb2 as pb
from dra_driver.kubelet.pb.pluginregistration import registration_pb2_grpc as pb_grpc
from dra_driver.kubelet.server import KubeletPlugin
from dra_driver.kubelet.sockets import PublishedSocket

from .conftest import DRIVER, ScriptedPreparer, channel_to


async def _get_info(plugin: Any) -> pb.PluginInfo:
    async with channel_to(plugin.registration_socket) as channel:
        return await pb_grpc.RegistrationStub(channel).GetInfo(pb.InfoRequest(), timeout=1)


async def test_get_info_describes_a_dra_plugin_with_health(make_plugin: Any, tmp_path: Path) -> None:
    async with make_plugin(health_feed=HealthBoard()) as plugin:
        info = await _get_info(plugin)

    assert info.type == "DRAPlugin"
    assert info.name == DRIVER
    assert info.endpoint == str(tmp_path / "plugins" / DRIVER / "dra.sock")
    assert list(info.supported_versions) == [
        "v1.DRAPlugin",
        "v1beta1.DRAPlugin",
        "v1alpha1.DRAResourceHealth",
        "v1.DRAResourceHealth",
    ]


async def test_get_info_without_a_health_feed_advertises_only_the_dra_services(make_plugin: Any) -> None:
    async with make_plugin() as plugin:
        info = await _get_info(plugin)

    assert list(info.supported_versions) == ["v1.DRAPlugin", "v1beta1.DRAPlugin"]


async def test_the_endpoint_is_absolute_even_for_relative_directories(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    plugin = KubeletPlugin(
        DRIVER, ScriptedPreparer(), plugins_dir=Path("plugins"), registry_dir=Path("registry")
    )
    await plugin.start()
    try:
        info = await _get_info(plugin)
    finally:
        await plugin.stop(grace=None)
    assert info.endpoint == str(tmp_path / "plugins" / DRIVER / "dra.sock")


async def test_the_endpoint_serves_the_dra_plugin(make_plugin: Any) -> None:
    async with make_plugin() as plugin:
        info = await _get_info(plugin)
        async with channel_to(Path(info.endpoint)) as channel:
            response = await dra_v1_grpc.DRAPluginStub(channel).NodePrepareResources(
                dra_v1.NodePrepareResourcesRequest()
            )
    assert dict(response.claims) == {}


async def test_the_dra_socket_accepts_connections_before_the_registration_socket_appears(
    make_plugin: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen_at_registration: list[bool] = []
    publish = PublishedSocket.publish

    def publish_and_probe(self: PublishedSocket) -> None:
        if self.path.name.endswith("-reg.sock"):
            dra_socket = self.path.parent.parent / "plugins" / DRIVER / "dra.sock"
            with socket.socket(socket.AF_UNIX) as probe:
                seen_at_registration.append(probe.connect_ex(os.fspath(dra_socket)) == 0)
        publish(self)

    monkeypatch.setattr(PublishedSocket, "publish", publish_and_probe)
    async with make_plugin():
        pass
    assert seen_at_registration == [True]


async def test_registration_status_is_recorded(make_plugin: Any) -> None:
    async with make_plugin() as plugin, channel_to(plugin.registration_socket) as channel:
        stub = pb_grpc.RegistrationStub(channel)
        assert not plugin.registration.registered.is_set()

        await stub.NotifyRegistrationStatus(pb.RegistrationStatus(plugin_registered=True))
        assert plugin.registration.registered.is_set()
        assert plugin.registration.error is None

        await stub.NotifyRegistrationStatus(
            pb.RegistrationStatus(plugin_registered=False, error="plugin name already registered")
        )
        assert not plugin.registration.registered.is_set()
        assert plugin.registration.error == "plugin name already registered"
