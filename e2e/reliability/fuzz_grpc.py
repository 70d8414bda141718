"""Malformed, huge and hostile NodePrepareResources / NodeUnprepareResources calls over the real socket.

Claim identities carry unicode, NUL, newlines, path separators and ``..`` in namespaces, names and
uids, or are empty or duplicated; some name real allocated claims under a wrong name; some calls are
not protobuf at all; one prepare and one unprepare carry 10,000 claims. The inputs come from a
seeded generator, so ``--seed`` replays a run exactly. Every answer is allowed to be an error -- the
daemon must say the claim is invalid -- but the daemon must not die, and it must write nothing
outside its CDI and data directories: every hostile string carries a marker (``zzescape``) that is
searched for in every file name under the scratch directory and the current directory afterwards.
"""

from __future__ import annotations

import asyncio
import os
import random
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from dra_driver.kubelet.pb.dra.v1 import dra_pb2
from dra_driver.node.types import ClaimRef
from e2e.reliability.env import Env
from e2e.reliability.plugin import NodeState

MARK = "zzescape"
_hostile = [
    "", " ", ".", "..", "/", "../..", f"../../{MARK}", f"..%2f{MARK}", f"/tmp/{MARK}", f"a/../../{MARK}",
    f"{MARK}\x00x", f"{MARK}\n", "é" * 40, "☃" + MARK, "\u202e" + MARK, "x" * 300, MARK * 1000,
    "CON", "-", "a-", "Z" * 64, "\\..\\" + MARK, "gpu-0", "default", "kube-system",
    "default\n", "c\n", "0d7f3c52-1b6e-4bb7-9a1e-0c6a3c1e5b11\n", MARK + "\r\n",
]  # fmt: skip
_METHODS = ("NodePrepareResources", "NodeUnprepareResources")


@dataclass
class GrpcFigures:
    calls: int = 0
    claims_sent: int = 0
    crashes: int = 0  # the daemon exited, or stopped answering
    internal_errors: int = 0  # answers that blame the driver itself ("internal error")
    escapes: int = 0
    huge_call_seconds: float = 0.0
    problems: list[str] = field(default_factory=list)


_ALPHABETS = (
    (0x20, 0x7E),  # printable ASCII, '/' and '.' among them
    (0x00, 0x1F),  # control characters: NUL, newline, escape
    (0xA0, 0x17F),  # Latin-1 and Latin Extended-A
    (0x4E00, 0x4E80),  # CJK
    (0x1F600, 0x1F64F),  # emoji, outside the Basic Multilingual Plane
    (0x202A, 0x202E),  # bidirectional overrides
)


def _unicode(rng: random.Random, length: int) -> str:
    """Random text from a mix of alphabets (valid UTF-8 only: protobuf strings must be)."""
    return "".join(chr(rng.randint(*rng.choice(_ALPHABETS))) for _ in range(length))


def _text(rng: random.Random) -> str:
    choice = rng.random()
    if choice < 0.5:
        return rng.choice(_hostile)
    if choice < 0.8:
        return str(uuid.UUID(int=rng.getrandbits(128)))
    text = _unicode(rng, rng.choice((1, 4, 40, 300)))
    return MARK + text if rng.random() < 0.5 else text


def _claims(rng: random.Random, real: list[ClaimRef]) -> list[dra_pb2.Claim]:
    claims: list[dra_pb2.Claim] = []
    for _ in range(rng.choice((0, 1, 1, 2, 3, 8, 40))):
        if real and rng.random() < 0.3:
            ref = rng.choice(real)
            parts = [ref.namespace, ref.name, ref.uid]
            parts[rng.randrange(3)] = _text(rng)  # a real claim under a wrong identity part
            namespace, name, uid = parts
        else:
            namespace, name, uid = _text(rng), _text(rng), _text(rng)
        claims.append(dra_pb2.Claim(namespace=namespace, name=name, uid=uid))
        if rng.random() < 0.2:
            claims.append(claims[-1])  # duplicate uid in one call
    return claims


async def run(env: Env, calls: int, huge: int, seed: int) -> GrpcFigures:
    rng = random.Random(seed)
    figures = GrpcFigures()
    node = env.node("rel-fuzz")
    plugin = node.plugin()
    real = await asyncio.to_thread(lambda: [node.claim(f"gpu-{i}") for i in range(3)])
    await plugin.start()
    raw = grpc.aio.insecure_channel(f"unix:{plugin.endpoint}")
    try:
        for number in range(calls):
            method = rng.choice(_METHODS)
            if rng.random() < 0.05:
                await _garbage(raw, method, rng, figures)
            else:
                claims = _claims(rng, real)
                request: Any = (
                    dra_pb2.NodePrepareResourcesRequest(claims=claims)
                    if method == "NodePrepareResources"
                    else dra_pb2.NodeUnprepareResourcesRequest(claims=claims)
                )
                figures.claims_sent += len(claims)
                await _send(plugin, method, request, figures, f"call {number}")
            figures.calls += 1
            if not plugin.running:
                figures.crashes += 1
                figures.problems.append(f"call {number}: the daemon died:\n{plugin.tail()}")
                plugin.reap()
                await plugin.start()
        # 10,000 claims in one call: half with plausible identities (each costs an API GET), half hostile.
        huge_claims = [
            dra_pb2.Claim(namespace=node.name, name=f"absent-{i}", uid=str(uuid.uuid4()))
            if i % 2
            else dra_pb2.Claim(namespace=_text(rng), name=_text(rng), uid=_text(rng))
            for i in range(huge)
        ]
        loop = asyncio.get_running_loop()
        for method, request in (
            ("NodePrepareResources", dra_pb2.NodePrepareResourcesRequest(claims=huge_claims)),
            ("NodeUnprepareResources", dra_pb2.NodeUnprepareResourcesRequest(claims=huge_claims)),
        ):
            started = loop.time()
            await _send(plugin, method, request, figures, f"{method} with {huge} claims", deadline=300)
            figures.huge_call_seconds = max(figures.huge_call_seconds, loop.time() - started)
            figures.calls += 1
            figures.claims_sent += huge
        if not plugin.running:
            figures.crashes += 1
            figures.problems.append(f"huge calls: the daemon died:\n{plugin.tail()}")
            plugin.reap()
            await plugin.start()
        # Still serving: the real claims prepare and unprepare.
        prepared = await plugin.prepare(real)
        unprepared = await plugin.unprepare(real)
        if not all(prepared.ok(c.uid) and unprepared.ok(c.uid) for c in real):
            figures.crashes += 1
            figures.problems.append(f"after fuzzing, real claims fail: {prepared} {unprepared}")
    finally:
        await raw.close(grace=None)
        await plugin.stop()
    figures.escapes = _escapes(env.base, plugin, figures)
    state = NodeState.read(plugin.paths, node.name)
    if state.specs or state.records:
        figures.problems.append(f"left behind: specs {sorted(state.specs)}, records {sorted(state.records)}")
        figures.escapes += len(state.specs) + len(state.records)
    return figures


async def _send(
    plugin: Any, method: str, request: Any, figures: GrpcFigures, label: str, deadline: float = 45
) -> None:
    try:
        response = await plugin.raw_call(method, request, deadline=deadline)
    except grpc.aio.AioRpcError as error:
        if error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL):
            figures.crashes += 1
            figures.problems.append(f"{label}: {error.code().name}: {error.details()}")
        return
    for uid, answer in response.claims.items():
        if "internal error" in answer.error:
            figures.internal_errors += 1
            figures.problems.append(f"{label}: claim {uid!r}: {answer.error}")


async def _garbage(channel: grpc.aio.Channel, method: str, rng: random.Random, figures: GrpcFigures) -> None:
    """Bytes that are no protobuf message: the server must refuse the call, and live on."""
    call = channel.unary_unary(f"/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/{method}", None, None)
    try:
        await call(rng.randbytes(rng.randrange(1, 300)), timeout=10)
    except grpc.aio.AioRpcError as error:
        if error.code() == grpc.StatusCode.UNAVAILABLE:
            figures.crashes += 1
            figures.problems.append(f"garbage {method}: {error.details()}")


def _escapes(base: Path, plugin: Any, figures: GrpcFigures) -> int:
    """Files whose name carries the marker anywhere under the scratch dir or the working directory,
    and files in the CDI directory that are not one of the driver's spec names."""
    found = [
        os.path.join(root, name)
        for top in (base, Path.cwd())
        for root, dirs, files in os.walk(top)
        if not {".venv", ".git"} & set(Path(root).parts)
        for name in files + dirs
        if MARK in name
    ]
    # An absolute path smuggled in would land at the top of one of these.
    found += [str(p) for top in (Path("/"), Path("/tmp")) for p in top.iterdir() if MARK in p.name]
    figures.problems.extend(f"file written outside the driver's directories: {path}" for path in found)
    return len(found)
