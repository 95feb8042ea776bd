"""What a live Dynamo 1.6.1 fleet does with the operator's edges, beside seqstate.

Four messages an operator's tooling (or a forger) can put on an endpoint's subject, published
among the fleet's real traffic: a worker map without its ``dp_rank``, a message of another
topic, an empty request id, then a valid AddRequest. Both frontends book the valid one and the
empty id; neither books the worker without its ``dp_rank`` (each logs "missing field
`dp_rank`") nor the other topic (ignored without a word). seqstate books the valid one and the
rankless worker on its rank 0, and refuses the other topic and the empty id (every empty id
would be one request). The two differences are rows of docs/dynamo.md. Frees of what
was booked leave every gauge at zero, as the module found them.
"""

from __future__ import annotations

import msgspec
import pytest
from dynamo_capture import CAPTURE, variant
from dynamo_kit import nonzero, scrape
from eventually import eventually
from fleet import EVENTS_SUBJECT
from live import LiveFleet
from seqstate_kit import Seqstate, lacks  # noqa: F401 (lacks: the skipif)

from seqstate.dynamo import ADD, FREE, DynamoMessage, decode_dynamo, encode_dynamo

pytestmark = [
    pytest.mark.dynamo,
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.skipif(
        "lacks('--dynamo-endpoint', 'run')", reason="seqstate run has no --dynamo-endpoint"
    ),
]

MESSAGES = [decode_dynamo(c.data) for c in CAPTURE]
_ADD = next(m for m in MESSAGES if m.op == ADD)
_FREE = next(m for m in MESSAGES if m.op == FREE)
PUBLISHER = 4_747_474_747  # no Dynamo process of the fleet drew it
TAG = 7_000_000_000  # block hashes of this module alone


def ours(
    base: DynamoMessage, sequence: int, rid: str, rank: tuple[int, int], **more: object
) -> bytes:
    """``base`` from this module's publisher, for request ``rid`` on ``rank``."""
    message = msgspec.structs.replace(
        base,
        publisher_id=PUBLISHER,
        sequence=sequence,
        request_id=rid,
        worker_id=rank[0],
        dp_rank=rank[1],
        **more,
    )
    return encode_dynamo(message)


def add(sequence: int, rid: str, rank: tuple[int, int], blocks: int, tag: int) -> bytes:
    hashes = [TAG + tag + i for i in range(blocks)]
    return ours(_ADD, sequence, rid, rank, token_sequence=hashes, prefill_tokens=None)


def free(sequence: int, rid: str, rank: tuple[int, int]) -> bytes:
    return ours(_FREE, sequence, rid, rank)


async def views(live: LiveFleet) -> list[dict[tuple[int, int], int]]:
    return [nonzero((await scrape(f.http_port)).decode) for f in live.frontends]


async def test_the_edges_on_dynamo_and_on_seqstate(live: LiveFleet, seqstate: Seqstate) -> None:
    first, second, third = sorted(live.fleet.ranks())
    no_rank = variant(add(0, "edge-no-rank", second, 7, 100), worker={"worker_id": second[0]})
    other_topic = variant(add(1, "edge-topic", first, 13, 200), topic="kv-events")
    empty = add(2, "", third, 11, 300)
    valid = add(3, "edge-valid", first, 5, 400)
    nc = live.capture.nc
    for data in (no_rank, other_topic, empty, valid):  # in order: a replica applies in order
        await nc.publish(EVENTS_SUBJECT, data)
    await nc.flush()
    await eventually(
        lambda: views(live),
        lambda vs: all(v == {first: 5, third: 11} for v in vs),
        what="both frontends: the valid Add and the empty id's, nothing of the other two",
        watch=live.fleet.tails,
    )
    for front in live.frontends:
        assert "replica-sync subscriber error; continuing error=missing field `dp_rank`" in (
            front.tail(400)
        ), front.tail()
    ours: dict[tuple[int, int], tuple[int, int]] = {first: (5, 1)}
    blocks, requests = ours.get((second[0], 0), (0, 0))
    ours[(second[0], 0)] = (blocks + 7, requests + 1)  # the rankless worker's rank 0
    await eventually(
        seqstate.loads,
        lambda rows: {r: (v["blocks"], v["requests"]) for r, v in rows.items()} == ours,
        what=f"seqstate: the valid Add and the rankless one on rank 0: {ours}",
        watch=seqstate.tail,
    )
    for data in (
        free(4, "edge-valid", first),
        free(5, "", third),
        free(6, "edge-no-rank", (second[0], 0)),
    ):
        await nc.publish(EVENTS_SUBJECT, data)
    await nc.flush()
    await eventually(
        lambda: views(live),
        lambda vs: all(v == {} for v in vs),
        what="every gauge back at zero",
        watch=live.fleet.tails,
    )
    await eventually(seqstate.loads, lambda rows: rows == {}, what="seqstate: nothing in flight")
