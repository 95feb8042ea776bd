"""Dead letters: where a consumer puts what it cannot read, so that it can go on.

Both consumers (the writer for events, the projector for deltas) dead-letter the same way,
here. A dead letter must always be storable: a message near the server's payload limit plus
the reason in headers would exceed it, the server would drop the connection, and the consumer
would retry the same message forever. So a dead letter carries a bounded prefix of the
payload and a reference to the original (stream and sequence, where it still is), and says
how big the original was. Its msg-id is the original's position, so a consumer that crashed
and re-read the message writes its dead letter once. An event refused inside a record batch
is a dead letter of its own (its neighbours applied): it carries that event's bytes and its
index in the batch (``Seqstate-Source-Index``), and its msg-id names both.

The log hears of dead letters at a bounded rate: the first is logged at once, in full; those
that follow within ``LOG_EVERY_S`` are counted, and one line per interval says how many, of
which kinds, and names the last (20,000 hostile messages once made 20,000 lines). A quiet
interval later, the next is logged at once again. ``counts`` (the metrics) stays exact.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

from nats.js import JetStreamContext

from projector.nats.failures import ATTEMPT_TIMEOUT_S, retrying
from projector.settings.logs import Quiet
from projector.wire.headers import (
    MSG_ID,
    REASON,
    SIZE,
    SOURCE_INDEX,
    SOURCE_SEQ,
    SOURCE_STREAM,
    SUBJECT,
    TRUNCATED,
)
from seqstate import fold

log = logging.getLogger("seqstate.dead")

# Why a message was dead-lettered, in one bounded word each: a metric's label
# (``seqstate_dead_letters_total{reason}``), where the free-text reason could not go. The
# writer's are the fold's refusals (seqstate.fold, the one fold of the log).
UNDECODABLE = fold.UNDECODABLE  # not an event (a delta) at all, or one with invalid fields
TOO_LARGE = fold.TOO_LARGE  # an event whose delta could never fit a message
OUT_OF_BOUNDS = fold.OUT_OF_BOUNDS  # an event that would pass a bound of the write model
WRONG_SUBJECT = fold.WRONG_SUBJECT  # an event on another subject than its own
IMPLAUSIBLE = "implausible"  # a delta no writer of the namespace could have written
WRITER_KINDS = fold.KINDS  # of events
PROJECTOR_KINDS = (UNDECODABLE, IMPLAUSIBLE)  # of deltas

PREFIX_BYTES = 64 * 1024  # of a large payload, enough to see what it was
REASON_CHARS = 1000
HEADROOM = 4096  # for the headers and the protocol line, under the server's limit
LOG_EVERY_S = 10.0  # at most one line per this many seconds about dead letters, after the first


def one_line(text: str, limit: int = REASON_CHARS) -> str:
    """A header value: one line (a CR or LF would end the header), at most ``limit`` chars."""
    flat = re.sub(r"[\r\n]+", " ", text)
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


class DeadLetters:
    """Writes a namespace's dead letters; ``counts`` holds how many of each kind were written
    (what the metrics export: read at scrape time, nothing to keep in step), for each of the
    ``kinds`` its consumer can write, so that each is a series from the start."""

    def __init__(
        self,
        js: JetStreamContext,
        *,
        namespace: str,
        subject: str,
        max_payload: int,
        kinds: tuple[str, ...],
        log_every_s: float = LOG_EVERY_S,
    ) -> None:
        self._js = js
        self._namespace = namespace
        self._subject = subject
        self._keep = max(0, min(PREFIX_BYTES, max_payload - HEADROOM))
        self.counts: dict[str, int] = dict.fromkeys(kinds, 0)
        # The log's side: a dead letter held is counted by kind, the last one kept in words.
        self._quiet = Quiet(log_every_s, self._say_held)
        self._held: dict[str, int] = {}
        self._last = ""

    async def put(
        self,
        stream: str,
        seq: int,
        subject: str,
        payload: bytes,
        reason: str,
        *,
        kind: str,
        fields: Mapping[str, Any] | None = None,
        index: int | None = None,
    ) -> None:
        """Dead-letter message ``seq`` of ``stream`` (``index``: its event at that index of a
        record batch, ``payload`` that event's bytes); raises if the server will not store it.

        ``reason`` is free text for whoever reads the dead letter; ``kind`` (one of ``KINDS``)
        is the bounded word it is counted under. ``fields``: the log context known of the
        message (its request id, worker...); the log line gives the payload's size, never the
        payload."""
        if kind not in self.counts:
            raise ValueError(f"dead letter kind {kind!r}: not one of {tuple(self.counts)}")
        at = f"{seq}" if index is None else f"{seq} event {index}"
        said = f"{stream} {at} on {subject} ({len(payload)} bytes): {one_line(reason, 300)}"
        position = f"{seq}" if index is None else f"{seq}.{index}"
        headers = {
            MSG_ID: f"dead:{self._namespace}:{stream}:{position}",
            REASON: one_line(reason),
            SOURCE_STREAM: stream,
            SOURCE_SEQ: str(seq),
            SUBJECT: one_line(subject, 256),
            SIZE: str(len(payload)),
        }
        if index is not None:
            headers[SOURCE_INDEX] = str(index)
        kept = payload
        if len(payload) > self._keep:
            kept = payload[: self._keep]
            headers[TRUNCATED] = "true"
        subject = self._subject
        await retrying(
            lambda: self._js.publish(subject, kept, headers=headers, timeout=ATTEMPT_TIMEOUT_S),
            f"dead letter of {stream} {at}",
        )
        self.counts[kind] += 1
        self._tell(kind, said, {**(fields or {}), "stream_seq": seq})

    def _tell(self, kind: str, said: str, fields: Mapping[str, Any]) -> None:
        """Log this dead letter now, if the log has been quiet for an interval; else hold
        it for the interval's line."""
        if self._quiet.now():
            log.warning("dead letter: %s", said, extra={**fields, "namespace": self._namespace})
            return
        self._held[kind] = self._held.get(kind, 0) + 1
        self._last = said

    def say_held(self) -> None:
        """The line for the dead letters held since the last one (none: nothing said); a
        consumer that stops says it at once."""
        self._quiet.flush()

    def _say_held(self, span_s: float) -> None:
        held, self._held = self._held, {}
        kinds = ", ".join(f"{kind} {n:,}" for kind, n in sorted(held.items()))
        log.warning(
            "dead letters: %s more in the last %.1fs (%s); the last: %s",
            f"{sum(held.values()):,}",
            span_s,
            kinds,
            self._last,
            extra={"namespace": self._namespace},
        )
