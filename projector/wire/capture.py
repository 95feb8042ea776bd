"""Where a Dynamo deployment's own replica-sync events are captured, and under which names.

A Dynamo KV router started with ``--router-replica-sync`` on the NATS event plane publishes
each AddRequest, MarkPrefillCompleted and Free it decides on NATS Core, fire-and-forget, at
``namespace.<NS>.component.<C>.endpoint.<E>.active_sequences_events``. Nothing stores them
unless a stream listens. So a namespace given ``--dynamo-endpoint NS.C.E`` gets a capture
stream of its own listening on those subjects (JetStream stores every Core publish, while
seqstate's processes are up or not), and the writer's forwarder (:mod:`projector.dynamo.forward`)
stores what it captures in the events stream, each burst as one record batch, under the
namespace's own subject: ``seqstate.events.<ns>.dynamo.<NS>.<C>.<E>``. (An events stream
provisioned before the forwarder *sourced* the capture stream with :func:`rewrite`, a message
each; the forwarder takes over from the last one sourced.)

Why not list Dynamo's subjects in the events stream itself: every reader of the namespace
(the writer's consumer, replay, verify, rebuild, status, lag, retention) filters the stream by
``seqstate.events.<ns>.>``; a rewritten subject falls under that filter, so each of them reads
Dynamo's events without knowing the flag was ever given, and the one fold knows a Dynamo
message by its subject alone. Several namespaces can each capture their own endpoints into
one shared events stream.
"""

from __future__ import annotations

from typing import Final

from seqstate.dynamo import CAPTURED, TOPIC, captured_subject, dynamo_subject, endpoint_of

# Dynamo's subject of any endpoint, with the three tokens the rewrite keeps.
RAW_PATTERN: Final = f"namespace.*.component.*.endpoint.*.{TOPIC}"
CAPTURE_MAX_AGE_S: Final = 24 * 3600.0


def rewrite(namespace: str) -> str:
    """The rewrite of a raw subject into :func:`captured_subject`'s as a JetStream subject
    transform: how an events stream provisioned before the forwarder sourced the capture."""
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
