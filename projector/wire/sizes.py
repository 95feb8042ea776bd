"""How large an event may be: one rule, applied alike at every door.

The fold applies an event of at most ``max_event_bytes`` (``seqstate.fold``: a setting, the
same for every fold of a log, 1 MiB less 5 KiB by default) and dead-letters a larger one as
``too_large``, whichever door it came through (a router, ``seqstate publish``, serve-http's
``POST /add``, a captured Dynamo message, a raw JetStream publish). Its delta must fit one
message of the server: the event, plus ``EVENT_MARGIN`` for what a delta adds to it (its
rank, load and envelope), plus ``DELTA_HEADROOM`` for the message's headers, must be within
the server's ``max_payload``. So the writer refuses to start where ``max_event_bytes`` is over
:func:`largest_event` of its server, and every door that publishes refuses an event over
:func:`event_limit`: the smaller of the two, which is ``max_event_bytes`` wherever a writer
runs. Bucket values stay within the payload limit too, whatever an event's hashes take: a
long prompt's slot is cut into keys of a fixed size (:mod:`projector.wire.values`).
"""

from __future__ import annotations

from typing import Final

from seqstate.batches import MAX_BYTES as MAX_BATCH_BYTES

DELTA_HEADROOM: Final = 4096  # under the server's payload limit: headers, the protocol line
EVENT_MARGIN: Final = 1024  # what a delta adds to its event's bytes: rank, load, envelope
EVENT_ROOM: Final = DELTA_HEADROOM + EVENT_MARGIN


def largest_event(max_payload: int) -> int:
    """The largest event whose delta surely fits one message of a server whose payload limit
    is ``max_payload``."""
    return max_payload - EVENT_ROOM


def batch_limit(max_payload: int) -> int:
    """The most bytes a record batch may take on a server of ``max_payload``: the batches'
    own bound, and room for the message's headers."""
    return min(max_payload - DELTA_HEADROOM, MAX_BATCH_BYTES)


def event_limit(max_payload: int, max_event_bytes: int) -> int:
    """The largest event a door lets through to a server of ``max_payload``."""
    return min(max_event_bytes, largest_event(max_payload))


def oversize(size: int, max_payload: int, max_event_bytes: int) -> str:
    """Why an event of ``size`` encoded bytes is refused, naming the limit and where it comes
    from ("" if it is not)."""
    limit = event_limit(max_payload, max_event_bytes)
    if size <= limit:
        return ""
    if max_event_bytes < largest_event(max_payload):
        why = "max_event_bytes, the largest event the writer applies"
    else:
        why = f"the server's max_payload of {max_payload:,} less {EVENT_ROOM:,} for its delta"
    return f"{size:,} bytes encoded, over the {limit:,} bytes one event may take ({why})"
