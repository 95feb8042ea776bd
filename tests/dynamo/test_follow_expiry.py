"""seqstate expires a Dynamo request when Dynamo's replicas do, on file discovery and on etcd:
both frontends run with a short scan (``DYN_ROUTER_ACTIVE_REQUEST_EXPIRY_SECS=4``) and
seqstate with the same (``--expiry-scan-s 4``), its only flag beside the endpoint.

A peer's request that nothing refreshes (an AddRequest with no prefill hint, then silence:
no Mark, no Free) leaves each frontend at its second scan after the Add, between S and 2S on
that frontend's own phase (test_fleet_expiry.py); seqstate's scans fall on multiples of S of
log time, so it drops the request in the same window, up to a poll late.
"""

from __future__ import annotations

import json
import secrets
import time
import uuid

import pytest
from dynamo_kit import Forger, add_of, nonzero, scrape
from eventually import eventually
from live import LiveFleet
from seqstate_kit import Seqstate, inspected

pytestmark = [pytest.mark.dynamo, pytest.mark.asyncio(loop_scope="module")]
DISCOVERIES = ("file", "etcd")
SCAN_S = 4.0
FRONTEND_ENV = {"DYN_ROUTER_ACTIVE_REQUEST_EXPIRY_SECS": str(int(SCAN_S))}
SEQSTATE_ARGS = ("--expiry-scan-s", str(int(SCAN_S)))
# How late a drop may be seen: a poll of /metrics, and a `loads` run plus the writer's Tick
# (at most one a second once a scan is due) on a busy machine.
SEEN_S = 2.5


async def held_by_seqstate(seqstate: Seqstate, rank: tuple[int, int]) -> int:
    rc, out, err = await seqstate.cli("loads", "--json")
    assert rc == 0, err
    for row in map(json.loads, out.splitlines()):
        if (row["worker_id"], row["dp_rank"]) == rank:
            return int(row["active_requests"])
    return 0


async def test_an_idle_request_expires_on_seqstate_when_it_does_on_the_frontends(
    live: LiveFleet, seqstate: Seqstate
) -> None:
    # Drawn afresh for each run (pytest-randomly reseeds `random` alike for every test): a
    # ghost worker of an earlier run is removed for good when seqstate next starts.
    forger = Forger(live.capture.nc, secrets.randbits(53), secrets.randbits(53))
    rank = (secrets.randbits(40) << 8, 0)  # a worker of its own: its series alone
    hashes = [secrets.randbits(63) for _ in range(3)]
    request_id = f"idle-{uuid.uuid4()}"
    await forger.send(request_id, rank, add_of(hashes))
    sent = time.monotonic()
    await eventually(
        lambda: held_by_seqstate(seqstate, rank),
        lambda n: n == 1,
        what=f"seqstate holds it on {rank}",
        watch=lambda: seqstate.tail() + "\n" + inspected(seqstate, request_id),
    )
    gone: dict[str, float] = {}
    fronts = list(live.frontends)

    async def everyone_dropped() -> bool:
        for front in fronts:
            if front.name not in gone and rank not in nonzero(
                (await scrape(front.http_port)).decode
            ):
                gone[front.name] = time.monotonic() - sent
        if "seqstate" not in gone and await held_by_seqstate(seqstate, rank) == 0:
            gone["seqstate"] = time.monotonic() - sent
        return len(gone) == len(fronts) + 1

    await eventually(
        everyone_dropped,
        bool,
        what="both frontends and seqstate dropped the idle request",
        timeout=4 * SCAN_S + 10,
        interval=0.05,
        watch=seqstate.tail,
    )
    for _who, after in gone.items():
        assert SCAN_S - 0.2 <= after <= 2 * SCAN_S + SEEN_S, gone
