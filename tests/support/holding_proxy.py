"""A TCP proxy in front of the nats-server that holds a client at its first publish to a
subject until the test releases it: the way to stop a client at a chosen point whatever the
machine's speed. By default the subject is a Dynamo one, to have Dynamo's Frees land at a
chosen point of ``seqstate dynamo resync`` (after it read the ledger, before its republished
Adds reach anyone); ``hold_at`` names another prefix (a JetStream API request, say).

Every byte is forwarded as it comes, both ways, except that once a client sends
``PUB <prefix>`` (or ``HPUB``), that line and all after it wait for :attr:`release`;
:attr:`held` is set then. A tail that could be the start of such a line waits for the next
read (a line split across reads); any other bytes go at once, so PINGs and the JetStream
API flow while nothing is published.
"""

from __future__ import annotations

import asyncio
import contextlib

PUBLISH = b"PUB namespace."


def _partial(tail: bytes, publish: bytes = PUBLISH) -> int:
    """How many bytes at the end of ``tail`` could begin ``HPUB <subject prefix>``."""
    for size in range(min(len(tail), len(publish) + 1), 0, -1):
        end = tail[-size:]
        if publish.startswith(end) or (b"H" + publish).startswith(end):
            return size
    return 0


class HoldingProxy:
    def __init__(self, upstream_port: int, hold_at: str = "namespace.") -> None:
        self.upstream_port = upstream_port
        self.publish = b"PUB " + hold_at.encode()
        self.held = asyncio.Event()
        self.release = asyncio.Event()
        self.port = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    async def start(self) -> HoldingProxy:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        self.release.set()
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        down = asyncio.create_task(self._pipe(up_reader, writer))
        self._tasks.add(down)
        try:
            await self._up(reader, up_writer)
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            for w in (up_writer, writer):
                w.close()
                with contextlib.suppress(OSError, asyncio.CancelledError):
                    await w.wait_closed()
            down.cancel()
            self._tasks.discard(down)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, asyncio.CancelledError):
            while chunk := await reader.read(65536):
                writer.write(chunk)
                await writer.drain()
        writer.close()

    async def _up(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        pending = b""
        while chunk := await reader.read(65536):
            pending += chunk
            if not self.release.is_set():
                at = pending.find(self.publish)
                if at >= 0:
                    start = at - 1 if at > 0 and pending[at - 1 : at] == b"H" else at
                    writer.write(pending[:start])
                    await writer.drain()
                    pending = pending[start:]
                    self.held.set()
                    await self.release.wait()
                else:
                    keep = _partial(pending, self.publish)
                    writer.write(pending[: len(pending) - keep])
                    await writer.drain()
                    pending = pending[len(pending) - keep :]
                    continue
            writer.write(pending)
            await writer.drain()
            pending = b""
