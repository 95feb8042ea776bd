"""The Mooncake conversation trace as a benchmark workload, built one way for every script.

Each request of the trace becomes an AddRequest at its timestamp, a MarkPrefillCompleted after
a modeled prefill (``input_length * 0.05 ms + 20 ms``; only even-indexed requests tell the
state that duration, odd ones are unmodeled, the mark time is the same formula for both) and a
Free after ``output_length * 20 ms`` of decode. Everything is deterministic: the same trace and
arguments give the same event log, so figures of different scripts speak of the same traffic.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from operator import itemgetter
from pathlib import Path
from typing import Any, Final

import msgspec
from nats.aio.client import Client
from nats.js import api

from harness.measure import collect
from harness.report import REPO_ROOT
from projector.settings.config import Config
from seqstate import (
    AddRequest,
    Event,
    Free,
    MarkPrefillCompleted,
    WorkerAdded,
    encode_event,
)

DEFAULT_TRACE: Final = REPO_ROOT / "data" / "mooncake_conversation_trace.jsonl"

NS_PER_MS: Final = 1_000_000
NS_PER_S: Final = 1_000_000_000
PREFILL_MS_PER_TOKEN: Final = 0.05
PREFILL_BASE_MS: Final = 20.0
DECODE_NS_PER_TOKEN: Final = 20 * NS_PER_MS
WAIT_TIMEOUT_S: Final = 600.0  # for the acks of a stream fill

ADD: Final = 0
MARK: Final = 1
FREE: Final = 2


class TraceRecord(msgspec.Struct):
    timestamp: int
    input_length: int
    output_length: int
    hash_ids: list[int]


@dataclass(frozen=True, slots=True)
class Lifecycle:
    """One trace request with its modeled event times."""

    index: int
    request_id: str
    hashes: list[int]
    isl: int
    expected_prefill_ms: float | None  # what the AddRequest tells the state (None: unmodeled)
    add_ns: int
    mark_ns: int
    free_ns: int


# A timeline entry: (at_ns, kind, request index); kinds ADD/MARK/FREE.
Step = tuple[int, int, int]


def read_trace(trace: Path, prog: str) -> list[TraceRecord] | None:
    """The trace's records, or None after printing one line on why they cannot be had (none,
    unreadable, or empty)."""
    if not trace.is_file():
        print(
            f"{prog}: trace not found: {trace} (the repo ships the Mooncake trace in data/;"
            " or pass --trace PATH)",
            file=sys.stderr,
        )
        return None
    try:
        records = load_trace(trace)
    except (OSError, msgspec.DecodeError) as exc:
        print(f"{prog}: cannot read trace {trace}: {exc}", file=sys.stderr)
        return None
    if not records:
        print(f"{prog}: trace has no requests: {trace}", file=sys.stderr)
        return None
    return records


def load_trace(path: Path) -> list[TraceRecord]:
    decoder = msgspec.json.Decoder(TraceRecord)
    with path.open("rb") as f:
        return [decoder.decode(line) for line in f if line.strip()]


def prefill_ms(input_length: int) -> float:
    return input_length * PREFILL_MS_PER_TOKEN + PREFILL_BASE_MS


def lifecycles(records: Sequence[TraceRecord]) -> list[Lifecycle]:
    out = []
    for i, r in enumerate(records):
        duration_ms = prefill_ms(r.input_length)
        add_ns = r.timestamp * NS_PER_MS
        mark_ns = add_ns + round(duration_ms * NS_PER_MS)
        out.append(
            Lifecycle(
                index=i,
                request_id=f"req-{i}",
                hashes=r.hash_ids,
                isl=r.input_length,
                expected_prefill_ms=duration_ms if i % 2 == 0 else None,
                add_ns=add_ns,
                mark_ns=mark_ns,
                free_ns=mark_ns + r.output_length * DECODE_NS_PER_TOKEN,
            )
        )
    return out


def timeline(requests: Sequence[Lifecycle]) -> list[Step]:
    """Every add, mark and free, sorted by time; ties keep generation order (stable sort)."""
    steps: list[Step] = []
    for lc in requests:
        steps.append((lc.add_ns, ADD, lc.index))
        steps.append((lc.mark_ns, MARK, lc.index))
        steps.append((lc.free_ns, FREE, lc.index))
    steps.sort(key=itemgetter(0))
    return steps


def add_event(lc: Lifecycle, worker_id: int) -> AddRequest:
    return AddRequest(
        request_id=lc.request_id,
        worker_id=worker_id,
        block_hashes=lc.hashes,
        prefill_tokens=lc.isl,
        expected_prefill_ms=lc.expected_prefill_ms,
    )


def round_robin_events(
    requests: Sequence[Lifecycle], steps: Sequence[Step], workers: int
) -> list[tuple[int, Event]]:
    events: list[tuple[int, Event]] = []
    for at_ns, kind, i in steps:
        lc = requests[i]
        worker_id = i % workers
        event: Event
        if kind == ADD:
            event = add_event(lc, worker_id)
        elif kind == MARK:
            event = MarkPrefillCompleted(request_id=lc.request_id, worker_id=worker_id)
        else:
            event = Free(request_id=lc.request_id, worker_id=worker_id)
        events.append((at_ns, event))
    return events


def base_events(trace: Path, workers: int) -> list[Event]:
    """One pass of the trace: every lifecycle event in timeline order, workers round-robin."""
    requests = lifecycles(load_trace(trace))
    return [event for _, event in round_robin_events(requests, timeline(requests), workers)]


def trace_events(trace: Path, workers: int, prog: str) -> list[Event] | None:
    """:func:`base_events`, or None after one line on stderr saying why the trace cannot be
    read (the caller exits 2)."""
    try:
        return base_events(trace, workers)
    except (OSError, msgspec.DecodeError) as exc:
        print(f"{prog}: cannot read trace {trace}: {exc}", file=sys.stderr)
        return None


def passes(base: Sequence[Event], count: int) -> Iterator[Event]:
    """``count`` events: the trace pass after pass, request ids made distinct per pass."""
    replace = msgspec.structs.replace
    emitted = 0
    k = 0
    while True:
        for event in base:
            if emitted == count:
                return
            yield replace(event, request_id=f"{event.request_id}.{k}")  # type: ignore[arg-type]
            emitted += 1
        k += 1


def encoded(
    config: Config, base: Sequence[Event], total: int, workers: int
) -> list[tuple[str, bytes]]:
    """Every message of the stream, ``(subject, payload)``, in publish order."""
    out = [(config.control_subject, encode_event(WorkerAdded(worker_id=w))) for w in range(workers)]
    subject = config.event_subject
    for event in passes(base, total - workers):
        out.append((subject(event.worker_id, event.dp_rank), encode_event(event)))  # type: ignore[union-attr]
    return out


async def fill(
    nc: Client,
    config: Config,
    messages: Sequence[tuple[str, bytes]],
    max_pending: int,
    alone: bool = True,
) -> dict[str, Any]:
    """Publish ``messages`` pipelined with ``publish_async``; every ack future is checked, and
    so is the stream's count unless others publish to it meanwhile (``alone`` False: a running
    writer logs a Tick into it when the log has been quiet for its tick interval)."""
    js = nc.jetstream(publish_async_max_pending=max_pending)
    acked = failed = duplicates = 0
    last = 0
    first_error: list[str] = []

    def settled(future: asyncio.Future[api.PubAck]) -> None:
        nonlocal acked, failed, duplicates, last
        if future.cancelled() or future.exception() is not None:
            failed += 1
            if not first_error:
                first_error.append(repr(future.exception() if not future.cancelled() else "cancel"))
            return
        ack = future.result()
        acked += 1
        duplicates += bool(ack.duplicate)
        last = max(last, ack.seq)

    publish_async = js.publish_async
    before = (await js.stream_info(config.events_stream)).state  # a tail adds to a history
    collect()
    t0 = time.perf_counter()
    for subject, payload in messages:
        future = await publish_async(subject, payload)
        future.add_done_callback(settled)
    await asyncio.wait_for(js.publish_async_completed(), WAIT_TIMEOUT_S)
    seconds = time.perf_counter() - t0
    await asyncio.sleep(0)  # let the last done-callbacks run
    total = len(messages)
    state = (await js.stream_info(config.events_stream)).state
    if (
        failed
        or duplicates
        or acked != total
        or (alone and state.messages != before.messages + total)
        or (alone and last != before.last_seq + total)
    ):
        raise RuntimeError(
            f"setup: sent {total}, acked {acked}, failed {failed} ({first_error}), duplicates "
            f"{duplicates}; the stream holds {state.messages} messages, last seq {state.last_seq}"
        )
    return {
        "events": total,
        "seconds": seconds,
        "events_per_s": total / seconds,
        "stream_bytes": state.bytes,
        "last_seq": last if total else state.last_seq,
        "max_pending": max_pending,
    }
