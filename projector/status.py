"""``seqstate status``: what an operator asks first: is it keeping up, and where is it?

The writer and the projector read with ordered (ephemeral) consumers, so "lag" is measured
where it matters: the newest event in the log versus the event the bucket's position says the
read model reflects. Consumers are listed per stream as the server reports them.
"""

from __future__ import annotations

import datetime as dt

import msgspec
from nats.aio.client import Client
from nats.js.errors import BucketNotFoundError, NotFoundError

from projector.bucket import read_bucket
from projector.config import Config
from projector.resources import dead_letter_stream
from projector.retention import trimmed_below
from projector.security import redact
from projector.snapshots import SnapshotStore
from projector.stream import last_seq_of


class ConsumerStatus(msgspec.Struct):
    name: str
    pending: int
    delivered_seq: int


class StreamStatus(msgspec.Struct):
    name: str
    exists: bool
    messages: int = 0
    bytes: int = 0
    first_seq: int = 0
    last_seq: int = 0
    consumers: list[ConsumerStatus] = []


class StatusReport(msgspec.Struct):
    namespace: str
    server: str
    streams: list[StreamStatus]
    bucket: str
    bucket_exists: bool
    ranks: int
    applied_seq: int
    as_of: str | None
    lag_events: int | None
    snapshots: int = 0
    newest_snapshot_seq: int = 0
    trimmed_below: int = 0
    position_beyond_log: bool = False  # the bucket claims events the log does not have


async def _stream(nc: Client, name: str) -> StreamStatus:
    js = nc.jetstream()
    try:
        info = await js.stream_info(name)
    except NotFoundError:
        return StreamStatus(name, False)
    consumers = []
    for c in await js.consumers_info(name):
        delivered = c.delivered.stream_seq if c.delivered and c.delivered.stream_seq else 0
        consumers.append(ConsumerStatus(c.name or "", c.num_pending or 0, delivered))
    s = info.state
    return StreamStatus(name, True, s.messages, s.bytes, s.first_seq, s.last_seq, consumers)


async def collect(nc: Client, config: Config) -> StatusReport:
    # The bucket first, then the log: the log only grows, so the lag read this way is never
    # negative unless the bucket's position really is beyond the log (a forged or foreign one).
    ranks, applied, as_of, exists = 0, 0, None, True
    try:
        bucket = await read_bucket(nc, config, timeout=10.0)
        ranks = len(bucket.loads)
        if (position := bucket.position) is not None:
            applied = position.applied_seq
            as_of = dt.datetime.fromtimestamp(position.as_of / 1e9, dt.UTC).isoformat()
    except BucketNotFoundError:
        exists = False
    names = (config.events_stream, config.deltas_stream, dead_letter_stream(config))
    streams = [await _stream(nc, name) for name in names]
    store = await SnapshotStore(nc, config).open(create=False)
    snapshots = await store.list()
    trimmed = await trimmed_below(nc, config)
    version = nc.connected_server_version
    events = streams[0]
    lag: int | None = None
    newest = 0
    if events.exists and exists:  # this namespace's newest event: the stream may be shared
        newest = await last_seq_of(nc.jetstream(), config.events_stream, config.events_subjects)
        lag = max(0, newest - applied)
    return StatusReport(
        namespace=config.namespace,
        server=f"{redact(nc.connected_url.netloc) if nc.connected_url else '?'} "
        f"(nats-server {version.major}.{version.minor}.{version.patch})",
        streams=streams,
        bucket=config.registry_bucket,
        bucket_exists=exists,
        ranks=ranks,
        applied_seq=applied,
        as_of=as_of,
        lag_events=lag,
        snapshots=len(snapshots),
        newest_snapshot_seq=snapshots[-1].applied_seq if snapshots else 0,
        trimmed_below=trimmed,
        position_beyond_log=applied > newest if lag is not None else False,
    )


def format_status(report: StatusReport) -> str:
    lines = [f"namespace {report.namespace!r} on {report.server}", ""]
    lines.append(f"{'stream':<24}{'messages':>10}{'bytes':>12}{'first':>10}{'last':>10}")
    for s in report.streams:
        if not s.exists:
            lines.append(f"{s.name:<24}  (missing)")
            continue
        lines.append(f"{s.name:<24}{s.messages:>10}{s.bytes:>12}{s.first_seq:>10}{s.last_seq:>10}")
        for c in s.consumers:
            lines.append(f"  consumer {c.name}: pending {c.pending}, delivered {c.delivered_seq}")
    lines.append("")
    if not report.bucket_exists:
        lines.append(f"bucket {report.bucket}: missing (no projector has run)")
    else:
        lines.append(f"bucket {report.bucket}: {report.ranks} ranks, position event "
                     f"{report.applied_seq} (log time {report.as_of or '-'})")  # fmt: skip
    if report.position_beyond_log:
        lines.append(f"lag: the bucket's position (event {report.applied_seq}) is beyond the "
                     "log's newest event: it was not derived from this log (`seqstate replay "
                     "--verify`, then `seqstate rebuild`)")  # fmt: skip
    elif report.lag_events is not None:
        lines.append(f"lag: {report.lag_events} events behind the log")
    lines.append(
        f"snapshots: {report.snapshots}"
        + (f", newest at event {report.newest_snapshot_seq}" if report.snapshots else "")
    )
    lines.append(f"events trimmed below sequence {report.trimmed_below}" if report.trimmed_below
                 else "events: never trimmed")  # fmt: skip
    return "\n".join(lines)
