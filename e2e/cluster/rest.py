"""Plain JSON requests to the API server: what it stores and what it says, with no client model between.

The generated `kubernetes` client silently drops fields its models do not know and reshapes error
bodies; a test that checks what the API server keeps of an object, or how it words a rejection, needs
the server's own JSON. Waiting is a watch, not a polling loop.

Bodies go as kubectl sends them (:func:`kubectl_json`), not as `json.dumps` writes them: the API
server keeps the bytes of an opaque config (`spec.devices.config[].opaque.parameters`) as sent, and
Kubernetes 1.34 to 1.37 refuse every later status write of a claim allocated with bytes that are not
Go's own encoding (docs/binding-conditions.md). Tests see what kubectl users see;
e2e/test_claim_status.py sends other bytes on purpose.
"""

from __future__ import annotations

import json
import ssl
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

JsonObject = dict[str, Any]
# Characters Go's encoding/json writes escaped in strings (HTML-safe escaping, and the two line
# separators JavaScript does not allow in a string); Python's json writes them as they are.
_GO_ESCAPED = {"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "\u2028": "\\u2028", "\u2029": "\\u2029"}


def kubectl_json(body: object) -> bytes:
    """`body` encoded as kubectl (and Helm) send it: kubectl reads YAML or JSON into a map and
    encodes it with Go's encoding/json -- compact, map keys sorted, non-ASCII as UTF-8, `<>&`
    escaped, and a float with no fraction written as an integer (`1.0` -> `1`)."""
    text = json.dumps(_go_numbers(body), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    for character, escaped in _GO_ESCAPED.items():  # outside strings JSON has none of them
        text = text.replace(character, escaped)
    return text.encode()


def _go_numbers(value: object) -> object:
    if isinstance(value, dict):
        return {key: _go_numbers(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_go_numbers(item) for item in value]
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e21:  # Go: 'f' format below 1e21
        return int(value)
    return value


class ApiError(Exception):
    """A request the API server refused; `status` is the HTTP code, `body` its Status object."""

    def __init__(self, status: int, body: JsonObject) -> None:
        self.status = status
        self.body = body
        super().__init__(f"HTTP {status} {body.get('reason', '')}: {self.message}")

    @property
    def message(self) -> str:
        return str(self.body.get("message", ""))


class RestClient:
    def __init__(
        self, server: str, token: str, ca_file: Path, *, headers: Mapping[str, str] | None = None
    ) -> None:
        """``headers`` go with every request (e.g. ``Impersonate-User``: the admin acting as another)."""
        self._server = server
        self._token = token
        self._headers = dict(headers or {})
        self._ca_file = ca_file
        self._tls = ssl.create_default_context(cafile=str(ca_file))

    def request(
        self,
        method: str,
        path: str,
        body: JsonObject | bytes | None = None,
        *,
        query: Mapping[str, str] | None = None,
        content_type: str = "application/json",
        timeout_seconds: float = 30.0,
    ) -> JsonObject:
        """``body`` as bytes goes as it is (JSON nested deeper than Python's json encodes)."""
        with self._open(method, path, body, query, content_type, timeout_seconds) as response:
            answer: JsonObject = json.load(response)
            return answer

    def with_headers(self, headers: Mapping[str, str]) -> RestClient:
        """The same client, with `headers` added to (or replacing) its own."""
        return RestClient(self._server, self._token, self._ca_file, headers={**self._headers, **headers})

    def get(self, path: str) -> JsonObject:
        return self.request("GET", path)

    def create(self, collection: str, body: JsonObject) -> JsonObject:
        return self.request("POST", collection, body)

    def delete(self, path: str) -> JsonObject:
        return self.request("DELETE", path)

    def wait_for(
        self,
        collection: str,
        name: str,
        condition: Callable[[JsonObject], bool],
        *,
        timeout_seconds: float = 60.0,
    ) -> JsonObject:
        """Watches object `name` in `collection` until `condition` holds for it and returns it."""
        selector = {"fieldSelector": f"metadata.name={name}"}
        listing = self.request("GET", collection, query=selector)
        last_seen: JsonObject | None = None
        items: list[JsonObject] = listing["items"]
        for item in items:
            last_seen = item
            if condition(item):
                return item
        resource_version = listing["metadata"]["resourceVersion"]
        deadline = time.monotonic() + timeout_seconds
        while (remaining := deadline - time.monotonic()) > 0:
            query = {
                **selector,
                "watch": "true",
                "resourceVersion": resource_version,
                "timeoutSeconds": str(max(1, int(remaining))),  # the server ends the watch; we look again
            }
            with self._open("GET", collection, None, query, "application/json", remaining + 10) as stream:
                for line in stream:
                    event: JsonObject = json.loads(line)
                    if event["type"] == "ERROR":
                        raise ApiError(int(event["object"].get("code", 500)), event["object"])
                    last_seen = event["object"]
                    resource_version = last_seen["metadata"]["resourceVersion"]
                    if event["type"] != "DELETED" and condition(last_seen):
                        return last_seen
        raise TimeoutError(
            f"{collection}/{name} did not reach the awaited state in {timeout_seconds:.0f}s; "
            f"last seen: {json.dumps(last_seen)}"
        )

    def _open(
        self,
        method: str,
        path: str,
        body: JsonObject | bytes | None,
        query: Mapping[str, str] | None,
        content_type: str,
        timeout_seconds: float,
    ) -> Any:
        url = self._server + path + (f"?{urllib.parse.urlencode(query)}" if query else "")
        request = urllib.request.Request(
            url,
            data=None if body is None else body if isinstance(body, bytes) else kubectl_json(body),
            method=method,
            headers={
                "Authorization": f"Bearer {self._token}",
                "Accept": "application/json",
                "Content-Type": content_type,
                **self._headers,
            },
        )
        try:
            return urllib.request.urlopen(request, context=self._tls, timeout=timeout_seconds)
        except urllib.error.HTTPError as error:
            raise ApiError(error.code, _status_of(error)) from None


def _status_of(error: urllib.error.HTTPError) -> JsonObject:
    text = error.read().decode(errors="replace")
    try:
        status: JsonObject = json.loads(text)
    except json.JSONDecodeError:
        return {"message": text}
    return status
