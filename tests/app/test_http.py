"""The probe and metrics endpoint, over a real TCP socket on 127.0.0.1."""

from __future__ import annotations

import aiohttp
import pytest

from dra_driver.http import StatusServer
from dra_driver.metrics import Metrics


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
