"""The validating webhook on the real API server: a misspelt opaque config is refused when the claim
is created, with the message the driver gives at prepare, instead of a pod that never starts.

The webhook runs here as `dra-driver webhook` on 127.0.0.1 with a certificate of the test's own; the
API server calls it through a ValidatingWebhookConfiguration as the chart's (webhook.enabled) does,
for a driver name of this module's own and only in namespaces the test labels, so other modules'
claims are not affected.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from e2e.cluster import ApiError, ClusterInfo, JsonObject, RestClient
from e2e.daemon import wait_until
from e2e.manifests import collection
from e2e.webhook import running_webhook
from e2e.webhook import self_signed as self_signed  # re-exported: it was defined here first

pytestmark = pytest.mark.e2e

DRIVER = "gpu.webhook-e2e.dev"
SELECTOR_LABEL = "webhook-e2e.dra-driver.dev/checked"


@pytest.fixture(scope="module")
def webhook(cluster: ClusterInfo, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """No --kubeconfig and not in a pod: opaque configs are checked, capacity requests are not."""
    with running_webhook(
        cluster,
        tmp_path_factory.mktemp("webhook"),
        driver=DRIVER,
        name="webhook-e2e",
        selector_label=SELECTOR_LABEL,
    ):
        yield


@pytest.fixture
def checked_namespace(rest: RestClient, webhook: None) -> Iterator[str]:
    name = f"webhook-{uuid.uuid4().hex[:8]}"
    rest.create("/api/v1/namespaces", {"metadata": {"name": name, "labels": {SELECTOR_LABEL: "true"}}})
    yield name
    rest.delete(f"/api/v1/namespaces/{name}")


def claim(name: str, parameters: dict[str, Any]) -> JsonObject:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name},
        "spec": {
            "devices": {
                "requests": [{"name": "gpu", "exactly": {"deviceClassName": "any.example.com"}}],
                "config": [{"requests": ["gpu"], "opaque": {"driver": DRIVER, "parameters": parameters}}],
            }
        },
    }


def create_when_enforced(rest: RestClient, namespace: str, obj: JsonObject) -> ApiError | None:
    """Creates `obj`; the API server may take a moment to call a new webhook, so a refusal is waited for."""
    try:
        rest.create(collection(obj["kind"], namespace), obj)
    except ApiError as error:
        return error
    return None


MISSPELT = {
    "apiVersion": "resource.dra-driver.dev/v1alpha1",
    "kind": "GpuConfig",
    "sharing": {"strategy": "TimeSlicing", "timeslicing": {"interval": "Long"}},
}


def refusal_of_a_misspelt_config(rest: RestClient, namespace: str) -> ApiError:
    """Waits until the API server calls the webhook: until then a misspelt config is accepted."""

    def refused() -> ApiError | None:
        name = f"bad-{uuid.uuid4().hex[:6]}"
        error = create_when_enforced(rest, namespace, claim(name, MISSPELT))
        if error is None:
            rest.delete(f"{collection('ResourceClaim', namespace)}/{name}")
        return error

    return wait_until(refused, timeout_seconds=30, waiting_for="the webhook to refuse the claim")


def test_a_misspelt_config_is_refused_at_creation_with_prepares_message(
    rest: RestClient, checked_namespace: str
) -> None:
    error = refusal_of_a_misspelt_config(rest, checked_namespace)
    assert error.status == 422
    assert (
        f"opaque config for {DRIVER}: config[0] (FromClaim, all requests): sharing.timeslicing: "
        "Extra inputs are not permitted" in error.message
    )


def test_valid_configs_of_both_apis_are_accepted(rest: RestClient, checked_namespace: str) -> None:
    # Before the API server calls the webhook every config is accepted: prove it is called first.
    refusal_of_a_misspelt_config(rest, checked_namespace)
    ours = {
        "apiVersion": "resource.dra-driver.dev/v1alpha1",
        "kind": "GpuConfig",
        "sharing": {"strategy": "MPS"},
    }
    nvidias = {
        "apiVersion": "resource.nvidia.com/v1beta1",
        "kind": "GpuConfig",
        "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}},
    }
    rest.create(collection("ResourceClaim", checked_namespace), claim("ours", ours))
    rest.create(collection("ResourceClaim", checked_namespace), claim("nvidias", nvidias))


def test_nvidias_unsupported_kinds_are_refused_with_the_reason(
    rest: RestClient, checked_namespace: str
) -> None:
    channel = {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "ComputeDomainChannelConfig"}
    template = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": "channel"},
        "spec": {"spec": claim("x", channel)["spec"]},
    }
    error = wait_until(
        lambda: create_when_enforced(rest, checked_namespace, template),
        timeout_seconds=30,
        waiting_for="the webhook to refuse the template",
    )
    assert error.status == 422
    assert "ComputeDomains (IMEX channels) are served by the compute-domain driver" in error.message
