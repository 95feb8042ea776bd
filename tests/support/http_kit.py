"""``seqstate serve-http`` as a client meets it: the process started the way docs/http-api.md shows
it (its defaults, but a free port), and raw HTTP/1.1 over a socket, pipelined when asked."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from eventually import eventually
from pipeline_kit import REPO, name_flags

from projector.settings.config import Config

WAIT_S = 30.0
JSON_TYPE = "application/json"
RUNNING: dict[int, subprocess.Popen[bytes]] = {}  # port: its serve-http, for a test to kill


class Reply:
    """One response: ``status``, ``body`` (parsed JSON, None when empty), ``headers`` (lower
    case names), ``raw`` (the body's bytes)."""

    def __init__(self, status: int, headers: dict[str, str], raw: bytes) -> None:
        self.status, self.headers, self.raw = status, headers, raw
        self.body = json.loads(raw) if raw else None

    def __iter__(self) -> Any:  # status, body = reply
        return iter((self.status, self.body))

    def __getitem__(self, index: int) -> Any:
        return (self.status, self.body)[index]

    def __eq__(self, other: object) -> bool:
        return tuple(self) == other if isinstance(other, tuple) else NotImplemented

    def __repr__(self) -> str:
        return f"Reply({self.status}, {self.body!r})"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.asynccontextmanager
async def serve_http(
    url: str,
    config: Config,
    *extra: str,
    host: str | None = "127.0.0.1",
    env: dict[str, str] | None = None,
    token: str | None = None,
    output: Path | None = None,
    descriptors: int | None = None,
) -> AsyncIterator[int]:
    """``seqstate serve-http`` with its defaults but the port; yields the port once /health
    answers. ``host`` None: no ``--host`` (the default address); ``env``: variables beside
    ``NATS_URL``; ``token``: the one /health is asked with; ``output``: a file its output
    goes to (complete once it has stopped); ``descriptors``: its file descriptors at most
    (``ulimit -n``, hard and soft)."""
    port = free_port()
    sink = output.open("wb") if output is not None else subprocess.PIPE

    def limited() -> None:
        if descriptors is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (descriptors, descriptors))

    environ = {k: v for k, v in os.environ.items() if not k.startswith("SEQSTATE_")}
    environ["NATS_URL"] = url
    environ.update(env or {})
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "projector",
            "serve-http",
            *(["--host", host] if host is not None else []),
            "--port",
            str(port),
            *name_flags(config),
            *extra,
        ],
        env=environ,
        cwd=REPO,
        stdout=sink,
        stderr=subprocess.STDOUT,
        preexec_fn=limited if descriptors is not None else None,
    )
    try:

        async def health() -> int:
            status, _ = (await exchange(port, [("GET", "/health", None)], token=token))[0]
            return int(status)

        def running() -> None:
            if proc.poll() is not None:  # its output is complete once it has exited
                out = (proc.stdout.read() if proc.stdout else b"").decode()
                if output is not None:
                    out = output.read_text()
                raise AssertionError(f"serve-http exited with {proc.returncode}\n{out}")

        await eventually(
            health,
            lambda status: status == 200,
            what=f"serve-http answered /health on port {port}",
            timeout=WAIT_S,
            interval=0.05,
            retry_on=(OSError,),  # not listening yet
            check=running,
        )
        RUNNING[port] = proc
        yield port
    finally:
        RUNNING.pop(port, None)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.to_thread(proc.wait, 20)
            except subprocess.TimeoutExpired:
                proc.kill()
        if proc.stdout is not None:
            proc.stdout.close()
        if output is not None and not isinstance(sink, int):
            sink.close()


def request(
    method: str,
    path: str,
    body: Any = None,
    *,
    content_type: str | None = JSON_TYPE,
    raw: bytes | None = None,
    token: str | None = None,
    authorization: str | None = None,
) -> bytes:
    """One request's bytes: ``body`` as JSON, or ``raw`` bytes as they are; ``token`` sends
    ``Authorization: Bearer <token>``, ``authorization`` that header as given."""
    data = raw if raw is not None else b"" if body is None else json.dumps(body).encode()
    head = f"{method} {path} HTTP/1.1\r\nhost: x\r\ncontent-length: {len(data)}\r\n"
    if content_type is not None and (body is not None or raw is not None):
        head += f"content-type: {content_type}\r\n"
    if token is not None:
        authorization = f"Bearer {token}"
    if authorization is not None:
        head += f"authorization: {authorization}\r\n"
    return (head + "\r\n").encode() + data


def register(
    model: str = "Qwen/Qwen3-8B", worker: int = 1, dp_size: int = 1
) -> tuple[str, str, Any]:
    """A ``/register`` call of ``worker`` (block size 16, ranks from 0) for ``model``."""
    body = {
        "model_name": model,
        "worker_id": worker,
        "block_size": 16,
        "dp_start": 0,
        "dp_size": dp_size,
    }
    return ("POST", "/register", body)


async def refused(port: int, data: bytes) -> Reply:
    """Send ``data``, read the answer, and check that the server closed the connection after
    it (EOF, whatever the client had left to send)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        reply = await read_reply(reader)
        assert await asyncio.wait_for(reader.read(), WAIT_S) == b"", "not closed after it"
        assert reply.headers.get("connection") == "close"
        return reply
    finally:
        writer.close()


def kill(port: int) -> None:
    """SIGKILL the serve-http on ``port``: no goodbye, its lease left to expire."""
    proc = RUNNING[port]
    proc.kill()
    proc.wait(10)


async def exchange(
    port: int,
    calls: list[tuple[str, str, Any] | bytes],
    *,
    token: str | None = None,
    address: str = "127.0.0.1",
) -> list[Reply]:
    """Send every call on one connection at once (pipelined), then read the answers in order.
    A call is ``(method, path, JSON body or None)`` (with ``token``: its bearer token) or a
    request's raw bytes."""
    reader, writer = await asyncio.open_connection(address, port)
    try:
        writer.write(
            b"".join(c if isinstance(c, bytes) else request(*c, token=token) for c in calls)
        )
        answers = []
        for call in calls:
            head_only = call.startswith(b"HEAD ") if isinstance(call, bytes) else call[0] == "HEAD"
            answers.append(await read_reply(reader, head_only=head_only))
        return answers
    finally:
        writer.close()


async def read_reply(reader: asyncio.StreamReader, *, head_only: bool = False) -> Reply:
    """The next response on a connection (``head_only``: the answer to a HEAD, no body)."""
    status_line = await asyncio.wait_for(reader.readline(), WAIT_S)
    status = int(status_line.split()[1])
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        headers[name.strip().lower()] = value.strip()
    length = 0 if head_only else int(headers.get("content-length", 0))
    return Reply(status, headers, await reader.readexactly(length))


def rows(answer: Reply | tuple[int, Any]) -> list[tuple[Any, ...]]:
    """``/loads`` rows as (model, worker, rank, prefill tokens, blocks)."""
    status, body = answer
    assert status == 200, answer
    return [
        (
            r["model_name"],
            r["worker_id"],
            r["dp_rank"],
            r["active_prefill_tokens"],
            r["active_decode_blocks"],
        )
        for r in body
    ]


async def http_get(
    port: int, path: str, method: str = "GET", address: str = "127.0.0.1"
) -> tuple[int, str, str]:
    """``(status, content type, body)`` of one request to the metrics port."""
    reader, writer = await asyncio.open_connection(address, port)
    try:
        writer.write(f"{method} {path} HTTP/1.1\r\nhost: localhost\r\n\r\n".encode())
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers.get("content-type", ""), body.decode()


class Readyz:
    """``/readyz`` of a process's metrics port, each answer kept: ``await readyz()`` asks once;
    ``readyz.said()`` (an ``eventually`` watch) shows the last answers and ``log``'s tail."""

    def __init__(self, port: int, log: Path) -> None:
        self.port = port
        self.log = log
        self.answers: list[tuple[int, str]] = []

    async def __call__(self) -> tuple[int, str]:
        status, _, body = await http_get(self.port, "/readyz")
        self.answers.append((status, body))
        return status, body

    def said(self) -> str:
        return f"readyz {self.answers[-3:]}\n{self.log.read_text()[-3000:]}"
