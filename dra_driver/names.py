"""Kubernetes' rules for names and UIDs, in one place: what the kubelet and the API hand the driver.

The identity of a claim (namespace, name, uid), the names of requests, devices and shares become
parts of file names, CDI device names and published objects, so each is checked against one rule
before it is used. The rules are the API server's own (apimachinery's validation): a namespace and
a device or request name is a DNS label (RFC 1123), a ResourceClaim's or a node's name a DNS
subdomain. A UID the API server generates as an RFC 4122 UUID (36 characters of hex digits and
'-'; the kubelet's static-pod UIDs are hex digests): the rule accepts every such UID and nothing
that could step outside a directory or split a name -- no '/', '.', '_', NUL or newline.

Always ``fullmatch``: with ``match``, ``$`` also matches before a trailing newline, and "ns\\n" would
pass.
"""

from __future__ import annotations

import re

DNS_LABEL_MAX_LENGTH = 63
DNS_SUBDOMAIN_MAX_LENGTH = 253
UID_MAX_LENGTH = 64

DNS_LABEL_RULE = "a DNS label: at most 63 lower-case letters, digits and '-', a letter or digit at each end"
DNS_SUBDOMAIN_RULE = (
    "a DNS subdomain: at most 253 characters, DNS labels joined by '.' (lower-case letters, digits, '-')"
)
UID_RULE = (
    "a Kubernetes UID: at most 64 letters, digits and '-', a letter or digit first and last "
    "(the API server's UUIDs always are)"
)

_LABEL = r"[a-z0-9](?:[-a-z0-9]*[a-z0-9])?"
_DNS_LABEL = re.compile(_LABEL)
_DNS_SUBDOMAIN = re.compile(rf"{_LABEL}(?:\.{_LABEL})*")
_UID = re.compile(r"[A-Za-z0-9](?:[-A-Za-z0-9]*[A-Za-z0-9])?")


def is_dns_label(value: str) -> bool:
    """Whether ``value`` is an RFC 1123 label: a namespace, a device, request or counter name."""
    return len(value) <= DNS_LABEL_MAX_LENGTH and _DNS_LABEL.fullmatch(value) is not None


def is_dns_subdomain(value: str) -> bool:
    """Whether ``value`` is an RFC 1123 subdomain: a ResourceClaim's, a node's, a driver's name."""
    return len(value) <= DNS_SUBDOMAIN_MAX_LENGTH and _DNS_SUBDOMAIN.fullmatch(value) is not None


def is_uid(value: str) -> bool:
    """Whether ``value`` is a UID the driver accepts: a claim's, a pod's, an allocation share's."""
    return len(value) <= UID_MAX_LENGTH and _UID.fullmatch(value) is not None
