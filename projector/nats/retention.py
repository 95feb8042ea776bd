"""Trimming the event stream, and remembering that it happened.

Events are dropped only below the oldest snapshot that is kept (every kept snapshot was read
back when it was saved), minus ``retain_events``, so each kept snapshot remains a usable
starting point with its whole tail. Before purging, the writer records the cut as
``<ns>.trimmed`` in the registry bucket: the stream is shared by namespaces, so a first
sequence above 1 does not by itself say that *this* namespace lost events. A writer or a
replay that finds the marker and no valid snapshot refuses to build a state it cannot make
exact.
"""

from __future__ import annotations

from nats.aio.client import Client
from nats.js.errors import BucketNotFoundError, KeyNotFoundError

from projector.nats.snapshots import SnapshotInfo
from projector.wire.config import Config


def marker_key(namespace: str) -> str:
    return f"{namespace}.trimmed"


async def trimmed_below(nc: Client, config: Config) -> int:
    """The sequence below which this namespace's events were trimmed (0: never)."""
    try:
        kv = await nc.jetstream().key_value(config.registry_bucket)
        entry = await kv.get(marker_key(config.namespace))
    except (BucketNotFoundError, KeyNotFoundError):
        return 0
    try:
        return int(entry.value or b"0")
    except ValueError:
        return 1  # a damaged marker: assume the worst, something was trimmed


async def trim(nc: Client, config: Config, kept: list[SnapshotInfo], done_below: int) -> int:
    """Purge what ``kept`` makes redundant; returns the new cut (``done_below`` if none)."""
    if config.retain_events is None or not kept:
        return done_below
    cut = kept[0].applied_seq + 1 - config.retain_events
    if cut <= max(done_below, 1):
        return done_below
    kv = await nc.jetstream().key_value(config.registry_bucket)
    await kv.put(marker_key(config.namespace), str(cut).encode())
    await nc.jetstream().purge_stream(config.events_stream, seq=cut, subject=config.events_subjects)
    return cut
