"""JSON from users, decoded with its nesting bounded: a clear refusal instead of a RecursionError.

A ResourceClaim's opaque config is the user's JSON, and the API server stores objects nested
thousands of levels deep. Python's decoder recurses once per level and gives up near its
recursion limit (about 1,000) with a ``RecursionError``, which no caller expects and whose
message names no limit. The two places such JSON enters the driver, the webhook's
AdmissionReview and the claim prepare reads, decode it here instead: anything nested deeper than
:data:`MAX_DEPTH` levels is refused with a one-line error that names the limit. Our configs nest
4 levels (``sharing.mps.<field>``), NVIDIA's 5, a claim some 8 above its configs' parameters.

The depth is measured on the text first (strings skipped, brackets counted), so the standard
decoder never sees more than :data:`MAX_DEPTH` levels. :func:`loads_pruned` replaces each subtree
below the limit by ``null`` and says whether it did, for a caller (the webhook) that must still
read the rest of the document to answer it.

Every prepare reads its claim through here, so the common case is kept at C speed: the strings
are cut out and the other bytes but brackets dropped by ``re`` and ``bytes.translate``, which
leaves a few dozen brackets to count (a claim of 1 KiB: a fifth of the time of walking its
tokens one by one). Only a document that does go deeper is walked token by token, for the
spans to cut.
"""

from __future__ import annotations

import json
import re
from typing import Any, Final

MAX_DEPTH: Final = 64

# A JSON string, escapes included (written as "unrolled loop": no backtracking per character).
_STRING = rb'"[^"\\]*(?:\\.[^"\\]*)*"'
_STRINGS = re.compile(_STRING, re.DOTALL)
# A string or a bracket; everything else does not nest.
_TOKENS = re.compile(_STRING + rb"|[\[\]{}]", re.DOTALL)
_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))
_OPENING = frozenset(b"[{")


class TooDeep(ValueError):
    """The JSON nests deeper than the driver decodes."""


def too_deep_message(what: str) -> str:
    return (
        f"{what} nests JSON deeper than {MAX_DEPTH} levels, the most the driver decodes (an opaque config "
        "of this driver nests at most 5); flatten the config's parameters"
    )


def loads(data: bytes | str, what: str) -> Any:
    """Decode ``data``; :class:`TooDeep`, naming ``what`` and the limit, when it nests too deep."""
    pruned, deep = loads_pruned(data)
    if deep:
        raise TooDeep(too_deep_message(what))
    return pruned


def loads_pruned(data: bytes | str) -> tuple[Any, bool]:
    """Decode ``data`` with every value deeper than :data:`MAX_DEPTH` replaced by ``null``.

    Returns the document and whether anything was replaced. ``ValueError`` when it is not JSON.
    """
    raw = data.encode() if isinstance(data, str) else data
    cuts = [] if _within_depth(raw) else _deep_spans(raw)
    if not cuts:
        return json.loads(raw), False
    parts, last = [], 0
    for start, end in cuts:
        parts += [raw[last:start], b"null"]
        last = end
    parts.append(raw[last:])
    return json.loads(b"".join(parts)), True


def _within_depth(raw: bytes) -> bool:
    """Whether no container opens below :data:`MAX_DEPTH` (then :func:`_deep_spans` finds none)."""
    brackets = _STRINGS.sub(b"", raw).translate(None, _NOT_BRACKETS)
    depth = 0
    for char in brackets:
        if char in _OPENING:
            depth += 1
            if depth > MAX_DEPTH:
                return False
        else:
            depth -= 1
    return True


def _deep_spans(raw: bytes) -> list[tuple[int, int]]:
    """The byte spans of the outermost containers that open below :data:`MAX_DEPTH`."""
    spans: list[tuple[int, int]] = []
    depth, start = 0, -1
    for token in _TOKENS.finditer(raw):
        char = raw[token.start()]
        if char in b"[{":
            depth += 1
            if depth == MAX_DEPTH + 1:
                start = token.start()
        elif char in b"]}":
            if depth == MAX_DEPTH + 1:
                spans.append((start, token.end()))
            depth -= 1
    if depth > MAX_DEPTH:  # unbalanced: cut to the end and let the decoder say it is not JSON
        spans.append((start, len(raw)))
    return spans
