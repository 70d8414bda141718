"""The probe and metrics endpoint, over a real TCP socket on 127.0.0.1, and whom /metrics answers."""

from __future__ import annotations

import asyncio
from unittest import mock

import aiohttp
import pytest
from aiohttp.test_utils import make_mocked_request

from dra_driver.gpu_plugin.http import StatusServer
from dra_driver.gpu_plugin.metrics import Metrics


async def test_probes_and_metrics() -> None:
    metrics = Metrics()
    reason: list[str | None] = ["not registered with the kubelet yet"]
    server = StatusServer("127.0.0.1:0", metrics, lambda: reason[0])
    await server.start()
    try:
        base = f"http://127.0.0.1:{server.port}"
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{base}/healthz") as response:
                assert response.status == 200
            async with session.get(f"{base}/readyz") as response:
                assert response.status == 503
                assert "not registered" in await response.text()
            reason[0] = None
            async with session.get(f"{base}/readyz") as response:
                assert response.status == 200
            metrics.prepare_done(0.004, ok=True)
            metrics.prepare_done(0.2, ok=False)
            async with session.get(f"{base}/metrics") as response:
                page = await response.text()
        assert 'dra_driver_claim_operations_total{operation="prepare",result="success"} 1.0' in page
        assert 'dra_driver_claim_operations_total{operation="prepare",result="error"} 1.0' in page
        assert 'dra_driver_claim_operation_seconds_count{operation="prepare"} 2.0' in page
    finally:
        await server.stop()


def test_an_address_without_port_is_refused() -> None:
    with pytest.raises(ValueError, match="host:port"):
        StatusServer("localhost", Metrics(), lambda: None)


def _metrics_from(peer: str, *, metrics_public: bool) -> tuple[int, str]:
    """What /metrics answers a connection from ``peer`` (the transport's peer address, which aiohttp
    reads as the request's remote)."""
    server = StatusServer("0.0.0.0:0", Metrics(), lambda: None, metrics_public=metrics_public)
    transport = mock.Mock()
    transport.get_extra_info.side_effect = lambda name, default=None: (
        (peer, 40000) if name == "peername" else default
    )
    request = make_mocked_request("GET", "/metrics", transport=transport)
    response = asyncio.run(server._metrics_page(request))
    return response.status, response.text or ""


@pytest.mark.parametrize("peer", ["127.0.0.1", "127.0.0.53", "::1"])
def test_metrics_are_served_to_localhost_by_default(peer: str) -> None:
    status, page = _metrics_from(peer, metrics_public=False)
    assert status == 200
    assert "dra_driver_prepared_claims" in page


@pytest.mark.parametrize("peer", ["10.244.1.7", "192.168.0.2", "fd00::5"])
def test_metrics_are_refused_to_other_clients_unless_public(peer: str) -> None:
    status, page = _metrics_from(peer, metrics_public=False)
    assert status == 403
    assert "DRA_METRICS_PUBLIC" in page
    assert "dra_driver" not in page
    status, page = _metrics_from(peer, metrics_public=True)
    assert status == 200
    assert "dra_driver_prepared_claims" in page
