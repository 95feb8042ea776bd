"""Forged Dynamo sequence numbers on a live fleet's own subject: counted, never fatal.

Anyone allowed on Dynamo's subjects can publish any publisher id and sequence. Two ids sending
sequence 0 and then 2^64 - 1 made a hole total no snapshot could encode: ``seqstate snapshot
save`` raised OverflowError and ``seqstate run`` died at every restart. Here they are sent
among the fleet's real traffic; seqstate counts them (saturated), saves its snapshot, survives
a SIGKILL and a restart from it, and still equals both frontends.
"""

from __future__ import annotations

import msgspec
import pytest
from dynamo_capture import CAPTURE
from dynamo_kit import close_all
from eventually import eventually
from fleet import EVENTS_SUBJECT
from live import LiveFleet
from seqstate_kit import Seqstate, agree, lacks, per_rank  # noqa: F401 (lacks: the skipif)
from test_seqstate import hold

from seqstate.dynamo import FREE, decode_dynamo, encode_dynamo

pytestmark = [
    pytest.mark.dynamo,
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.skipif(
        "lacks('--dynamo-endpoint', 'run')", reason="seqstate run has no --dynamo-endpoint"
    ),
]

U64_MAX = 2**64 - 1
FORGED = (4242424242, 4343434343)  # publisher ids no Dynamo process of the fleet drew
_FREE = next(m for m in map(decode_dynamo, (c.data for c in CAPTURE)) if m.op == FREE)


def forged(publisher_id: int, sequence: int) -> bytes:
    """A Free of a request nobody added, under a forged envelope."""
    message = msgspec.structs.replace(
        _FREE, publisher_id=publisher_id, sequence=sequence, request_id="forged-free"
    )
    return encode_dynamo(message)


async def status(seqstate: Seqstate) -> str:
    rc, out, err = await seqstate.cli("status")
    assert rc == 0, err
    return out


async def test_forged_sequence_numbers_never_stop_seqstate(
    live: LiveFleet, seqstate: Seqstate
) -> None:
    nc = live.capture.nc
    for publisher in FORGED:
        for sequence in (0, U64_MAX):
            await nc.publish(EVENTS_SUBJECT, forged(publisher, sequence))
    await nc.flush()
    said = await eventually(
        lambda: status(seqstate),
        lambda out: f"at least {U64_MAX} messages lost" in out,
        what="seqstate counts the forged holes, saturated",
        watch=seqstate.tail,
    )
    for publisher in FORGED:
        assert f"publisher {publisher}: {U64_MAX - 1} messages lost" in said, said
    rc, out, err = await seqstate.cli("snapshot", "save", "--no-progress")
    assert rc == 0 and out.startswith("saved and verified "), (out, err)
    seqstate.kill()
    seqstate.start()  # restores that snapshot (or a newer one of its own) and goes on
    rids, streams = await hold(live, 8_000_000, 4)
    try:
        await agree(live, seqstate, per_rank(live, rids), "4 streams held after the restart")
    finally:
        await close_all(streams)
    await agree(live, seqstate, {}, "the drain")
    assert f"at least {U64_MAX} messages lost" in await status(seqstate)
    rc, out, err = await seqstate.cli("replay", "--verify", "--no-progress")
    assert rc == 0, (out, err)
