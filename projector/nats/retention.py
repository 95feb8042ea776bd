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

from dataclasses import dataclass

from nats.aio.client import Client
from nats.js.errors import BucketNotFoundError, KeyNotFoundError

from projector.nats.snapshots import SnapshotInfo
from projector.settings.config import Config


def marker_key(namespace: str) -> str:
    return f"{namespace}.trimmed"


@dataclass(frozen=True)
class Retention:
    """One namespace's trimming, bound to the names it touches: what a writer's snapshotter is
    handed, so that it needs no configuration of its own."""

    nc: Client
    namespace: str
    registry_bucket: str
    events_stream: str
    events_subjects: str
    retain_events: int | None  # None: never trim

    @classmethod
    def of(cls, nc: Client, config: Config) -> Retention:
        return cls(
            nc,
            config.namespace,
            config.registry_bucket,
            config.events_stream,
            config.events_subjects,
            config.retain_events,
        )

    async def trimmed_below(self) -> int:
        """The sequence below which this namespace's events were trimmed (0: never)."""
        try:
            kv = await self.nc.jetstream().key_value(self.registry_bucket)
            entry = await kv.get(marker_key(self.namespace))
        except (BucketNotFoundError, KeyNotFoundError):
            return 0
        try:
            return int(entry.value or b"0")
        except ValueError:
            return 1  # a damaged marker: assume the worst, something was trimmed

    async def trim(self, kept: list[SnapshotInfo], done_below: int) -> int:
        """Purge what ``kept`` makes redundant; returns the new cut (``done_below`` if none)."""
        if self.retain_events is None or not kept:
            return done_below
        cut = kept[0].applied_seq + 1 - self.retain_events
        if cut <= max(done_below, 1):
            return done_below
        js = self.nc.jetstream()
        kv = await js.key_value(self.registry_bucket)
        await kv.put(marker_key(self.namespace), str(cut).encode())
        await js.purge_stream(self.events_stream, seq=cut, subject=self.events_subjects)
        return cut


async def trimmed_below(nc: Client, config: Config) -> int:
    """The sequence below which this namespace's events were trimmed (0: never)."""
    return await Retention.of(nc, config).trimmed_below()
