"""Connecting to NATS: one place that dials, so every command reports a failure the same way.

``connect`` is a client that reconnects forever for a service (writer, projector, ``run``) and
gives up quickly for a one-shot command; either way its callbacks log instead of printing
tracebacks. ``nats_for`` starts an embedded nats-server when no URL is configured.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import nats
import nats.errors
from nats.aio.client import Client

from projector.config import Config
from projector.server import NatsServer
from seqstate.errors import SeqstateError

log = logging.getLogger("seqstate")


class ConnectError(SeqstateError, ConnectionError):
    """NATS could not be reached (or refused us); the message says where and why."""


@contextlib.asynccontextmanager
async def connect(url: str, *, service: bool) -> AsyncIterator[Client]:
    """A client that reconnects forever if ``service``, logging instead of printing tracebacks."""

    closing = connected = False

    async def on_error(exc: Exception) -> None:
        if connected:  # before that, the failed connect is reported once, below
            log.warning("nats: %s", exc or type(exc).__name__)

    async def on_disconnect() -> None:
        if not closing:
            log.warning("nats: disconnected, reconnecting")

    async def on_reconnect() -> None:
        log.info("nats: reconnected")

    try:
        nc = await nats.connect(
            url,
            connect_timeout=3,
            allow_reconnect=True,
            max_reconnect_attempts=-1 if service else 3,
            reconnect_time_wait=0.5,
            error_cb=on_error,
            disconnected_cb=on_disconnect,
            reconnected_cb=on_reconnect,
        )
    except (OSError, TimeoutError, nats.errors.NoServersError) as exc:
        raise ConnectError(f"cannot reach NATS at {url}: {exc or type(exc).__name__}") from None
    connected = True
    try:
        yield nc
    finally:
        closing = True
        with contextlib.suppress(Exception):
            await nc.drain()


@contextlib.asynccontextmanager
async def nats_for(
    config: Config, store_dir: Path | None, port: int = -1
) -> AsyncIterator[tuple[Client, str]]:
    """Connect to ``config.nats_url``, or start an embedded server when it is unset.

    The embedded server listens on ``port`` so its URL stays the same across restarts; if the
    port is taken it listens on a free one and says so, rather than not starting.
    """
    if config.nats_url:
        async with connect(config.nats_url, service=True) as nc:
            yield nc, config.nats_url
        return
    if store_dir is None:
        raise ConnectError("NATS_URL is not set (use --nats-url or NATS_URL)")
    async with NatsServer(store_dir, port=port, any_port_if_taken=True) as server:
        if server.fell_back_from is not None:
            log.warning("port %d is taken: the embedded nats-server listens on %s instead",
                        server.fell_back_from, server.url)  # fmt: skip
        log.info("embedded nats-server at %s (export NATS_URL=%s), JetStream in %s",
                 server.url, server.url, store_dir)  # fmt: skip
        async with connect(server.url, service=True) as nc:
            yield nc, server.url


def require_url(config: Config) -> str:
    if not config.nats_url:
        raise ConnectError("NATS_URL is not set (use --nats-url or NATS_URL)")
    return config.nats_url
