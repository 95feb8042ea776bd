"""The msg-ids of the events stream: unguessable to anyone who cannot read that stream.

JetStream stores a message once per ``Nats-Msg-Id`` within the stream's duplicate window, and
the events stream also stores what it copies in from the Dynamo capture: a header a client
puts on a Dynamo subject comes along (nats-server offers no way to drop it while sourcing) and
takes part in the same deduplication. A client that may publish on Dynamo's subjects (the
``dynamo`` role) could thus take a msg-id before its owner and have the owner's event dropped
as a duplicate: a router's, whose ids were ``<router_id>:<n>``, or the writer's Tick. So every
id seqstate gives an event ends in a tag no such client can know:

- a router's (:class:`~projector.route.publisher.RouterPublisher`):
  ``<router_id>:<n>:<tag>``, the tag drawn at random per publisher, or, for ``seqstate
  publish``, derived from the events stream's own key (:data:`KEY`, in its metadata, which
  only a client that may read the stream's info sees) and the router id, so that a second run
  with the same router id meets its first run's ids (and is refused, or resumes);
- the writer's Tick: ``tick:<namespace>:<position>:<tag>``, from the same key, so that two
  writers at one position still log one Tick.

A tag is 16 hex digits (64 bits). What the Dynamo role sees of seqstate (nothing of its
subjects, none of its replies: they go to inboxes of each role's own) gives it no id.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from typing import Final
from urllib.parse import unquote

KEY: Final = "seqstate_msg_id_key"  # the events stream's metadata entry holding the key
TAG_HEX: Final = 16
_ROUTER_ID: Final = re.compile(r"(.*):([1-9][0-9]*):([0-9a-f]{16})", re.DOTALL)
_LEGACY: Final = re.compile(r"(.*):([1-9][0-9]*)", re.DOTALL)


def new_key() -> str:
    """A key for a new events stream's metadata."""
    return secrets.token_hex(16)


def tag(key: str | None, what: str) -> str:
    """The tag of ids of ``what`` under ``key`` (None: a random one, never the same twice)."""
    if key is None:
        return secrets.token_hex(TAG_HEX // 2)
    mac = hashlib.blake2b(what.encode(), key=key.encode(), digest_size=TAG_HEX // 2)
    return mac.hexdigest()


def tick_tag(key: str | None, namespace: str) -> str:
    """The tag of ``namespace``'s Ticks: ``tick:<namespace>:<position>:<tag>``."""
    return tag(key, f"tick:{namespace}")


def router_of(msg_id: str) -> tuple[str, int] | None:
    """``(router_id, n)`` of a router's msg-id (``<router_id>:<n>:<tag>``, or the
    ``<router_id>:<n>`` of logs written before tags), or None."""
    found = _ROUTER_ID.fullmatch(msg_id) or _LEGACY.fullmatch(msg_id)
    if found is None:
        return None
    return unquote(found[1]), int(found[2])
