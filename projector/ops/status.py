"""``seqstate status``: what an operator asks first: is it keeping up, and where is it?

The writer and the projector read with ordered (ephemeral) consumers, so "lag" is measured
where it matters: the newest event in the log versus the event the bucket's position says the
read model reflects. Consumers are listed per stream as the server reports them.

That lag is split in two (:mod:`projector.nats.lag`, the measures the consumers take of themselves):
the writer's, the namespace's events not folded yet (after the last one its stored deltas, or
its dead letters, cover) and its Dynamo messages captured but not in the events stream yet,
and the projector's, deltas not in the bucket yet (the newest delta against the bucket's
position); each with how long ago the oldest waiting message was logged, and whether it
reaches a warning threshold (``--behind-warn-events``, ``--behind-warn-s``). Every count is
the namespace's own, counted by the server, though the streams be shared.

Beside the lag, what fills up: each stream against its limits (messages, bytes, and whether a
full one refuses new messages or drops its oldest), the account's JetStream storage, and the
publishes refused that a running writer counted (its Ticks); a router's refusals are its own
metric (:mod:`projector.route.refusals`).
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import msgspec
import nats.errors
from nats.aio.client import Client
from nats.js.errors import BucketNotFoundError, NotFoundError

from projector.bucket.contents import read_bucket
from projector.nats.backlog import Captured, size, use_of, waiting_after
from projector.nats.lag import Lag, describe, over, projector_lag, thresholds, writer_lag
from projector.nats.resources import dead_letter_stream, dynamo_capture
from projector.nats.retention import trimmed_below
from projector.nats.services import status_subject
from projector.nats.snapshots import SnapshotInfo, SnapshotStore
from projector.nats.stream import last_seq_of
from projector.run.assemble import build_delta_log
from projector.settings.config import Config
from projector.settings.redaction import redact
from projector.wire.headers import SOURCE_SEQ, SOURCE_STREAM
from seqstate import SeqstateError, SnapshotError
from seqstate.deltas import U64_MAX
from seqstate.snapshot import decode_state

WRITER_ASK_S = 1.0  # how long status waits for a running writer's own report


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
    max_messages: int | None = None  # its limits (None: none)
    max_bytes: int | None = None
    discard: str = "old"  # at a limit: "new" refuses new messages, "old" drops the oldest
    full: float = 0.0  # the larger share of a limit in use (0.0: no limits)


class CaptureStatus(msgspec.Struct):
    """The namespace's capture stream against what the events stream has taken of it."""

    stream: str
    captured_seq: int  # the capture stream's newest message
    taken_seq: int  # the newest of them in the events stream
    waiting: int  # captured, not in the events stream yet
    dropped: int  # dropped by the capture stream before the events stream took them
    oldest_log_time: str | None  # of the oldest waiting (None: none waits)
    error: str = ""  # what the events stream reports of the source


class LagStatus(msgspec.Struct):
    """One consumer's lag. The writer: events after ``position`` (the last event its stored
    deltas or dead letters cover) up to ``newest`` (the log's newest). The projector: events
    after ``position`` (the bucket's) up to ``newest`` (the newest with a stored delta), in
    ``messages`` delta messages."""

    position: int
    newest: int
    events: int
    messages: int
    oldest_log_time: str | None  # of the oldest message waiting (None: none waits)
    oldest_age_s: float | None
    behind: bool  # at or over a warning threshold
    said: str  # the lag in words
    captured: int = 0  # Dynamo messages captured, waiting outside the events stream
    exact: bool = True  # False: a sequence difference (a server without batched gets)


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
    writer: LagStatus | None = None  # None: no events stream
    projector: LagStatus | None = None  # None: no deltas stream or no bucket
    warns_at: str = ""  # the warning thresholds in words
    # Dynamo publishers' counts (Publishers.report), where they come from ("the running
    # writer", "the snapshot at event N"); None: no Dynamo traffic folded, or none known
    dynamo: dict[str, Any] | None = None
    dynamo_from: str = ""
    capture: CaptureStatus | None = None  # None: the namespace captures no Dynamo endpoint
    captured_behind: int = 0  # captured, not in the events stream yet: the bucket lacks them
    storage_bytes: int = 0  # the account's JetStream file storage in use
    max_storage_bytes: int | None = None  # its limit (None: none set for the account)
    # the running writer's publishes that were not stored, by why (None: no writer answered)
    writer_refused: dict[str, int] | None = None


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
    s, use = info.state, use_of(info)
    return StreamStatus(
        name,
        True,
        s.messages,
        s.bytes,
        s.first_seq,
        s.last_seq,
        consumers,
        use.max_messages,
        use.max_bytes,
        use.discard,
        round(use.share, 4),
    )


async def collect(nc: Client, config: Config) -> StatusReport:
    # The bucket first, then the log: the log only grows, so the lag read this way is never
    # negative unless the bucket's position really is beyond the log (a forged or foreign one).
    ranks, applied, delta_seq, as_of, exists = 0, 0, 0, None, True
    try:
        bucket = await read_bucket(nc, config, timeout=10.0)
        ranks = len(bucket.loads)
        if (position := bucket.position) is not None:
            applied, delta_seq = position.applied_seq, position.delta_seq
            as_of = dt.datetime.fromtimestamp(position.as_of / 1e9, dt.UTC).isoformat()
    except BucketNotFoundError:
        exists = False
    js = nc.jetstream()
    projector = None
    if exists:  # the bucket, then the deltas: the projector's lag is never negative either
        projector = _lag_status(
            config, "projector", await projector_lag(js, config, applied, delta_seq)
        )
    writer, capture = None, None
    folded = await writer_position(nc, config)  # the deltas, then the log
    names = [config.events_stream, config.deltas_stream, dead_letter_stream(config)]
    streams = [await _stream(nc, name) for name in names]
    storage = None
    if streams[0].exists:
        lag = await writer_lag(js, config, folded, capture=True)  # with the flag or not
        writer, capture, storage = _lag_status(config, "writer", lag), lag.capture, lag.storage
    if not streams[1].exists:  # no deltas
        projector = None
    if capture is not None:  # beside the events stream that sources it
        streams.insert(1, await _stream(nc, dynamo_capture(config)))
    store = await SnapshotStore(nc, config).open(create=False)
    snapshots = await store.list()
    trimmed = await trimmed_below(nc, config)
    version = nc.connected_server_version
    events = streams[0]
    behind: int | None = None
    newest = 0
    if events.exists and exists:  # this namespace's events: the stream may be shared
        newest = await last_seq_of(nc.jetstream(), config.events_stream, config.events_subjects)
        behind = (
            await waiting_after(js, config.events_stream, config.events_subjects, applied)
        ).count
    running = await _running_writer(nc, config)
    dynamo, dynamo_from = await _dynamo_loss(running, store, snapshots)
    return StatusReport(
        dynamo=dynamo,
        dynamo_from=dynamo_from,
        namespace=config.namespace,
        server=f"{redact(nc.connected_url.netloc) if nc.connected_url else '?'} "
        f"(nats-server {version.major}.{version.minor}.{version.patch})",
        streams=streams,
        bucket=config.registry_bucket,
        bucket_exists=exists,
        ranks=ranks,
        applied_seq=applied,
        as_of=as_of,
        lag_events=behind,
        snapshots=len(snapshots),
        newest_snapshot_seq=snapshots[-1].applied_seq if snapshots else 0,
        trimmed_below=trimmed,
        position_beyond_log=applied > newest if behind is not None else False,
        writer=writer,
        projector=projector,
        warns_at=thresholds(config),
        capture=_capture_status(capture),
        captured_behind=capture.waiting if capture is not None else 0,
        storage_bytes=storage.bytes if storage else 0,
        max_storage_bytes=storage.max_bytes if storage else None,
        writer_refused=running.get("publishes_refused") if running is not None else None,
    )


async def _running_writer(nc: Client, config: Config) -> dict[str, Any] | None:
    """The running writer's own report (its status endpoint); None if none answers."""
    try:
        reply = await nc.request(status_subject(config, "writer"), b"", timeout=WRITER_ASK_S)
        report = msgspec.json.decode(reply.data)
    except (nats.errors.Error, TimeoutError, msgspec.DecodeError):
        return None
    return report if isinstance(report, dict) else None


def _capture_status(capture: Captured | None) -> CaptureStatus | None:
    if capture is None:
        return None
    return CaptureStatus(
        capture.stream,
        capture.last,
        capture.sourced,
        capture.waiting,
        capture.dropped,
        _when(capture.oldest_ns),
        capture.error,
    )


def _when(ns: int | None) -> str | None:
    return None if ns is None else dt.datetime.fromtimestamp(ns / 1e9, dt.UTC).isoformat()


async def _dynamo_loss(
    running: dict[str, Any] | None, store: SnapshotStore, snapshots: list[SnapshotInfo]
) -> tuple[dict[str, Any] | None, str]:
    """What Dynamo's publishers lost: from the running writer if one answered (its live
    count), else from the newest snapshot (as of its event)."""
    if running is not None:
        report = running.get("dynamo")
        return (report if isinstance(report, dict) else None), "the running writer"
    for info in reversed(snapshots):
        try:
            state = decode_state(await store.fetch(info.name))
        except (SnapshotError, SeqstateError, msgspec.DecodeError):
            continue
        if state.publishers:
            return state.publishers.report(), f"the snapshot at event {info.applied_seq}"
        return None, ""
    return None, ""


async def writer_position(nc: Client, config: Config) -> int:
    """The last event the writer has visibly handled: the newest its stored deltas cover, or
    its newest dead letter, if that is later (0: none)."""
    js = nc.jetstream()
    folded = await build_delta_log(nc, config).open()
    try:
        raw = await js.get_last_msg(dead_letter_stream(config), config.dead_letter_subject)
    except NotFoundError:
        return folded
    headers = raw.headers or {}
    seq = headers.get(SOURCE_SEQ, "")
    if headers.get(SOURCE_STREAM) == config.events_stream and seq.isdigit():
        folded = max(folded, int(seq))
    return folded


def _lag_status(config: Config, who: str, lag: Lag) -> LagStatus:
    age = round(lag.oldest_age_s, 3) if lag.oldest_ns is not None else None
    return LagStatus(
        lag.position,
        lag.newest,
        lag.events,
        lag.messages,
        _when(lag.oldest_ns),
        age,
        over(config, lag),
        describe(who, lag),
        lag.captured,
        lag.exact,
    )


def format_status(report: StatusReport) -> str:
    lines = [f"namespace {report.namespace!r} on {report.server}", ""]
    width = max([24, *(len(s.name) + 2 for s in report.streams)])
    head = f"{'stream':<{width}}{'messages':>10}{'bytes':>12}{'first':>10}{'last':>10}  limits"
    lines.append(head)
    for s in report.streams:
        if not s.exists:
            lines.append(f"{s.name:<{width}}  (missing)")
            continue
        lines.append(
            f"{s.name:<{width}}{s.messages:>10}{s.bytes:>12}{s.first_seq:>10}{s.last_seq:>10}"
            f"  {_limits(s)}"
        )
        for c in s.consumers:
            lines.append(f"  consumer {c.name}: pending {c.pending}, delivered {c.delivered_seq}")
    storage = f"JetStream storage (the account's): {size(report.storage_bytes)} in use, "
    if report.max_storage_bytes is None:
        lines.append(storage + "no account limit")
    else:
        share = report.storage_bytes / report.max_storage_bytes
        lines.append(storage + f"of {size(report.max_storage_bytes)} ({share:.0%})")
    lines.append("")
    if not report.bucket_exists:
        lines.append(f"bucket {report.bucket}: missing (no projector has run)")
    else:
        lines.append(
            f"bucket {report.bucket}: {report.ranks} ranks, position event "
            f"{report.applied_seq} (log time {report.as_of or '-'})"
        )
    if report.position_beyond_log:
        lines.append(
            f"lag: the bucket's position (event {report.applied_seq}) is beyond the "
            "log's newest event: it was not derived from this log (`seqstate replay "
            "--verify`, then `seqstate rebuild`)"
        )
    elif report.lag_events is not None:
        lines.append(
            f"lag: {report.lag_events} events behind the log"
            + (
                f", and {report.captured_behind} Dynamo messages captured but not in the "
                "events stream yet"
                if report.captured_behind
                else ""
            )
        )
    for who, lag in (("writer", report.writer), ("projector", report.projector)):
        if lag is not None:
            flag = f"  BEHIND (warns at {report.warns_at})" if lag.behind else ""
            lines.append(f"{who} lag: {lag.said}{flag}")
    lines.append(
        f"snapshots: {report.snapshots}"
        + (f", newest at event {report.newest_snapshot_seq}" if report.snapshots else "")
    )
    lines.append(
        f"events trimmed below sequence {report.trimmed_below}"
        if report.trimmed_below
        else "events: never trimmed"
    )
    if report.writer_refused:
        refused = ", ".join(f"{n} {why}" for why, n in sorted(report.writer_refused.items()))
        lines.append(f"publishes refused: the running writer's Ticks: {refused}")
    if report.dynamo:
        d = report.dynamo
        lines.append(
            f"dynamo: {d['publishers']} publishers, {_messages(d['lost'])} lost, "
            f"{d.get('late', 0)} late ({report.dynamo_from})"
        )
        for publisher, lost in d["lost_by_publisher"].items():
            lines.append(f"  publisher {publisher}: {_messages(lost)} lost")
    return "\n".join(lines)


def _limits(s: StreamStatus) -> str:
    """``5,000 messages, 1.0 GiB (12% full), refuses new`` or ``none``."""
    limits = [f"{s.max_messages:,} messages"] if s.max_messages is not None else []
    if s.max_bytes is not None:
        limits.append(size(s.max_bytes))
    if not limits:
        return "none"
    at_limit = "refuses new" if s.discard == "new" else "drops oldest"
    return f"{', '.join(limits)} ({s.full:.0%} full), {at_limit}"


def _messages(n: int) -> str:
    if n >= U64_MAX:  # the count saturates there
        return f"at least {n} messages"
    return f"{n} message" + ("" if n == 1 else "s")
