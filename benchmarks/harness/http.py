"""Raw HTTP/1.1 for the benchmarks that load an HTTP server: one call on a connection of its
own, the process behind a port, and the client connection a load generator builds on.

A generator that formats its requests from byte templates and splits the answers by
``Content-Length`` itself costs a few µs a call; an HTTP client library would cost more than
some of the servers it measures, and share their cores.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from typing import Any


async def one_shot(
    port: int, raw: bytes, timeout: float = 5.0, host: str = "127.0.0.1"
) -> tuple[int, dict[str, str], bytes]:
    """One request on a connection of its own: the status, the headers (lower-case names)
    and the body."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    try:
        writer.write(raw)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
        lines = head.decode("latin-1").split("\r\n")
        headers = {}
        for line in lines[1:]:
            if ":" in line:
                k, v = line.split(":", 1)
                headers[k.strip().lower()] = v.strip()
        n = int(headers.get("content-length", "0"))
        body = await asyncio.wait_for(reader.readexactly(n), timeout) if n else b""
        return int(lines[0].split()[1]), headers, body
    finally:
        writer.close()


def listener_pid(port: int) -> int | None:
    """The process listening on 127.0.0.1:``port`` (a server this script did not start), for
    its CPU per call."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            for line in list(f)[1:]:
                fields = line.split()
                if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(fields[9])
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:[") and link[8:-1] in inodes:
                    return int(pid)
    return None


def content_length(head: bytes) -> int:
    """The ``Content-Length`` of an answer's head (0 if none); the spellings servers send are
    tried before a lower-cased copy of the head is made."""
    i = head.find(b"ontent-length:")
    if i < 0:
        i = head.find(b"ontent-Length:")
        if i < 0:
            i = head.lower().find(b"ontent-length:")
    if i < 0:
        return 0
    j = head.find(b"\r\n", i)
    return int(head[i + 14 : j if j >= 0 else len(head)])


class RawClient(asyncio.Protocol):
    """A load generator's connection: requests written as bytes, no Nagle delay (a call waits
    for its answer), answers split by ``Content-Length``; ``closed`` is done once it is."""

    def __init__(self) -> None:
        self.buf = b""
        self.transport: Any = None
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def answers(self, data: bytes) -> tuple[bytes, list[tuple[int, int]]]:
        """The bytes received so far and each complete answer's ``(start, end)`` in them (its
        status is ``buf[start + 9 : start + 12]``); an incomplete answer waits for more."""
        buf = self.buf + data if self.buf else data
        spans = []
        pos = 0
        while (h := buf.find(b"\r\n\r\n", pos)) >= 0:
            end = h + 4 + content_length(buf[pos:h])
            if end > len(buf):
                break
            spans.append((pos, end))
            pos = end
        self.buf = buf[pos:]
        return buf, spans

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)
