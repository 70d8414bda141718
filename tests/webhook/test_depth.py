"""The webhook over HTTP, given a claim whose opaque config nests 3,000 levels deep."""

from __future__ import annotations

import json

from aiohttp.test_utils import TestClient, TestServer

from dra_driver.apiserver.bounded_json import MAX_DEPTH
from dra_driver.webhook.server import webhook_app

DRIVER = "gpu.dra-driver.dev"


def review_of(parameters: str) -> str:
    claim = (
        '{"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": "deep"}, '
        '"spec": {"devices": {"config": [{"opaque": {"driver": "'
        + DRIVER
        + '", "parameters": '
        + parameters
        + "}}]}}}"
    )
    return (
        '{"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {"uid": "u-7", '
        '"operation": "CREATE", "kind": {"kind": "ResourceClaim"}, "object": ' + claim + "}}"
    )


async def post(body: str) -> tuple[int, dict[str, object]]:
    async with TestClient(TestServer(webhook_app(DRIVER))) as client:
        response = await client.post("/validate", data=body, headers={"Content-Type": "application/json"})
        return response.status, await response.json()


async def test_a_3000_deep_config_is_refused_naming_the_limit() -> None:
    status, answer = await post(review_of('{"a":' * 3000 + "1" + "}" * 3000))

    assert status == 200
    response = answer["response"]
    assert isinstance(response, dict)
    assert response["uid"] == "u-7"
    assert response["allowed"] is False
    assert response["status"]["message"] == (
        f"the object nests JSON deeper than {MAX_DEPTH} levels, the most the driver decodes (an opaque "
        "config of this driver nests at most 5); flatten the config's parameters"
    )


async def test_a_config_within_the_limit_is_reviewed_as_before() -> None:
    config = {
        "apiVersion": "resource.dra-driver.dev/v1alpha1",
        "kind": "GpuConfig",
        "sharing": {"strategy": "No"},
    }
    status, answer = await post(review_of(json.dumps(config)))

    assert status == 200
    response = answer["response"]
    assert isinstance(response, dict)
    assert response["allowed"] is False
    assert "sharing.strategy" in response["status"]["message"]
