"""Reading a namespace's whole bucket back: for a resuming projector, a verify, a status.

One pass of a KV watch over ``<ns>.>`` (current values only), decoded with the codecs of
:mod:`projector.wire.values`. A value that does not decode is reported, not raised: each caller
decides what a damaged key means (the projector replays every delta, ``verify`` names it).

nats-py's "no more current values" marker can overtake values the server already sent (it is
decided from consumer info while deliveries are still queued), so :class:`CurrentValues` also
waits for the value the server marked as the last pending one.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import nats.errors
from nats.aio.client import Client
from nats.js.errors import NotFoundError
from nats.js.kv import KV_DEL, KV_PURGE, KeyValue

from projector.nats.stream import stop_watch
from projector.settings.config import Config
from projector.wire.values import (
    LoadValue,
    Position,
    Rank,
    RequestValue,
    TrackerValue,
    decode_load,
    decode_position,
    decode_request,
    decode_tracker,
    parse_key,
)
from seqstate.deltas import TRACKER_ENDED

# Keys of a namespace that are no part of the read model, and are kept: who holds the lease,
# where the log was trimmed (projector.nats.retention).
OTHER_KEYS = ("lease", "trimmed")


@dataclass
class BucketView:
    position: Position | None = None
    loads: dict[Rank, LoadValue] = field(default_factory=dict)
    slots: dict[Rank, dict[int, RequestValue]] = field(default_factory=dict)  # empty ones too
    # Each slot's part keys (a long prompt's rest), by part number, empty ones too.
    parts: dict[tuple[Rank, int], dict[int, RequestValue]] = field(default_factory=dict)
    unreadable: dict[str, tuple[Rank | None, str]] = field(default_factory=dict)
    tracker: TrackerValue | None = None  # under the slot-tracker rules
    # Keys of the namespace that name nothing the projector writes (``<ns>.load.x.y``): no
    # fold explains them, so verify names them and rebuild deletes them.
    strays: list[str] = field(default_factory=list)

    def requests(self, rank: Rank) -> dict[int, RequestValue]:
        """The rank's occupied slots (each head's value: its first hashes, see :meth:`hashes`)."""
        return {slot: v for slot, v in self.slots.get(rank, {}).items() if not v.empty}

    def hashes(self, rank: Rank, slot: int) -> list[int]:
        """The whole prompt of the request in ``slot``: its head's hashes and its parts', in
        order. Raises ``ValueError`` naming the first part missing or stamped by another
        booking (a torn read, or a damaged bucket)."""
        head = self.slots[rank][slot]
        hashes = head.hash_list()
        held = self.parts.get((rank, slot), {})
        for part in range(1, head.parts + 1):
            value = held.get(part)
            if value is None or value.empty:
                raise ValueError(f"part {part} of {head.parts} is missing")
            if value.applied_seq != head.applied_seq:
                raise ValueError(
                    f"part {part} of {head.parts} is of the booking at event "
                    f"{value.applied_seq}, its head of event {head.applied_seq}"
                )
            hashes += value.hash_list()
        return hashes

    def stray_parts(self) -> list[tuple[Rank, int, int]]:
        """``(rank, slot, part)`` of each part holding hashes that no head claims: its slot's
        head is empty or gone, or has fewer parts."""
        out = []
        for (rank, slot), held in self.parts.items():
            head = self.slots.get(rank, {}).get(slot)
            claimed = 0 if head is None or head.empty else head.parts
            out += [
                (rank, slot, part)
                for part, value in held.items()
                if part > claimed and not value.empty
            ]
        return sorted(out)

    def put(self, namespace: str, key: str, value: bytes) -> None:
        """Take one current value of the bucket (its key parsed, its value decoded; a value
        that does not decode goes to :attr:`unreadable`)."""
        kind, rank, slot, part = parse_key(namespace, key)  # the lease is no read model
        if not kind:
            if key.split(".", 1)[-1] not in OTHER_KEYS:
                self.strays.append(key)
            return
        try:
            if kind == "position":
                self.position = decode_position(value)
            elif kind == "load" and rank is not None:
                self.loads[rank] = decode_load(value)
            elif kind == "req" and rank is not None:
                self.slots.setdefault(rank, {})[slot] = decode_request(value)
            elif kind == "part" and rank is not None:
                self.parts.setdefault((rank, slot), {})[part] = decode_request(value)
            elif kind == "tracker":
                self.tracker = decode_tracker(value)
        except (msgspec.DecodeError, ValueError) as exc:
            self.unreadable[key] = (rank, str(exc))


class CurrentValues:
    """Tells when a watch of the bucket's keys ``keys`` (a filter, wildcards allowed) has
    delivered every value current when it started."""

    def __init__(self, nc: Client, bucket: str, keys: str) -> None:
        self._js = nc.jetstream()
        self._stream = f"KV_{bucket}"
        self._subjects = f"$KV.{bucket}.{keys}"
        self._marker = False
        self._last_pending: int | None = None

    async def done_after(self, entry: KeyValue.Entry | None) -> bool:
        """Feed each watch update (None is nats-py's marker); True once all are in."""
        if entry is None:
            self._marker = True
        else:
            self._last_pending = entry.delta
        if not self._marker:
            return False
        if self._last_pending is not None:
            return self._last_pending == 0
        try:  # the marker and nothing yet: either the namespace has no keys, or they are late
            await self._js.get_last_msg(self._stream, self._subjects)
        except NotFoundError:
            return True
        return False


async def read_bucket(
    nc: Client, config: Config, *, timeout: float = 30.0, keys: str = ">"
) -> BucketView:
    """The namespace's current values; ``keys`` narrows the read to a key filter below the
    namespace (``load.>``: every rank's load, none of the requests)."""
    js = nc.jetstream()
    kv = await js.key_value(config.registry_bucket)
    view = BucketView()
    keys = f"{config.namespace}.{keys}"
    current = CurrentValues(nc, config.registry_bucket, keys)
    watcher = await kv.watch(keys)
    try:
        while True:
            entry = await next_update(watcher, timeout)
            if entry is not None and entry.operation not in (KV_DEL, KV_PURGE) and entry.value:
                view.put(config.namespace, entry.key, entry.value)
            if await current.done_after(entry):
                return view
    finally:
        await stop_watch(js, watcher)


async def next_update(watcher: KeyValue.KeyWatcher, timeout: float | None) -> Any:
    """The watch's next update (None: nats-py's end-of-current-values marker); nats-py's
    TimeoutError after ``timeout`` seconds (None: never), as ``updates()`` raises it.

    Not ``watcher.updates()``: its ``wait_for`` (Python 3.11's) drops a cancellation that lands
    while an update is ready, and a watch over many keys always has one ready, so a projector
    stopped while it read its bucket back read on to the end of it.
    """
    try:
        async with asyncio.timeout(timeout):
            return await anext(watcher)
    except TimeoutError:
        raise nats.errors.TimeoutError from None


async def tracker_updates(
    nc: Client, config: Config, *, timeout: float | None = None
) -> AsyncGenerator[tuple[str, int] | None, None]:
    """Each namespace of the bucket folded by the slot-tracker rules that has a tracker
    (``<ns>.tracker``), as ``(namespace, block size)``: those there now, then ``None`` once
    they are all delivered, then each one written later. A tracker that ended (its key
    deleted: its last worker was removed) comes as ``(namespace, TRACKER_ENDED)``, those that
    ended before the watch began too. ``timeout``: between two updates (``TimeoutError``
    beyond). Close it (``contextlib.aclosing``) to stop its watch."""
    js = nc.jetstream()
    kv = await js.key_value(config.registry_bucket)
    current = CurrentValues(nc, config.registry_bucket, "*.tracker")
    watcher = await kv.watch("*.tracker")
    told = False
    try:
        while True:
            entry = await next_update(watcher, timeout)
            if entry is None:
                pass
            elif entry.value and entry.operation not in (KV_DEL, KV_PURGE):
                # A damaged value is skipped: verify names it, rebuild repairs it.
                try:
                    block_size = decode_tracker(entry.value).block_size
                except (msgspec.DecodeError, msgspec.ValidationError):
                    pass
                else:
                    yield entry.key.split(".", 1)[0], block_size
            else:
                yield entry.key.split(".", 1)[0], TRACKER_ENDED
            if not told and await current.done_after(entry):
                told = True
                yield None
    finally:
        await stop_watch(js, watcher)


async def read_trackers(nc: Client, config: Config, *, timeout: float = 30.0) -> dict[str, int]:
    """Every namespace of the bucket folded by the slot-tracker rules that has a tracker now,
    with its block size: what a ``serve-http`` starting up must serve (``<ns>.tracker``)."""
    found: dict[str, int] = {}
    async with contextlib.aclosing(tracker_updates(nc, config, timeout=timeout)) as updates:
        async for tracker in updates:
            if tracker is None:
                break
            if tracker[1] == TRACKER_ENDED:
                found.pop(tracker[0], None)
            else:
                found[tracker[0]] = tracker[1]
    return found
