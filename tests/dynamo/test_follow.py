"""seqstate beside a live Dynamo 1.6.1 fleet with no hand on the wheel, on file discovery and on
etcd: ``seqstate run --dynamo-endpoint`` started with the fleet's environment, and no other
command, through frontend starts and restarts and a worker's death.

- A frontend started late, and one restarted, equal their peers within 2 s of registering
  (seqstate resyncs each as its channel appears in discovery).
- A SIGKILLed mocker leaves ``loads`` as it leaves the frontends (when discovery drops it), and
  never comes back; a new worker's ranks come in, idle, before any request reaches it.
"""

from __future__ import annotations

import json
import time

import pytest
from dynamo_kit import close_all, nonzero, scrape
from eventually import eventually
from fleet import Frontend
from live import LiveFleet
from seqstate_kit import Seqstate, agree, per_rank
from test_seqstate import hold

pytestmark = [pytest.mark.dynamo, pytest.mark.asyncio(loop_scope="module")]
DISCOVERIES = ("file", "etcd")

Rank = tuple[int, int]


async def registered_late(live: LiveFleet, name: str, before: set[int]) -> tuple[Frontend, float]:
    """A frontend started now; returns it and when its channel appeared in discovery."""
    front = live.fleet.start_frontend(name)
    channels = await eventually(
        lambda: set(live.fleet.channels()) - before,
        bool,
        what=f"{name}'s active_sequences_events channel in discovery",
        timeout=60,
        interval=0.02,
        check=front.check,
        watch=live.fleet.tails,
    )
    assert len(channels) == 1, channels
    return front, time.monotonic()


async def equal_within(front: Frontend, expected: dict[Rank, int], since: float) -> float:
    """How long after ``since`` ``front``'s decode gauges show ``expected``."""
    await eventually(
        lambda: scrape(front.http_port),
        lambda g: nonzero(g.decode) == expected,
        what=f"{front.name}'s decode gauges == {expected}",
        timeout=30,
        interval=0.02,
        retry_on=(OSError,),
    )
    return time.monotonic() - since


async def test_a_late_and_a_restarted_frontend_equal_their_peers_within_2s(
    live: LiveFleet, seqstate: Seqstate
) -> None:
    """Streams held through the two frontends; a third starts and, with no command run, shows
    the same decode blocks as they do within 2 s of its channel appearing; SIGKILLed and
    started again (a new publisher id), the same. seqstate counts each request once."""
    rids, streams = await hold(live, 20_000_000, 6)
    late: Frontend | None = None
    try:
        requests = per_rank(live, rids)
        await agree(live, seqstate, requests, "6 streams held")
        expected = nonzero((await scrape(live.frontends[0].http_port)).decode)
        took = []
        for name in ("frontend-late", "frontend-restarted"):
            before = set(live.fleet.channels())
            late, registered = await registered_late(live, name, before)
            took.append(await equal_within(late, expected, registered))
            await agree(live, seqstate, requests, f"{name} included")
            if name == "frontend-late":
                live.fleet.kill_proc(late)
                late = None
        assert all(t < 2.0 for t in took), took
    finally:
        await close_all(streams)
    try:
        await agree(live, seqstate, {}, "the drain")
    finally:
        if late is not None:
            live.fleet.stop_proc(late)


async def ranks_shown(seqstate: Seqstate) -> set[Rank]:
    """Every rank ``loads`` shows, idle ones included."""
    rc, out, err = await seqstate.cli("loads", "--json")
    assert rc == 0, err
    return {(row["worker_id"], row["dp_rank"]) for row in map(json.loads, out.splitlines())}


async def test_a_killed_worker_leaves_loads_with_the_frontends_and_a_new_one_comes_in(
    live: LiveFleet, seqstate: Seqstate
) -> None:
    """The single-rank mocker SIGKILLed with requests on it: its rank leaves seqstate's
    ``loads`` no later than 2 s after it leaves the frontends' registered workers, and stays
    out through more traffic. A mocker started again (a new instance id) shows in ``loads``,
    idle, as soon as discovery has it."""
    victim = next(m for m in live.fleet.mockers if live.fleet.worker_of(m) is not None)
    dead = live.fleet.worker_of(victim)
    assert dead is not None
    await eventually(
        lambda: ranks_shown(seqstate),
        lambda ranks: ranks >= live.fleet.ranks(),
        what="every rank of discovery in loads",
        watch=seqstate.tail,
    )
    _rids, streams = await hold(live, 30_000_000, 6)
    try:
        live.fleet.kill_proc(victim)
        killed = time.monotonic()
        fronts = list(live.frontends)

        async def registered() -> list[frozenset[Rank]]:
            return [(await scrape(f.http_port)).registered for f in fronts]

        await eventually(
            registered,
            lambda views: all(not any(w == dead for w, _ in v) for v in views),
            what="both frontends dropped the dead worker",
            timeout=60,
            interval=0.05,
        )
        frontends_dropped = time.monotonic()
        await eventually(
            lambda: ranks_shown(seqstate),
            lambda ranks: not any(w == dead for w, _ in ranks),
            what="seqstate's loads dropped the dead worker",
            timeout=30,
            interval=0.05,
            watch=seqstate.tail,
        )
        lag = time.monotonic() - frontends_dropped
        assert lag < 2.0, (lag, frontends_dropped - killed)
        await close_all(streams)
        more, streams = await hold(live, 31_000_000, 4)
        await agree(live, seqstate, per_rank(live, more), "after the kill")
        assert not any(w == dead for w, _ in await ranks_shown(seqstate))
    finally:
        await close_all(streams)
    await agree(live, seqstate, {}, "the drain")
    assert not any(w == dead for w, _ in await ranks_shown(seqstate))
    _, fresh = await live.new_mocker("mocker-back")
    assert fresh != dead
    await eventually(
        lambda: ranks_shown(seqstate),
        lambda ranks: (fresh, 0) in ranks,
        what="the new worker's rank in loads, idle",
        timeout=30,
        watch=seqstate.tail,
    )
