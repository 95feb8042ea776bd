"""Where a Dynamo deployment's own replica-sync events are captured, and under which names.

A Dynamo KV router started with ``--router-replica-sync`` on the NATS event plane publishes
each AddRequest, MarkPrefillCompleted and Free it decides on NATS Core, fire-and-forget, at
``namespace.<NS>.component.<C>.endpoint.<E>.active_sequences_events``. Nothing stores them
unless a stream listens. So a namespace given ``--dynamo-endpoint NS.C.E`` gets a capture
stream of its own listening on those subjects (JetStream stores every Core publish, while
seqstate's processes are up or not), and its events stream *sources* the capture stream,
rewriting each subject into the namespace's own: ``seqstate.events.<ns>.dynamo.<NS>.<C>.<E>``.

Why not list Dynamo's subjects in the events stream itself: every reader of the namespace
(the writer's consumer, replay, verify, rebuild, status, lag, retention) filters the stream by
``seqstate.events.<ns>.>``; a rewritten subject falls under that filter, so each of them reads
Dynamo's events without knowing the flag was ever given, and the one fold knows a Dynamo
message by its subject alone. A stream may rewrite the subjects of each source it has, so
several namespaces can each capture their own endpoints into one shared events stream.
"""

from __future__ import annotations

from typing import Final

from seqstate.dynamo import CAPTURED, TOPIC, captured_subject, dynamo_subject, endpoint_of

# Dynamo's subject of any endpoint, with the three tokens the rewrite keeps.
RAW_PATTERN: Final = f"namespace.*.component.*.endpoint.*.{TOPIC}"
CAPTURE_MAX_AGE_S: Final = 24 * 3600.0


def rewrite(namespace: str) -> str:
    """The events stream's rewrite of a raw subject into :func:`captured_subject`'s (a
    JetStream subject transform)."""
    return captured_subject(namespace, ".".join(f"{{{{wildcard({n})}}}}" for n in (1, 2, 3)))


def captured_subjects(namespace: str) -> str:
    """Where the namespace's log holds its captured Dynamo messages (every endpoint's)."""
    return f"seqstate.events.{namespace}.{CAPTURED}.>"


def capture_stream(events_stream: str, namespace: str) -> str:
    """The namespace's capture stream: beside its events stream, one per namespace."""
    return f"{events_stream}_DYNAMO_{namespace}"


__all__ = [
    "CAPTURE_MAX_AGE_S",
    "RAW_PATTERN",
    "capture_stream",
    "captured_subject",
    "captured_subjects",
    "dynamo_subject",
    "endpoint_of",
    "rewrite",
]
