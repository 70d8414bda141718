"""The API client's proxy from the environment: looked up once, and still used for every request.

A fake proxy on 127.0.0.1 answers plain-HTTP proxy requests itself, so the test sees exactly
what the driver's client sends it: the absolute URL of the API server and the proxy's
credentials.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web

from dra_driver.apiserver import kube
from dra_driver.apiserver.connect import API_CONNECTIONS, api_client
from dra_driver.apiserver.rest import JsonApi


@pytest.fixture
async def proxy() -> AsyncIterator[tuple[str, list[web.Request]]]:
    seen: list[web.Request] = []

    async def answer(request: web.Request) -> web.Response:
        seen.append(request)
        return web.json_response({"kind": "Node", "metadata": {"name": "n1", "uid": "u1"}})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"127.0.0.1:{port}", seen
    finally:
        await runner.cleanup()


def _configuration(host: str) -> kube.Configuration:
    configuration = kube.Configuration()
    configuration.host = host
    return configuration


async def test_requests_go_through_the_environments_proxy_with_its_credentials(
    proxy: tuple[str, list[web.Request]], monkeypatch: pytest.MonkeyPatch
) -> None:
    address, seen = proxy
    monkeypatch.setenv("HTTP_PROXY", f"http://user:secret@{address}")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    configuration = _configuration("http://apiserver.invalid:6443")
    kube.resolve_environment_once(configuration)
    client = kube.ApiClient(configuration)
    try:
        for _ in range(2):
            node = await JsonApi(client).get("/api/v1/nodes/n1")
            assert node is not None
            assert node["metadata"]["uid"] == "u1"
    finally:
        await client.close()
    assert [str(r.url) for r in seen] == ["http://apiserver.invalid:6443/api/v1/nodes/n1"] * 2
    assert all(r.headers["Proxy-Authorization"] == "Basic dXNlcjpzZWNyZXQ=" for r in seen)  # user:secret


def test_no_proxy_keeps_the_api_server_direct(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example:3128")
    monkeypatch.setenv("NO_PROXY", "10.96.0.1")
    configuration = _configuration("https://10.96.0.1:443")
    kube.resolve_environment_once(configuration)
    assert configuration.proxy is None
    # The session no longer asks the environment per request, so nothing else proxies it either.
    assert configuration.client_session_kwargs == {"trust_env": False}


def test_the_kubeconfigs_proxy_url_wins_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HTTPS_PROXY", "http://env-proxy.example:3128")
    configuration = _configuration("https://apiserver.example:6443")
    configuration.proxy = "http://kubeconfig-proxy.example:8080"
    kube.resolve_environment_once(configuration)
    assert configuration.proxy == "http://kubeconfig-proxy.example:8080"


def test_without_a_proxy_in_the_environment_nothing_is_proxied(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    configuration = _configuration("https://apiserver.example:6443")
    kube.resolve_environment_once(configuration)
    assert configuration.proxy is None


async def test_a_burst_of_requests_shares_a_few_connections(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What a 200-claim burst does to the API server: without a cap, one connection (one TLS
    # handshake) per request in flight.
    peers: set[object] = set()

    async def answer(request: web.Request) -> web.Response:
        peers.add(request.transport.get_extra_info("peername") if request.transport else None)
        await asyncio.sleep(0.02)  # requests overlap, as the claims of a burst do
        return web.json_response({"metadata": {"uid": "u1"}})

    app = web.Application()
    app.router.add_get("/{tail:.*}", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        f"clusters: [{{name: k, cluster: {{server: 'http://127.0.0.1:{port}'}}}}]\n"
        "users: [{name: u, user: {token: t}}]\n"
        "contexts: [{name: c, context: {cluster: k, user: u}}]\n"
    )
    for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    client = await api_client(kubeconfig)
    try:
        answers = await asyncio.gather(*(JsonApi(client).get(f"/api/v1/nodes/n{i}") for i in range(200)))
    finally:
        await client.close()
        await runner.cleanup()
    assert all(a is not None for a in answers)
    assert len(peers) <= API_CONNECTIONS
