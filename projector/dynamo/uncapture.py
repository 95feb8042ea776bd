"""Taking Dynamo endpoints out of a namespace's capture: the one undoing provisioning offers.

Provisioning only ever adds: a typo'd ``--dynamo-endpoint dynamo.backend.generat`` leaves its
subject in the namespace's capture stream for good. Removing an endpoint takes its subject out
of the capture stream's subjects, so JetStream stops storing what Dynamo publishes there;
what it captured before is still forwarded by the writers. Removing the last one stops the
capture altogether: the capture stream first listens on no Dynamo subject (a stream with no
subjects listens on its own name, where Dynamo publishes nothing), then this command forwards
what it still holds into the events stream itself (as a writer's forwarder does, beside any
running: :mod:`projector.dynamo.forward`), and only then is the capture stream deleted (and an
events stream provisioned before the forwarder loses its source of it), so nothing captured
before the removal is lost. A later ``--dynamo-endpoint`` provisions it afresh, and the
forwarder stores the new capture stream from its first message.

Nothing in the events stream is touched: the namespace's log keeps every event the endpoint
had, and every fold (replay, verify, rebuild) still folds them, since the fold tells a Dynamo
message by its subject alone. What is uncaptured comes back at the next start of any process
still given the endpoint (``run``, ``writer``, ``projector`` provision at every start).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api
from nats.js.errors import APIError, NotFoundError

from projector.dynamo.forward import forward_waiting
from projector.nats.backlog import Captured, events_held
from projector.nats.failures import describe
from projector.nats.lag import capture_of, captured_subjects
from projector.nats.resources import dynamo_capture
from projector.settings.config import Config
from projector.wire.capture import captured_subject, endpoint_of
from seqstate.errors import SeqstateError

DRAIN_S = 10.0  # for the events stream to take what the capture stream still holds
_POLL_S = 0.1


class UncaptureError(SeqstateError, RuntimeError):
    """The namespace or an endpoint is not captured, or the server refused a change."""


@dataclass(frozen=True)
class Uncaptured:
    """What was removed: ``removed`` maps each endpoint to the number of its events the log
    keeps; ``kept`` are the endpoints still captured; ``deleted``: the capture stream is gone
    (no endpoint left), and the events stream no longer sources it."""

    stream: str
    removed: dict[str, int]
    kept: tuple[str, ...]
    deleted: bool


async def uncapture(nc: Client, config: Config, endpoints: tuple[str, ...] = ()) -> Uncaptured:
    """Take ``endpoints`` (every one the namespace captures, if none) out of the capture.
    Refuses, changing nothing, when the namespace has no capture stream or one of
    ``endpoints`` is not among its subjects."""
    js = nc.jetstream()
    name = dynamo_capture(config)
    info = await _capture_info(nc, config)
    subjects = list(info.config.subjects or [])
    captured = _require_captured(config, subjects, endpoints)
    gone = set(endpoints or captured)
    kept = tuple(e for e in captured if e not in gone)
    if kept:
        left = [s for s in subjects if endpoint_of(s) not in gone]
        await _update(js, info.config, subjects=left)
    else:
        await _stop(nc, config, info.config)
    removed = await _in_log(js, config, [e for e in captured if e in gone])
    return Uncaptured(name, removed, kept, deleted=not kept)


async def _stop(nc: Client, config: Config, capture: api.StreamConfig) -> None:
    """No Dynamo subject left: stop listening, store the rest in the events stream (as a
    writer's forwarder does, beside any running), then drop the capture stream (and the
    events stream's source of it, on a stream provisioned before the forwarder)."""
    js = nc.jetstream()
    name = capture.name or ""
    if any(endpoint_of(s) is not None for s in capture.subjects or []):
        await _update(js, capture, subjects=[])
    refused = ""
    try:
        await forward_waiting(nc, config, DRAIN_S)
    except (TimeoutError, NotFoundError):
        pass  # said below, by what still waits
    except (APIError, nats.errors.Error) as exc:
        refused = describe(exc)
    backlog = await _drained(js, config)
    if backlog is not None:
        one = backlog.waiting == 1
        raise UncaptureError(
            f"{backlog.waiting:,} Dynamo message{'' if one else 's'} captured for namespace "
            f"{config.namespace!r} {'is' if one else 'are'} not in stream "
            f"{config.events_stream} yet"
            + f" ({backlog.error or refused or 'is it full?'})"
            + f"; {name} captures nothing more, and is kept until the events stream has "
            f"{'it' if one else 'them'}: run this again then"
        )
    try:
        events = await js.stream_info(config.events_stream)
    except NotFoundError:
        pass
    else:
        sources = [s for s in events.config.sources or [] if s.name != name]
        if len(sources) != len(events.config.sources or []):
            await _update(js, events.config, sources=sources)
    try:
        await js.delete_stream(name)
    except NotFoundError:
        pass  # deleted meanwhile (another uncapture): the same end
    except APIError as exc:
        raise UncaptureError(f"cannot delete stream {name}: {exc.description}") from None


async def _drained(js: JetStreamContext, config: Config) -> Captured | None:
    """None once the events stream holds everything the capture stream does, within
    ``DRAIN_S``; else what still waits."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DRAIN_S
    while True:
        backlog = await capture_of(js, config)
        if backlog is None or not backlog.waiting:
            return None
        if loop.time() >= deadline:
            return backlog
        await asyncio.sleep(_POLL_S)


async def _update(js: JetStreamContext, have: api.StreamConfig, **changes: object) -> None:
    updated = api.StreamConfig.from_response(have.as_dict())
    for key, value in changes.items():
        setattr(updated, key, value)
    try:
        await js.update_stream(updated)
    except APIError as exc:
        raise UncaptureError(f"cannot update stream {have.name}: {exc.description}") from None


async def _in_log(js: JetStreamContext, config: Config, endpoints: list[str]) -> dict[str, int]:
    """Each endpoint's events in the namespace's log: the server counts its messages, and a
    forwarded batch's header says how many it holds (read headers only)."""
    try:
        info = await js.stream_info(
            config.events_stream, subjects_filter=captured_subjects(config.namespace)
        )
    except NotFoundError:
        return dict.fromkeys(endpoints, 0)
    counts = info.state.subjects or {}
    held = {}
    for e in endpoints:
        subject = captured_subject(config.namespace, e)
        held[e] = await _events_on(js, config.events_stream, subject, counts.get(subject, 0))
    return held


async def _events_on(js: JetStreamContext, stream: str, subject: str, messages: int) -> int:
    """The events the first ``messages`` messages on ``subject`` hold."""
    if not messages:
        return 0
    seen, total = 0, 0
    done = asyncio.Event()

    async def take(msg: Msg) -> None:
        nonlocal seen, total
        seen += 1
        total += events_held(msg.headers)
        if seen >= messages:
            done.set()

    sub = await js.subscribe(
        subject,
        stream=stream,
        ordered_consumer=True,
        config=api.ConsumerConfig(headers_only=True),
        cb=take,
    )
    try:
        await asyncio.wait_for(done.wait(), DRAIN_S)
    finally:
        await sub.unsubscribe()
    return total


async def require_captured(nc: Client, config: Config, endpoints: tuple[str, ...]) -> None:
    """Refuse (:class:`UncaptureError`) endpoints the namespace does not capture: a mistyped
    ``--dynamo-endpoint`` is said, never answered as an endpoint with nothing in flight."""
    info = await _capture_info(nc, config)
    _require_captured(config, list(info.config.subjects or []), endpoints)


async def _capture_info(nc: Client, config: Config) -> api.StreamInfo:
    name = dynamo_capture(config)
    try:
        return await nc.jetstream().stream_info(name)
    except NotFoundError:
        raise UncaptureError(
            f"namespace {config.namespace!r} captures no Dynamo endpoint (no stream {name})"
        ) from None


def _require_captured(config: Config, subjects: list[str], endpoints: tuple[str, ...]) -> list[str]:
    """The endpoints the capture stream's ``subjects`` name; refuses any of ``endpoints`` not
    among them."""
    captured = [e for e in map(endpoint_of, subjects) if e is not None]
    unknown = [e for e in endpoints if e not in captured]
    if unknown:
        raise UncaptureError(
            f"namespace {config.namespace!r} does not capture Dynamo "
            f"endpoint{'' if len(unknown) == 1 else 's'} {', '.join(unknown)}; it captures "
            + (", ".join(captured) if captured else "none (run this without --dynamo-endpoint)")
        )
    return captured
