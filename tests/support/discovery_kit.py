"""Dynamo 1.6.1's discovery records, written as Dynamo writes them, and a follower watched.

The records are built from those observed on a live 1.6.1 fleet (one mocker with
``--data-parallel-size 2``, one KV-router frontend with replica sync), kept verbatim in
``tests/data/dynamo_discovery_1.6.1.json``: each helper takes an observed value of its kind and
gives it other ids, so every field Dynamo writes (and its order) is what a test writes. Keys are
etcd's (unencoded); :func:`file_name` is the file Dynamo's ``DYN_FILE_KV`` store would hold the
key in (every byte but ASCII letters and digits percent-encoded), and :func:`write_file` writes
it as Dynamo does (whole, under ``.tmp_...``, then renamed into place).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from eventually import eventually

from projector.dynamo.discovery import ChangeBatch, Delete, DiscoveryFollower, Put, Record

DATA = Path(__file__).resolve().parent.parent / "data" / "dynamo_discovery_1.6.1.json"
_OBSERVED: dict[str, Any] = json.loads(DATA.read_text())["files"]
NS, COMPONENT, NAME = "dynamo", "backend", "generate"
TOPIC = "active_sequences_events"


def _observed(bucket: str, *, kind: str, topic: str | None = None) -> dict[str, Any]:
    """An observed value of ``bucket``: of type ``kind``, on ``topic`` if given, for the
    ``generate`` endpoint (not a worker's query endpoint)."""
    for name, value in _OBSERVED.items():
        if not name.startswith(f"v1/{bucket}/") or value["type"] != kind:
            continue
        if topic is not None and value.get("topic") != topic:
            continue
        if kind == "Endpoint" and value["endpoint"] != NAME:
            continue
        return copy.deepcopy(value)
    raise LookupError(f"no observed {kind} in {bucket} (topic {topic})")


def _dumps(value: dict[str, Any]) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()  # serde_json's compact form


def _scope(ns: str, component: str, name: str) -> dict[str, Any]:
    return {"kind": "endpoint", "endpoint": {"namespace": ns, "component": component, "name": name}}


def channel_key(ns: str, component: str, name: str, topic: str, publisher: int) -> str:
    scope = f"namespace/{ns}/component/{component}/endpoint/{name}"
    return f"v1/event_channels/{scope}/topic/{topic}/{publisher:x}"


def channel(
    publisher: int,
    topic: str = TOPIC,
    *,
    ns: str = NS,
    component: str = COMPONENT,
    name: str = NAME,
) -> dict[str, bytes]:
    """An event channel: what a frontend with replica sync registers for
    ``active_sequences_events`` (a worker registers one too, and its others)."""
    value = _observed("event_channels", kind="EventChannel", topic=TOPIC)
    value["scope"] = _scope(ns, component, name)
    value["topic"] = topic
    value["instance_id"] = publisher
    value["transport"]["config"]["subject_prefix"] = (
        f"namespace.{ns}.component.{component}.endpoint.{name}"
    )
    return {channel_key(ns, component, name, topic, publisher): _dumps(value)}


def instance(
    worker: int, *, ns: str = NS, component: str = COMPONENT, name: str = NAME
) -> dict[str, bytes]:
    value = _observed("instances", kind="Endpoint")
    value.update(namespace=ns, component=component, endpoint=name, instance_id=worker)
    value["transport"]["tcp"] = f"127.0.0.1:40000/{worker:x}/{ns}/{component}/{name}"
    return {f"v1/instances/{ns}/{component}/{name}/{worker:x}": _dumps(value)}


def worker(
    worker_id: int,
    *,
    dp: int = 1,
    base: int = 0,
    ns: str = NS,
    component: str = COMPONENT,
    name: str = NAME,
) -> dict[str, bytes]:
    """Every key a mocker worker with ``dp`` ranks registers: its endpoint instance, one query
    endpoint per rank, its model card, its channels (its own Marks, per-rank KV events, KV
    metrics, forward-pass metrics) and one KV-event source per rank. Publisher ids are drawn
    from ``base`` + small numbers, so two workers given different bases never share one."""
    records = instance(worker_id, ns=ns, component=component, name=name)
    card = _observed("mdc", kind="Model")
    card.update(namespace=ns, component=component, endpoint=name, instance_id=worker_id)
    card["card_json"]["runtime_config"]["data_parallel_size"] = dp
    records[f"v1/mdc/{ns}/{component}/{name}/{worker_id:x}"] = _dumps(card)
    where = {"ns": ns, "component": component, "name": name}
    records |= channel(base + 1, **where)
    records |= channel(base + 2, "kv_metrics", **where)
    records |= channel(base + 3, "forward-pass-metrics", **where)
    for rank in range(dp):
        publisher = base + 100 + rank
        records |= channel(publisher, "kv-events", **where)
        query = f"worker_kv_query_source_{publisher:x}"
        records |= instance(worker_id, ns=ns, component=component, name=query)
        source = _observed("event_sources", kind="EventSource", topic="kv-events")
        source["scope"] = _scope(ns, component, name)
        source["publisher_id"] = publisher
        meta = source["metadata"]
        meta["kv_state_endpoint"] = {"namespace": ns, "component": component, "name": name}
        meta["worker"] = {"worker_id": worker_id, "dp_rank": rank}
        meta["publisher_id"] = publisher
        meta["recovery_target"].update(endpoint=query, instance_id=worker_id, namespace=ns)
        records[
            f"v1/event_sources/namespace/{ns}/component/{component}/endpoint/{name}"
            f"/topic/kv-events/{publisher:x}"
        ] = _dumps(source)
    return records


# ---- the file store -------------------------------------------------------------------------


def file_name(key: str) -> str:
    """``v1/<bucket>/<rest>`` as Dynamo's file store names it: the rest percent-encoded."""
    _, bucket, rest = key.split("/", 2)
    encoded = "".join(
        chr(b) if chr(b).isascii() and chr(b).isalnum() else f"%{b:02X}" for b in rest.encode()
    )
    return f"v1/{bucket}/{encoded}"


def write_file(root: Path, key: str, value: bytes, *, mtime: float | None = None) -> Path:
    path = root / file_name(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.parent / f".tmp_{os.urandom(8).hex()}"
    temp.write_bytes(value)
    if mtime is not None:
        os.utime(temp, (mtime, mtime))
    temp.rename(path)
    return path


def write_files(root: Path, records: dict[str, bytes], *, mtime: float | None = None) -> None:
    for key, value in records.items():
        write_file(root, key, value, mtime=mtime)


# ---- following ------------------------------------------------------------------------------


class Followed:
    """A follower's batches, collected as they come (in a task), with waits on them."""

    def __init__(self, follower: DiscoveryFollower) -> None:
        self.follower = follower
        self.view = follower.view
        self.batches: list[ChangeBatch] = []
        self.error: BaseException | None = None
        self._task = asyncio.create_task(self._collect())

    async def _collect(self) -> None:
        try:
            async for batch in self.follower.changes():
                self.batches.append(batch)
        except Exception as exc:  # surfaced by check(): a wait must not hide it
            self.error = exc

    def check(self) -> None:
        if self.error is not None:
            raise AssertionError(f"the follower failed: {self.error!r}") from self.error

    async def stop(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self.check()

    def puts(self, since: int = 0) -> list[Record]:
        return [c.record for b in self.batches[since:] for c in b.changes if isinstance(c, Put)]

    def deletes(self, since: int = 0) -> list[Delete]:
        return [c for b in self.batches[since:] for c in b.changes if isinstance(c, Delete)]

    async def until(
        self, ok: Callable[[Followed], object], what: str, timeout: float = 30.0
    ) -> None:
        await eventually(lambda: self, ok, what=what, timeout=timeout, check=self.check)

    async def initial(self) -> ChangeBatch:
        await self.until(lambda f: f.batches, "the initial listing")
        first = self.batches[0]
        assert first.initial
        return first


def keys_of(records: Iterable[Record]) -> set[str]:
    return {r.key for r in records}


class CuttableProxy:
    """A TCP proxy to ``upstream_port`` that a test can cut (every connection closed, new ones
    refused) or freeze (connections kept, not a byte forwarded: a server that hangs), and
    mend: an outage of exactly the length and kind the test chooses."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.port = 0
        self.cut = False
        self.flowing = asyncio.Event()
        self.flowing.set()
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> CuttableProxy:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        self.sever()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    def sever(self) -> None:
        """Cut: close every connection, refuse new ones until :meth:`mend`."""
        self.cut = True
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()

    def freeze(self) -> None:
        self.flowing.clear()

    def mend(self) -> None:
        self.cut = False
        self.flowing.set()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.cut:
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            writer.transport.abort()
            return
        self._writers |= {writer, up_writer}
        await asyncio.gather(
            self._pipe(reader, up_writer), self._pipe(up_reader, writer), return_exceptions=True
        )
        self._writers -= {writer, up_writer}

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while chunk := await reader.read(65536):
                await self.flowing.wait()
                writer.write(chunk)
                await writer.drain()
        finally:
            writer.transport.abort()
