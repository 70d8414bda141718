"""Credentials for workloads: ServiceAccount tokens minted by the API server (TokenRequest)."""

from __future__ import annotations

from kubernetes import client


def mint_service_account_token(
    api: client.ApiClient,
    namespace: str,
    service_account: str,
    *,
    expiration_seconds: int = 3600,
    bound_pod: str | None = None,
) -> str:
    """A token that authenticates as system:serviceaccount:<namespace>:<service_account>.

    With `bound_pod` (a Pod in the same namespace) the token is bound to that pod and, once the pod is
    bound to a node, carries the node's name in the user's extra field
    `authentication.kubernetes.io/node-name`: what a driver's kubelet plugin running in a DaemonSet pod
    presents, and what an admission policy can compare with the ResourceSlice it writes.
    """
    core = client.CoreV1Api(api)
    bound_object = None
    if bound_pod is not None:
        pod = core.read_namespaced_pod(bound_pod, namespace)
        uid = pod.metadata.uid if pod.metadata else None
        bound_object = client.V1BoundObjectReference(api_version="v1", kind="Pod", name=bound_pod, uid=uid)
    request = client.AuthenticationV1TokenRequest(
        spec=client.V1TokenRequestSpec(
            audiences=[],  # empty: the API server's own audience
            expiration_seconds=expiration_seconds,
            bound_object_ref=bound_object,
        )
    )
    answer = core.create_namespaced_service_account_token(service_account, namespace, request)
    if answer.status is None or not answer.status.token:
        raise RuntimeError(f"the TokenRequest for {namespace}/{service_account} returned no token")
    return answer.status.token
