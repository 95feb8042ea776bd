"""How a Dynamo 1.6.1 frontend expires the requests it holds, with a short expiry
(``DYN_ROUTER_ACTIVE_REQUEST_EXPIRY_SECS=4`` on both frontends; the default is 300 s): the
rule a ledger that expires as Dynamo does must follow (README.md, "Expiry").

A frontend scans its requests every S seconds, on a clock of its own (its own phase), and
drops a PEER's request at the second scan after its AddRequest (second chance): between S
and 2S after the Add. Nothing on the wire refreshes that: not the worker's Mark, not a peer's
Mark, not the same AddRequest again (a duplicate, ignored while the request is there; after
the drop it adds the request anew). The frontend that routed a request keeps it while its
stream lives.

Peers' requests here are forged (dynamo_kit.Forger) on workers that no discovery lists
(a frontend applies those too), one worker id per request, so that each request has a gauge
series of its own and its drop is seen exactly.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
import uuid
from collections.abc import Awaitable, Callable

import pytest
from dynamo_kit import Forger, Gauges, Stream, add_of, block, scrape
from eventually import eventually
from live import LiveFleet

pytestmark = [pytest.mark.dynamo, pytest.mark.asyncio(loop_scope="module")]

EXPIRY_S = 4.0
FRONTEND_ENV = {"DYN_ROUTER_ACTIVE_REQUEST_EXPIRY_SECS": str(int(EXPIRY_S))}
# How late a drop may be seen: a poll of both frontends' /metrics, on a busy machine.
SEEN_S = 1.0
# How much earlier than a scan seen from a probe's drop the frontend's later scans may fall:
# the probe's drop was itself seen up to a poll late.
SCAN_JITTER_S = 0.5
POLL_S = 0.02


def forger(live: LiveFleet) -> Forger:
    return Forger(live.capture.nc, random.getrandbits(53), random.getrandbits(53))


def ghosts(count: int) -> list[tuple[int, int]]:
    """Ranks of workers no discovery lists: one per forged request, a series each."""
    base = random.getrandbits(40) << 8
    return [(base + i, 0) for i in range(count)]


async def views(live: LiveFleet) -> dict[str, Gauges]:
    return {f.name: await scrape(f.http_port) for f in live.frontends}


async def watch(
    live: LiveFleet,
    until: Callable[[float], bool],
    on_poll: Callable[[float, dict[str, Gauges]], Awaitable[None] | None],
) -> None:
    """Poll both frontends every ``POLL_S`` until ``until(now)``; ``on_poll(now, views)``."""
    while not until(time.time()):
        live.fleet.check()
        got = await views(live)
        result = on_poll(time.time(), got)
        if result is not None:
            await result
        await asyncio.sleep(POLL_S)


async def test_a_peer_s_request_goes_between_one_and_two_scans_after_its_add(
    live: LiveFleet,
) -> None:
    """One stream held through frontend 1: frontend 2 drops its copy between S and 2S after
    its AddRequest (its worker's Mark, a few ms later, changes nothing), while frontend 1
    keeps it for as long as the stream lives (three scans and more). Six forged peer requests,
    sent 0.7 s apart (so across a whole scan period), go from both frontends between S and 2S
    after their Adds; how long each lasted varies with its phase by at least S/2: a scan
    every S, not a fixed lifetime."""
    f1, f2 = live.frontends
    rid = str(uuid.uuid4())
    prompt = block(70_000_001) + block(70_000_002) + "1"
    stream = await Stream(rid, f1.http_port, prompt, 2000).open()
    try:
        add = await eventually(
            lambda: live.capture.adds([rid]).get(rid),
            what="the held stream's AddRequest",
            watch=live.fleet.tails,
        )
        added = add.envelope.published_at / 1000
        rank = add.rank
        await eventually(
            lambda: views(live),
            lambda got: all(g.decode.get(rank) == 2 for g in got.values()),
            what="both frontends show the held stream's two blocks",
            watch=live.fleet.tails,
        )
        dropped: dict[str, float] = {}

        def poll(now: float, got: dict[str, Gauges]) -> None:
            for name, gauges in got.items():
                if not gauges.decode.get(rank) and name not in dropped:
                    dropped[name] = now

        # Until three scans are past: frontend 2 has dropped it by then, frontend 1 has not.
        await watch(live, lambda now: now > added + 3 * EXPIRY_S, poll)
        assert f1.name not in dropped, dropped
        assert EXPIRY_S < dropped[f2.name] - added <= 2 * EXPIRY_S + SEEN_S, dropped
        assert not stream.finished.is_set()
        assert (await scrape(f1.http_port)).decode.get(rank) == 2
    finally:
        await stream.close()

    peer = forger(live)
    ranks = ghosts(6)
    sent: dict[tuple[int, int], float] = {}
    gone: dict[tuple[str, tuple[int, int]], float] = {}
    for where in ranks:
        await peer.send(str(uuid.uuid4()), where, add_of([random.getrandbits(64)]))
        sent[where] = time.time()
        await asyncio.sleep(0.7)  # the phase of the next one: spacing, not a wait

    def seen_gone(now: float, got: dict[str, Gauges]) -> None:
        for name, gauges in got.items():
            for where in ranks:
                if (name, where) not in gone and gauges.decode.get(where) == 0:
                    gone[(name, where)] = now

    last = max(sent.values())
    await watch(live, lambda now: len(gone) == 12 or now > last + 4 * EXPIRY_S, seen_gone)
    assert len(gone) == 12, sorted(gone)
    for name in (f1.name, f2.name):
        lived = [gone[(name, where)] - sent[where] for where in ranks]
        assert all(EXPIRY_S < t <= 2 * EXPIRY_S + SEEN_S for t in lived), (name, lived)
        assert max(lived) - min(lived) >= EXPIRY_S / 2, (name, lived)


# What each trial sends, at seconds after a scan of the frontend it is timed for, and when
# that frontend drops the request: at the second scan (2S) after its Add, or at the third (3S)
# when its first Mark came after the first scan. "add" carries prefill tokens, as a
# frontend's AddRequest does; "add0" a prefill hint of zero tokens; "add-" no hint at all.
TRIALS: dict[str, tuple[list[tuple[float, str]], float]] = {
    "add": ([(0.5, "add")], 2),
    "first mark after a scan": ([(0.5, "add"), (EXPIRY_S + 0.5, "mark")], 3),
    "first mark after a scan, zero prefill": ([(0.5, "add0"), (EXPIRY_S + 0.5, "mark")], 2),
    "first mark after a scan, no prefill": ([(0.5, "add-"), (EXPIRY_S + 0.5, "mark")], 2),
    "second mark after a scan": ([(0.5, "add"), (0.6, "mark"), (EXPIRY_S + 0.5, "mark")], 2),
    "add again after a scan": ([(0.5, "add"), (EXPIRY_S + 0.5, "add")], 2),
}


async def test_only_a_first_mark_after_prefill_refreshes_a_peer_s_request(
    live: LiveFleet,
) -> None:
    """Timed against each frontend's own scans (found from when a probe request goes): a
    request goes at the second scan after its Add, unless its FIRST Mark came after the first
    scan, and its Add had prefill tokens to complete: then at the third. A later Mark, a Mark
    of a request with no prefill (no hint, or a hint of zero tokens), the same AddRequest
    again: none of them refreshes. An AddRequest after the drop brings the request back."""
    peer = forger(live)
    (probe,) = ghosts(1)
    await peer.send(str(uuid.uuid4()), probe, add_of([random.getrandbits(64)]))
    scans: dict[str, float] = {}  # a scan instant of each frontend: when the probe went there

    def probe_gone(now: float, got: dict[str, Gauges]) -> None:
        for name, gauges in got.items():
            if name not in scans and gauges.decode.get(probe) == 0:
                scans[name] = now

    started = time.time()
    await watch(live, lambda now: len(scans) == 2 or now > started + 3 * EXPIRY_S, probe_gone)
    assert len(scans) == 2, scans

    plan: list[tuple[float, str, tuple[int, int], str]] = []
    expected: dict[tuple[str, tuple[int, int]], tuple[str, float]] = {}
    back: list[tuple[str, tuple[int, int]]] = []  # left in flight: freed at the end
    planned = time.time()
    for name, seen in scans.items():
        # the frontend's next scan from now on: every trial starts 0.5 s after it
        scan = seen + math.ceil((planned - seen) / EXPIRY_S) * EXPIRY_S
        scans[name] = scan
        trials = zip(TRIALS.items(), ghosts(len(TRIALS)), strict=True)
        for (trial, (steps, drop_at)), where in trials:
            rid = str(uuid.uuid4())
            plan += [(scan + at, kind, where, rid) for at, kind in steps]
            expected[(name, where)] = (trial, scan + drop_at * EXPIRY_S)
        again = ghosts(1)[0]  # an Add after the drop: the request is back
        rid = str(uuid.uuid4())
        plan += [(scan + at, "add", again, rid) for at in (0.5, 2 * EXPIRY_S + 0.5)]
        back.append((rid, again))
        expected[(name, again)] = ("add after the drop", scan + 2 * EXPIRY_S)
    plan.sort()
    hints = {"add": 16, "add0": 0, "add-": None}
    shown: dict[tuple[str, tuple[int, int]], list[tuple[float, int]]] = {}

    async def poll(now: float, got: dict[str, Gauges]) -> None:
        while plan and plan[0][0] <= now:
            _, kind, where, rid = plan.pop(0)
            hashes = [random.getrandbits(64)]
            data = "MarkPrefillCompleted" if kind == "mark" else add_of(hashes, hints[kind])
            await peer.send(rid, where, data)
        for name, gauges in got.items():
            for key in expected:
                if key[0] == name:
                    history = shown.setdefault(key, [])
                    value = gauges.decode.get(key[1], 0)
                    if not history or history[-1][1] != value:
                        history.append((now, value))

    last = max(scans.values()) + 3 * EXPIRY_S + SEEN_S
    await watch(live, lambda now: now > last, poll)
    for (name, where), (trial, drop_at) in expected.items():
        history = shown_from_first(shown[(name, where)])
        values = [value for _, value in history]
        what = (name, trial, drop_at - scans[name], [(t - scans[name], v) for t, v in history])
        if trial == "add after the drop":
            assert values[:3] == [1, 0, 1], what
        else:
            assert values == [1, 0], what
        assert drop_at - SCAN_JITTER_S <= history[1][0] <= drop_at + SEEN_S, what
    for rid, where in back:
        await peer.send(rid, where, "Free")


def shown_from_first(history: list[tuple[float, int]]) -> list[tuple[float, int]]:
    """A series' changes from its first non-zero value on (before the frontend applied the
    Add, the series does not exist: read as zero)."""
    start = next(i for i, (_, value) in enumerate(history) if value)
    return history[start:]
