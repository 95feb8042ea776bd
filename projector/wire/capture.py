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

TOPIC: Final = "active_sequences_events"
# Dynamo's subject of any endpoint, with the three tokens the rewrite keeps.
RAW_PATTERN: Final = f"namespace.*.component.*.endpoint.*.{TOPIC}"
CAPTURE_MAX_AGE_S: Final = 24 * 3600.0


def raw_subject(endpoint: str) -> str:
    """Dynamo's subject for ``NS.COMPONENT.ENDPOINT`` (a checked setting)."""
    ns, component, name = endpoint.split(".")
    return f"namespace.{ns}.component.{component}.endpoint.{name}.{TOPIC}"


def captured_subject(namespace: str, endpoint: str) -> str:
    """The subject an event of ``endpoint`` has in the namespace's log."""
    return f"seqstate.events.{namespace}.dynamo.{endpoint}"


def rewrite(namespace: str) -> str:
    """The events stream's rewrite of a captured subject (a JetStream subject transform)."""
    tokens = ".".join("{{wildcard(" + str(n) + ")}}" for n in (1, 2, 3))
    return f"seqstate.events.{namespace}.dynamo.{tokens}"


def capture_stream(events_stream: str, namespace: str) -> str:
    """The namespace's capture stream: beside its events stream, one per namespace."""
    return f"{events_stream}_DYNAMO_{namespace}"
