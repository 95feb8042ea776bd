"""The metrics port: ``/metrics`` (Prometheus), ``/healthz``, ``/readyz`` and the live page
``/ui``, on one small server.

One asyncio server for the three, in the process's own event loop: a scrape reads the state
between two events, so what it shows is one consistent cut, and ``/healthz`` answering proves
the loop is not stuck. Scrapes and probes are few and tiny, so this is a plain
``asyncio.start_server`` handler (one request per connection, then close), not the pipelined
HTTP/1.1 server of ``serve-http`` (:mod:`projector.http.http_server`), nor a dependency.

- ``/healthz``: 200 while the process is alive (its event loop answers);
- ``/readyz``: 200 once caught up (:meth:`Metrics.readiness`), else 503 with a one-line reason
  such as ``replaying: 52000 events behind (writer of namespace prod)`` or ``nats: disconnected``;
- ``/metrics``: the process's registry in Prometheus's text format;
- ``/ui``: a page of charts (:mod:`projector.ops.ui`) that asks ``/ui/data`` once a second for
  a point read off the consumers' state (JSON; 503 while none runs); ``?namespace=NS`` chooses
  one of the namespaces the process runs consumers of (404 for the page of one it does not);
- anything else is 404; a method other than GET or HEAD is 405.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from http import HTTPStatus
from urllib.parse import parse_qs

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from projector.ops.metrics import Metrics
from projector.ops.ui import live
from projector.settings.config import Config
from seqstate.errors import SeqstateError

log = logging.getLogger("seqstate.metrics")

READ_TIMEOUT_S = 10.0  # a client that sends no request line in time is dropped
HEAD_LIMIT = 16 * 1024  # request line and headers; a scraper's are a few hundred bytes
TEXT = "text/plain; charset=utf-8"
HTML = "text/html; charset=utf-8"
JSON = "application/json"
MAX_QUERY_FIELDS = 4  # /ui takes one, ``namespace``


class MetricsPortError(SeqstateError, OSError):
    """The metrics port cannot be listened on (taken, not an address of this host)."""


def answer(metrics: Metrics, method: str, target: str) -> tuple[int, str, bytes]:
    """``(status, content type, body)`` for one request."""
    if method not in ("GET", "HEAD"):
        return 405, TEXT, b"use GET\n"
    path, _, query = target.partition("?")
    if path == "/metrics":
        return 200, CONTENT_TYPE_LATEST, generate_latest(metrics.registry)
    if path == "/healthz":
        return 200, TEXT, b"ok\n"
    if path == "/readyz":
        ready, why = metrics.readiness()
        return (200 if ready else 503), TEXT, f"{why}\n".encode()
    if path in (live.PAGE_URL, live.DATA_URL):
        try:
            asked = parse_qs(query, max_num_fields=MAX_QUERY_FIELDS).get("namespace", [None])[-1]
        except ValueError:
            return 400, TEXT, f"at most {MAX_QUERY_FIELDS} query fields\n".encode()
        if path == live.PAGE_URL:
            shown = live.page(metrics, asked)
            if shown is None:
                return 404, TEXT, f"{live.not_here(metrics, asked or '')}\n".encode()
            return 200, HTML, shown.encode()
        now = live.point(metrics, asked)
        if now is None:  # it may be starting or restarting: the page asks again
            if asked is None:
                return 503, TEXT, b"starting: no consumer running yet\n"
            return 503, TEXT, f"{live.not_here(metrics, asked)}\n".encode()
        return 200, JSON, json.dumps(now, separators=(",", ":")).encode()
    return 404, TEXT, b"not found: /metrics, /healthz, /readyz, /ui\n"


async def _handle(
    metrics: Metrics, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    try:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), READ_TIMEOUT_S)
        except (
            asyncio.IncompleteReadError,
            asyncio.LimitOverrunError,
            TimeoutError,
            ConnectionError,
        ):
            return
        parts = head.split(b"\r\n", 1)[0].decode("latin-1").split()
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            status, kind, body = 400, TEXT, b"bad request\n"
        else:
            status, kind, body = answer(metrics, parts[0], parts[1])
        lines = [
            f"HTTP/1.1 {status} {HTTPStatus(status).phrase}",
            f"content-type: {kind}",
            f"content-length: {len(body)}",
            "connection: close",
        ]
        if status == 405:
            lines.append("allow: GET, HEAD")
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode())
        if parts and parts[0] != "HEAD":
            writer.write(body)
        with contextlib.suppress(ConnectionError):
            await writer.drain()
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()


@contextlib.asynccontextmanager
async def serving(metrics: Metrics, config: Config) -> AsyncIterator[int | None]:
    """Serve ``metrics`` on ``config.metrics_port`` while inside; yields the port bound (which
    port 0 lets the system choose, so it is logged), or None when the port is off."""
    if config.metrics_port is None:
        yield None
        return
    host = config.metrics_host

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _handle(metrics, reader, writer)

    try:
        server = await asyncio.start_server(handle, host, config.metrics_port, limit=HEAD_LIMIT)
    except OSError as exc:
        raise MetricsPortError(
            f"cannot listen on {host}:{config.metrics_port} for metrics: {exc.strerror or exc}"
        ) from None
    port = int(server.sockets[0].getsockname()[1])
    log.info("metrics on http://%s:%d/metrics (and /healthz, /readyz, /ui)", host, port)
    try:
        yield port
    finally:
        server.close()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(server.wait_closed(), 2.0)
