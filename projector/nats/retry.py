"""Retrying a request across a server restart or a leader election, then giving up loudly.

A request in flight when the server dies never gets its answer, so each attempt has a short
timeout and is repeated (safe for reads, and for publishes with a msg-id); a consumer rides out
a restart of a few seconds instead of failing over a request it could simply ask again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import nats.errors
from nats.js.errors import APIError

from projector.nats.failures import describe

log = logging.getLogger("seqstate")

T = TypeVar("T")
ATTEMPT_TIMEOUT_S = 2.0  # per attempt: a request in flight when the server died never returns
RETRY_FOR_S = 60.0
MAX_BACKOFF_S = 1.0


async def retrying(
    call: Callable[[], Awaitable[T]], what: str, retry_for_s: float = RETRY_FOR_S
) -> T:
    """``await call()``, again after a timeout or a NATS error, for ``retry_for_s`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + retry_for_s
    backoff = 0.05
    while True:
        try:
            return await call()
        except (TimeoutError, nats.errors.Error) as exc:
            if loop.time() >= deadline:
                raise
            log.warning("%s failed, retrying in %.2fs: %s", what, backoff, describe(exc))
        await asyncio.sleep(backoff)
        backoff = min(backoff * 2, MAX_BACKOFF_S)


NO_PEERS = 10005  # "no suitable peers for placement": a cluster with a node not (yet) back
PLACEMENT_WAIT_S = 30.0


async def placing(call: Callable[[], Awaitable[T]], what: str) -> T:
    """``await call()``, a request that places a stream on a cluster's peers: again while the
    cluster answers that no peer can take it (a node restarting, or not yet current after
    rejoining: seconds), for ``PLACEMENT_WAIT_S``; every other answer at once."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + PLACEMENT_WAIT_S
    backoff = 0.1
    said = False
    while True:
        try:
            return await call()
        except APIError as exc:
            if exc.err_code != NO_PEERS or loop.time() >= deadline:
                raise
            if not said:
                said = True
                log.warning("%s: %s; waiting for the cluster's peers", what, describe(exc))
        await asyncio.sleep(backoff)
        backoff = min(backoff * 2, MAX_BACKOFF_S)
