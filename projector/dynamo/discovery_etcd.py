"""Dynamo's etcd discovery, followed through etcd's v3 JSON gateway.

Dynamo 1.6.1 on etcd keeps its keys unencoded under ``v1/`` (``v1/instances/dynamo/backend/
generate/694da2428b1f6605``), each put under its process's lease (granted TTL 30 s, kept alive
by the process; the worker's instance id is its lease id). A clean exit revokes the lease, a
SIGKILL lets it run out: either way etcd deletes the keys, and a watch sees the deletes. So
liveness here is etcd's own, and nothing is timed on this side.

Reading: ``POST /v3/kv/range`` over the prefix, in pages at one revision, then ``POST
/v3/watch`` from that revision + 1 (the gateway streams one JSON object per line). etcd's
gateway speaks JSON over HTTP/1.1, so this needs an HTTP client and no gRPC stack (httpx).
Keys and values travel in base64; integers as strings.

Faults: ``ETCD_ENDPOINTS`` may name several members; a failed read moves to the next one after
a backoff (0.1 s doubling to 5 s). A watch that breaks resumes from the last revision it saw,
so a change made while it was down is still seen; if etcd has compacted that revision away (or
the store went back in time: a member restored or wiped), the prefix is listed again and the
difference from what was known is handed on as one ``relisted`` batch. While a watch is idle, a
status probe every :data:`PROBE_S` s (and TCP keepalive) finds an endpoint that stopped
answering. An outage is logged once, and once more when it ends; the view is kept meanwhile.

Bounds: a page holds at most :data:`PAGE_KEYS` keys and a response :data:`MAX_RESPONSE_BYTES`
(a page too large is read again in smaller pages, down to one key; a single value too large is
skipped with its reason); watch events come in fragments (``fragment: true``, so each line
stays under the server's request size limit, 1.5 MiB by default) and a line past
:data:`MAX_LINE_BYTES` is refused: the watch is dropped and the prefix listed again.

Not supported: etcd's user/password authentication (``ETCD_AUTH_USERNAME``, refused when set
with one clear line by :mod:`projector.dynamo.discovery_config`); https with the system's CAs,
``ETCD_AUTH_CA`` and a client certificate (``ETCD_AUTH_CLIENT_CERT``, ``ETCD_AUTH_CLIENT_KEY``)
are.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import random
import socket
import ssl
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any, Final

import httpx
import msgspec
from msgspec import Struct, field

from projector.dynamo.discovery import MAX_VALUE_BYTES, PREFIX, DeleteWhy, Emit, RawBatch
from seqstate.errors import SeqstateError

log = logging.getLogger("seqstate.dynamo.discovery")
# httpx says every request at INFO: with a probe every few seconds that would be most of the
# log. Its warnings still show.
logging.getLogger("httpx").setLevel(logging.WARNING)

PAGE_KEYS: Final = 256
MAX_RESPONSE_BYTES: Final = 16 << 20
MAX_LINE_BYTES: Final = 8 << 20
PROBE_S: Final = 5.0
CONNECT_S: Final = 5.0
BACKOFF_S: Final = (0.1, 5.0)


# ---- the gateway's JSON (int64 as strings: decoded with strict=False) -----------------------


class _Header(Struct):
    revision: int = 0


class _KV(Struct):
    key: bytes
    value: bytes = b""
    mod_revision: int = 0


class _Range(Struct):
    header: _Header = field(default_factory=_Header)
    kvs: list[_KV] = field(default_factory=list)
    more: bool = False


class _Event(Struct):
    kv: _KV
    type: str = "PUT"


class _WatchResult(Struct):
    header: _Header = field(default_factory=_Header)
    created: bool = False
    canceled: bool = False
    cancel_reason: str = ""
    compact_revision: int = 0
    fragment: bool = False
    events: list[_Event] = field(default_factory=list)


class _GatewayError(Struct):
    message: str = ""
    code: int = 0


class _WatchLine(Struct):
    result: _WatchResult | None = None
    error: _GatewayError | None = None


class EtcdError(SeqstateError, RuntimeError):
    """etcd answered, but not with what was asked for; retried like a lost connection."""


class _Relist(SeqstateError):
    """The watch cannot resume where it was: list the prefix again."""


class _TooLarge(SeqstateError):
    pass


# gRPC's OUT_OF_RANGE: "mvcc: required revision has been compacted".
_COMPACTED_CODE: Final = 11


def prefix_end(prefix: bytes) -> bytes:
    """etcd's range end for every key starting with ``prefix``."""
    return prefix[:-1] + bytes([prefix[-1] + 1])


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _keepalive_options() -> list[tuple[int, int, int]]:
    """TCP keepalive on every connection: a member gone without a word (power, network) breaks
    an idle watch within about 25 s, rather than never."""
    options = [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)]
    for name, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):
            options.append((socket.IPPROTO_TCP, getattr(socket, name), value))
    return options


class EtcdSource:
    """Every key under ``prefix`` in the etcd cluster at ``endpoints``; see the module."""

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        tls: ssl.SSLContext | None = None,
        prefix: str = PREFIX,
        probe_s: float = PROBE_S,
        page_keys: int = PAGE_KEYS,
        max_response_bytes: int = MAX_RESPONSE_BYTES,
        max_line_bytes: int = MAX_LINE_BYTES,
    ) -> None:
        if not endpoints:
            raise ValueError("etcd discovery needs an endpoint")
        self.endpoints = [e.rstrip("/") for e in endpoints]
        self.tls = tls
        self.prefix = prefix.encode()
        self.probe_s = probe_s
        self.page_keys = page_keys
        self.max_response_bytes = max_response_bytes
        self.max_line_bytes = max_line_bytes
        self.revision = 0  # the last revision seen whole: a watch resumes after it
        self._connected = False
        self._down_since: float | None = None
        self._backoff = BACKOFF_S[0]
        self._client: httpx.AsyncClient | None = None

    def describe(self) -> str:
        return f"etcd discovery at {','.join(self.endpoints)}"

    @property
    def connected(self) -> bool:
        return self._connected

    # ---- the loop --------------------------------------------------------------------------

    async def run(self, emit: Emit) -> None:
        transport = httpx.AsyncHTTPTransport(
            verify=self.tls if self.tls is not None else True,
            socket_options=_keepalive_options(),
        )
        timeout = httpx.Timeout(self.probe_s, connect=CONNECT_S)
        async with httpx.AsyncClient(transport=transport, timeout=timeout) as client:
            self._client = client
            await self._follow(emit)

    async def _follow(self, emit: Emit) -> None:
        first, listed, turn = True, False, 0
        while True:
            endpoint = self.endpoints[turn % len(self.endpoints)]
            try:
                if not listed:
                    puts, skipped, revision = await self._list(endpoint)
                    await emit(RawBatch(puts=puts, snapshot=True, initial=first, skipped=skipped))
                    first, listed, self.revision = False, True, revision
                    self._up(endpoint)
                await self._watch_probed(endpoint, emit)
            except _Relist as exc:
                log.info("discovery: %s: %s; listing %s again", endpoint, exc, self.prefix)
                listed = False
            except (httpx.HTTPError, EtcdError, _TooLarge, OSError, msgspec.DecodeError) as exc:
                self._down(endpoint, exc)
                turn += 1
                await asyncio.sleep(self._backoff * random.uniform(1.0, 1.5))
                self._backoff = min(self._backoff * 2, BACKOFF_S[1])

    def _up(self, endpoint: str) -> None:
        if self._down_since is not None:
            log.info(
                "discovery: etcd reached again at %s after %.1f s",
                endpoint,
                time.monotonic() - self._down_since,
            )
        self._connected, self._down_since, self._backoff = True, None, BACKOFF_S[0]

    def _down(self, endpoint: str, exc: BaseException) -> None:
        self._connected = False
        if self._down_since is None:
            self._down_since = time.monotonic()
            log.warning(
                "discovery: etcd at %s: %s; retrying (every endpoint in turn, backoff up to "
                "%.0f s), discovery as last seen is kept meanwhile",
                endpoint,
                _reason(exc),
                BACKOFF_S[1],
            )
        else:
            log.debug("discovery: etcd at %s: %s", endpoint, _reason(exc))

    # ---- listing -----------------------------------------------------------------------------

    async def _list(self, endpoint: str) -> tuple[dict[str, bytes], dict[str, str], int]:
        """Every key under the prefix at one revision, in pages; values too large skipped."""
        puts: dict[str, bytes] = {}
        skipped: dict[str, str] = {}
        start, end = self.prefix, prefix_end(self.prefix)
        revision, limit = 0, self.page_keys
        while True:
            body: dict[str, Any] = {"key": _b64(start), "range_end": _b64(end), "limit": limit}
            if revision:
                body["revision"] = revision
            try:
                page = msgspec.convert(
                    await self._post(endpoint, "/v3/kv/range", body), _Range, strict=False
                )
            except _TooLarge:
                if limit > 1:
                    limit = max(1, limit // 2)
                    continue
                key = await self._key_at(endpoint, start, end, revision)
                skipped[key.decode(errors="replace")] = (
                    f"a value larger than the {self.max_response_bytes} bytes of a response"
                )
                start = key + b"\x00"
                continue
            revision = revision or page.header.revision
            for kv in page.kvs:
                name = kv.key.decode(errors="replace")
                if len(kv.value) > MAX_VALUE_BYTES:
                    skipped[name] = f"a value larger than {MAX_VALUE_BYTES} bytes"
                else:
                    puts[name] = kv.value
            if not page.more or not page.kvs:
                return puts, skipped, revision
            start, limit = page.kvs[-1].key + b"\x00", self.page_keys

    async def _key_at(self, endpoint: str, start: bytes, end: bytes, revision: int) -> bytes:
        body = {"key": _b64(start), "range_end": _b64(end), "limit": 1, "keys_only": True}
        if revision:
            body["revision"] = revision
        page = msgspec.convert(
            await self._post(endpoint, "/v3/kv/range", body), _Range, strict=False
        )
        if not page.kvs:
            raise EtcdError("a key too large to list vanished")
        return page.kvs[0].key

    async def _post(self, endpoint: str, path: str, body: dict[str, Any]) -> Any:
        """One JSON request, its response read up to :attr:`max_response_bytes`."""
        assert self._client is not None
        async with self._client.stream("POST", endpoint + path, json=body) as response:
            data = bytearray()
            async for chunk in response.aiter_bytes():
                data += chunk
                if len(data) > self.max_response_bytes:
                    raise _TooLarge
        answer = msgspec.json.decode(bytes(data))
        if response.status_code != 200 or not isinstance(answer, dict):
            message = answer.get("message") if isinstance(answer, dict) else None
            code = answer.get("code") if isinstance(answer, dict) else None
            if code == _COMPACTED_CODE:
                raise _Relist(f"revision {body.get('revision')} compacted")
            raise EtcdError(
                f"{path}: HTTP {response.status_code}: {message or bytes(data[:200])!r}"
            )
        return answer

    # ---- watching ----------------------------------------------------------------------------

    async def _watch_probed(self, endpoint: str, emit: Emit) -> None:
        """The watch, with a status probe beside it: whichever ends first ends both."""
        watch = asyncio.create_task(self._watch(endpoint, emit))
        probe = asyncio.create_task(self._probe(endpoint))
        try:
            done, _ = await asyncio.wait({watch, probe}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (watch, probe):
                task.cancel()
            await asyncio.gather(watch, probe, return_exceptions=True)
        for task in done:
            task.result()  # raises what ended it

    async def _probe(self, endpoint: str) -> None:
        while True:
            await asyncio.sleep(self.probe_s)
            await self._post(endpoint, "/v3/maintenance/status", {})

    async def _watch(self, endpoint: str, emit: Emit) -> None:
        assert self._client is not None
        start = self.revision + 1
        request = {
            "create_request": {
                "key": _b64(self.prefix),
                "range_end": _b64(prefix_end(self.prefix)),
                "start_revision": start,
                "fragment": True,
            }
        }
        timeout = httpx.Timeout(self.probe_s, connect=CONNECT_S, read=None)
        async with self._client.stream(
            "POST", endpoint + "/v3/watch", json=request, timeout=timeout
        ) as response:
            if response.status_code != 200:
                raise EtcdError(f"/v3/watch: HTTP {response.status_code}")
            async for line in self._lines(response):
                answer = msgspec.json.decode(line, type=_WatchLine, strict=False)
                if answer.error is not None:
                    raise EtcdError(f"/v3/watch: {answer.error.message}")
                result = answer.result
                if result is None:
                    continue
                if result.compact_revision > 0:
                    raise _Relist(f"revision {start} compacted (now {result.compact_revision})")
                if result.canceled:
                    raise EtcdError(f"watch cancelled: {result.cancel_reason or 'no reason'}")
                if result.created:
                    if result.header.revision < self.revision:
                        raise _Relist(
                            f"the store is at revision {result.header.revision}, behind the "
                            f"{self.revision} already seen"
                        )
                    self._up(endpoint)
                    continue
                await self._events(result.events, emit)
                if not result.fragment:  # a fragment's revision is whole only at the last one
                    self.revision = max(self.revision, result.header.revision)

    @staticmethod
    async def _events(events: list[_Event], emit: Emit) -> None:
        """One response's events as one batch: a key put then deleted in it is deleted."""
        puts: dict[str, bytes] = {}
        deletes: dict[str, DeleteWhy] = {}
        for event in events:
            name = event.kv.key.decode(errors="replace")
            if event.type == "DELETE":
                puts.pop(name, None)
                deletes[name] = "deleted"
            else:
                deletes.pop(name, None)
                puts[name] = event.kv.value
        if puts or deletes:
            await emit(RawBatch(puts=puts, deletes=deletes))

    async def _lines(self, response: httpx.Response) -> AsyncIterator[bytes]:
        """The stream's lines, each at most :attr:`max_line_bytes`."""
        pending = bytearray()
        async for chunk in response.aiter_bytes():
            pending += chunk
            while (cut := pending.find(b"\n")) >= 0:
                line = bytes(pending[:cut])
                del pending[: cut + 1]
                if line.strip():
                    yield line
            if len(pending) > self.max_line_bytes:
                raise _Relist(f"a watch response larger than {self.max_line_bytes} bytes")
        raise EtcdError("the watch stream ended")


def _reason(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text.splitlines()[0][:300]
