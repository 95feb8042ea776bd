"""The raw capture of a real Dynamo 1.6.1 fleet's replica-sync traffic, for the tests.

155 messages two KV-router frontends (with ``--router-replica-sync``) and two mocker workers
(one with dp 2) published on NATS Core, recorded once from a live fleet into ``tests/data`` so
that the tests need no fleet: each with its subject, the time it was seen (ns) and its bytes,
in the order seen.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Final, NamedTuple

import msgspec

PATH: Final = Path(__file__).resolve().parents[1] / "data" / "replica-sync-1.6.1.jsonl"


class Captured(NamedTuple):
    subject: str
    t_ns: int
    data: bytes


def _load() -> list[Captured]:
    rows = []
    for line in PATH.read_text().splitlines():
        row = json.loads(line)
        rows.append(Captured(row["subject"], row["t_ns"], base64.b64decode(row["data_b64"])))
    return rows


CAPTURE: Final = _load()
SUBJECT: Final = "namespace.dynamo.component.backend.endpoint.generate.active_sequences_events"
ENDPOINT: Final = "dynamo.backend.generate"
# The processes of the capture: two frontends (router replicas) and two workers, with the
# publisher id each drew and, for a worker, its worker id (its Marks name it as their router).
FRONTEND_A: Final = 5396769825624678  # router_id 60572485714993071
FRONTEND_B: Final = 3443434125927359  # router_id 12694754911180156447
WORKER_DP2: Final = 2757362059656683  # worker 18391909055928191313, ranks 0 and 1
WORKER_DP1: Final = 6703009540806474  # worker 8764477833420859781
BIG_WORKER: Final = 18391909055928191313  # above 2^63
SMALL_WORKER: Final = 8764477833420859781


def variant(data: bytes, *, topic: str | None = None, **event: object) -> bytes:
    """The message ``data`` with its envelope's ``topic`` and its event's fields replaced:
    the mistakes the tests feed the ledger, on real bytes."""
    envelope = msgspec.msgpack.decode(data)
    payload = msgspec.msgpack.decode(envelope["payload"])
    payload.update(event)
    envelope["payload"] = msgspec.msgpack.encode(payload)
    if topic is not None:
        envelope["topic"] = topic
    return msgspec.msgpack.encode(envelope)


# A worker map without its dp_rank: rank 0, booked.
NO_RANK: Final = variant(CAPTURE[0].data, worker={"worker_id": BIG_WORKER})
# An empty request id, another topic: each refused, the reason the fold gives.
EDGES: Final = {
    "an empty request id": (
        variant(CAPTURE[0].data, request_id=""),
        "invalid Dynamo event: an empty request_id (a Mark or a Free finds its request by id: "
        "every empty one would name the same request) - at `$.request_id`",
    ),
    "another topic": (
        variant(CAPTURE[0].data, topic="kv-events"),
        "invalid Dynamo envelope: topic 'kv-events' is not 'active_sequences_events' (Dynamo's "
        "replicas ignore a message of another topic) - at `$.topic`",
    ),
}
