"""``JsonApi.create_as_kubectl`` puts on the wire what kubectl would: compact JSON, keys sorted, sent as
YAML so that the client's transport leaves it as it is and the server decodes it into Go's JSON.

A fake API server on 127.0.0.1 records the request; the real API server's side (a claim of such a
template takes status writes) is e2e/test_compute_domains.py's.
"""

from __future__ import annotations

from aiohttp import web

from dra_driver.apiserver import kube
from dra_driver.apiserver.rest import JsonApi


async def test_the_body_goes_compact_with_sorted_keys_as_yaml() -> None:
    seen: list[tuple[str, bytes]] = []

    async def answer(request: web.Request) -> web.Response:
        seen.append((request.headers["Content-Type"], await request.read()))
        return web.json_response({"metadata": {"name": "t"}}, status=201)

    app = web.Application()
    app.router.add_route("POST", "/{tail:.*}", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    configuration = kube.Configuration()
    configuration.host = f"http://127.0.0.1:{port}"
    client = kube.ApiClient(configuration)
    try:
        body = {"metadata": {"name": "t"}, "spec": {"parameters": {"kind": "X", "apiVersion": "v1"}}}
        created = await JsonApi(client).create_as_kubectl("/apis/example/v1/things", body)
    finally:
        await client.close()
        await runner.cleanup()
    assert created == {"metadata": {"name": "t"}}
    assert seen == [
        (
            "application/yaml",
            b'{"metadata":{"name":"t"},"spec":{"parameters":{"apiVersion":"v1","kind":"X"}}}',
        )
    ]
