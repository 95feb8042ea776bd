"""``seqstate loads --at WHEN`` against a real server and pipeline, typed as a user types it:
at many points it equals a fresh replay's fold to that point, starts from the nearest snapshot,
equals what ``seqstate loads --json`` printed live at that moment, and refuses in one line
what it cannot answer exactly."""

from __future__ import annotations

import asyncio
import datetime as dt
import random
import re
import subprocess
import time
from itertools import pairwise

import msgspec
import pytest
from log_text import plain_lines
from nats.aio.client import Client
from pipeline_kit import fill, folded, fresh_config, read_events, read_log, run_cli

from projector.bucket.contents import read_bucket
from projector.nats.retention import trimmed_below
from projector.nats.snapshots import SnapshotInfo, SnapshotStore
from projector.ops.loads_at import loads_at
from projector.route.publisher import RouterPublisher
from projector.run.pipeline import Pipeline
from projector.settings.config import Config
from projector.write import log_fold
from projector.write.log_fold import FAST_PATH_MIN_EVENTS, iso, parse_at, replay
from seqstate import WorkerAdded

EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)


def iso_us(ns: int) -> str:
    """``ns`` as an ISO 8601 time to the microsecond (floored, as a user would copy it)."""
    return (EPOCH + dt.timedelta(microseconds=ns // 1000)).isoformat(timespec="microseconds")


def rows_of(stdout: str) -> list[dict[str, object]]:
    return [msgspec.json.decode(line) for line in stdout.splitlines()]


def error_line(result: subprocess.CompletedProcess[str]) -> str:
    lines = plain_lines(result.stderr)
    assert result.returncode == 1 and len(lines) == 1, (result.returncode, result.stderr)
    return lines[0]


async def chunk(pub: RouterPublisher, step: int, n: int, *, modeled: bool) -> int:
    """``n`` lifecycle events on two ranks of worker 0: adds (prefill decaying when
    ``modeled``), some prefills completed, some requests freed."""
    last = 0
    for i in range(n):
        rid, rank = f"s{step}r{i}", i % 2
        if i % 4 == 3:
            last = await pub.free(f"s{step}r{i - 2}", 0, (i - 2) % 2)
        elif i % 4 == 2:
            last = await pub.mark_prefill_completed(f"s{step}r{i - 2}", 0, (i - 2) % 2)
        else:
            last = await pub.add(
                rid,
                0,
                rank,
                block_hashes=[7, 8, 1000 * step + i],
                prefill_tokens=40 + 3 * i,
                expected_prefill_ms=25.0 + i if modeled else None,
            )
    return last


async def history(nc: Client, config: Config, steps: int, *, modeled: bool = True) -> int:
    """A pipeline folding ``steps`` chunks of 12 events, each chunk's snapshot stored before
    the next (a snapshot is taken every 9 events), then stopped; the last sequence."""
    async with Pipeline(nc, config) as pipeline:
        pub = RouterPublisher(nc, namespace=config.namespace, router_id="la", config=config)
        last = await pub.publish(WorkerAdded(worker_id=0, dp_size=2))
        for step in range(steps):
            last = await chunk(pub, step, 12, modeled=modeled)
            await pipeline.wait_applied(last)
            await pipeline.writer.snapshotter.settle(20)
    return last


def snap_config(prefix: str, **overrides: object) -> Config:
    """A namespace of its own whose writer snapshots every 9 events and keeps the newest 2."""
    return fresh_config(
        prefix,
        snapshot_bucket=f"{prefix}snap{fresh_config().namespace}",
        snapshot_every_events=9,
        snapshots_keep=2,
        **overrides,
    )


def nearest(snapshots: list[SnapshotInfo], *, seq: int | None = None, at: int | None = None) -> str:
    """Where ``loads --at`` must start: the newest snapshot at or before the moment."""
    fits = [
        s
        for s in snapshots
        if (seq is None or s.applied_seq <= seq)
        and (at is None or (s.meta is not None and s.meta.as_of <= at))
    ]
    return f"snapshot {fits[-1].name}" if fits else "the first event"


async def test_loads_at_equals_a_fresh_replay_at_points_at_and_between_snapshots(
    nc: Client, nats_server: object
) -> None:
    url = nats_server.url  # type: ignore[attr-defined]
    config = snap_config("la", snapshot_history_every=20)
    last = await history(nc, config, 10)
    snapshots = await (await SnapshotStore(nc, config).open(create=False)).list()
    # The newest two, and the first past each multiple of 20 events: points far back start
    # from a history snapshot.
    at_20s = sorted({s.applied_seq // 20 for s in snapshots[:-2]})
    assert at_20s == list(range(1, at_20s[-1] + 1)) and len(at_20s) >= 3, snapshots
    log = await read_log(nc, config)
    rng = random.Random(20261205)
    seqs = {1, last}
    for s in snapshots:
        seqs |= {s.applied_seq - 1, s.applied_seq, s.applied_seq + 1}
    seqs = {s for s in seqs if 1 <= s <= last}
    while len(seqs) < 30:
        seqs.add(rng.randrange(1, last + 1))
    times = [t for _, t, _ in rng.sample(log, 6)]  # at events (to the microsecond)
    times += [rng.randrange(log[0][1], log[-1][1]) for _ in range(6)]  # between them
    for s in snapshots[:3]:  # at a snapshot's event, to the microsecond below and above
        assert s.meta is not None
        times += [s.meta.as_of, s.meta.as_of + 999]
    points = [(f"seq:{seq}", seq, None) for seq in sorted(seqs)]
    points += [(iso_us(t), None, parse_at(iso_us(t), log[-1][1])) for t in times]
    assert len(points) >= 40
    rounds = asyncio.Semaphore(3)  # a few commands at once

    events = await read_events(nc, config)

    async def check(when: str, seq: int | None, at: int | None) -> None:
        async with rounds:
            out = await run_cli(config, url, "loads", "--at", when, "--json")
        assert out.returncode == 0, out.stderr
        fresh = await replay(nc, config, from_seq=1, to_seq=seq, at_ns=at)
        assert rows_of(out.stdout) == [msgspec.to_builtins(r) for r in fresh.loads()], when
        # The same, folded here from the log's messages read one by one.
        prefix = [e for e in events if e[0] <= (seq or last) and e[1] <= (at or e[1])]
        state = folded(config, prefix)
        expected = state.registry.loads(state.now_ns if at is None else at)
        assert rows_of(out.stdout) == [msgspec.to_builtins(r) for r in expected], when
        said = plain_lines(out.stderr)
        assert len(said) == 1, out.stderr
        assert f"event {fresh.last_seq}" in said[0], (when, said)
        assert said[0].endswith(f"folded from {nearest(snapshots, seq=seq, at=at)}"), said

    await asyncio.gather(*(check(*point) for point in points))

    # The table form: the live command's table, and the moment under it.
    table = await run_cli(config, url, "loads", "--at", f"seq:{last}")
    live = await run_cli(config, url, "loads")
    assert table.returncode == live.returncode == 0, table.stderr + live.stderr
    assert table.stdout.splitlines()[:-1] == live.stdout.splitlines()[:-1]
    assert table.stdout.splitlines()[-1].startswith(f"loads as of event {last}, log time ")

    # After the newest event, not in the future: the newest state, decayed to now, said so.
    now = await run_cli(config, url, "loads", "--at", "-0s", "--json")
    assert now.returncode == 0, now.stderr
    assert f"event {last} (--at -0s); the newest event, none after it until " in now.stderr
    newest = (await replay(nc, config, from_seq=1)).loads()
    held = ("worker_id", "dp_rank", "active_blocks", "active_requests")  # decay aside
    assert [[r[k] for k in held] for r in rows_of(now.stdout)] == [
        [getattr(r, k) for k in held] for r in newest
    ]
    first = dt.datetime.fromtimestamp(log[0][1] / 1e9, dt.UTC)
    refusals = {
        "2099-01-01T00:00:00Z": "is in the future (now is ",
        (first - dt.timedelta(hours=1)).isoformat(): "is before what can be answered: the "
        "earliest answerable is seq:1 (",
        f"seq:{last + 1}": f"is beyond the stream: its newest event is seq:{last}; the newest "
        f"of namespace '{config.namespace}' is seq:{last} (",
        "seq:0": "seq:N takes a stream position N >= 1",
        "yesterday": "not a moment (an ISO 8601 time",
        "-5 minutes": "not a moment (an ISO 8601 time",
    }
    for when, says in refusals.items():
        line = error_line(await run_cli(config, url, "loads", "--at", when))
        assert line.startswith("seqstate: error: --at ") and says in line, line
    assert "the log's first event" in error_line(
        await run_cli(config, url, "loads", "--at", "2000-01-01T00:00:00Z")
    )


async def test_loads_at_equals_what_loads_printed_live_at_that_moment(
    nc: Client, nats_server: object
) -> None:
    """While a workload runs (in steps, each folded before the next), ``loads --json`` is read
    live with the bucket's position before and after it; afterwards ``--at seq:N`` and
    ``--at`` the ISO time of each reading print the same lines."""
    url = nats_server.url  # type: ignore[attr-defined]
    # No Tick logged between steps: each reading is of a known event.
    config = snap_config("lv", snapshot_history_every=20, idle_tick_s=3600.0)
    readings: list[tuple[int, int, str]] = []  # (position, wall time, loads --json's output)
    async with Pipeline(nc, config) as pipeline:
        pub = RouterPublisher(nc, namespace=config.namespace, router_id="lv", config=config)
        await pub.publish(WorkerAdded(worker_id=0, dp_size=2))
        for step in range(8):
            # No modeled prefill: what `loads` prints does not depend on when it reads.
            last = await chunk(pub, step, 5 + step, modeled=False)
            await pipeline.wait_applied(last)
            before = (await read_bucket(nc, config)).position
            live = await run_cli(config, url, "loads", "--json")
            wall = time.time_ns()
            after = (await read_bucket(nc, config)).position
            assert live.returncode == 0, live.stderr
            assert before is not None and after is not None
            assert before.applied_seq == after.applied_seq == last
            readings.append((last, wall, live.stdout))
    for position, wall, printed in readings:
        for when in (f"seq:{position}", iso_us(wall)):
            out = await run_cli(config, url, "loads", "--at", when, "--json")
            assert out.returncode == 0, out.stderr
            assert out.stdout == printed, when
            assert re.search(rf"\bevent {position}\b", out.stderr), out.stderr
    assert len({printed for _, _, printed in readings}) == len(readings)  # each step shows


async def test_a_moment_in_trimmed_history_names_the_earliest_answerable(
    nc: Client, nats_server: object
) -> None:
    url = nats_server.url  # type: ignore[attr-defined]
    config = snap_config("lt", snapshot_history_every=None, retain_events=0)
    last = await history(nc, config, 4)
    assert await trimmed_below(nc, config) > 1
    snapshots = await (await SnapshotStore(nc, config).open(create=False)).list()
    oldest = snapshots[0]
    assert oldest.meta is not None
    earliest = f"the earliest answerable is seq:{oldest.applied_seq} ({iso(oldest.meta.as_of)}"
    for when in (f"seq:{oldest.applied_seq - 1}", iso_us(oldest.meta.as_of - 1000)):
        line = error_line(await run_cli(config, url, "loads", "--at", when))
        assert "is before what can be answered: " + earliest in line, line
        assert line.endswith(", older events were trimmed)"), line
    out = await run_cli(config, url, "loads", "--at", f"seq:{oldest.applied_seq}", "--json")
    assert out.returncode == 0, out.stderr
    state = (await replay(nc, config, to_seq=oldest.applied_seq)).loads()
    assert rows_of(out.stdout) == [msgspec.to_builtins(r) for r in state]
    assert f"0 events folded from snapshot {oldest.name}" in out.stderr
    assert last > oldest.applied_seq


async def test_history_snapshots_bound_the_fold_of_any_moment(
    nc: Client, nats_server: object
) -> None:
    """A writer whose snapshots by count are far apart (a large state's are) still snapshots
    the first event at or past every multiple of ``snapshot_history_every``: whatever the
    moment, ``loads --at`` folds fewer events than that, and equals a replay from the start."""
    url = nats_server.url  # type: ignore[attr-defined]
    config = fresh_config(
        "lh",
        snapshot_bucket=f"lhsnap{fresh_config().namespace}",
        snapshot_every_events=1_000,
        snapshot_every_s=0.0,
        snapshots_keep=2,
        snapshot_history_every=20,
        idle_tick_s=3600.0,  # no Tick between chunks: the log is the chunks' events
    )
    last = await history(nc, config, 10)
    assert last == 121  # the WorkerAdded, then 10 chunks of 12
    snapshots = [s.applied_seq for s in await (await SnapshotStore(nc, config).open()).list()]
    assert snapshots == [20, 40, 60, 80, 100, 120, 121]  # the last one: the stop's
    starts = [0, *snapshots]
    widest = max(b - a for a, b in pairwise(starts))
    assert widest == 20
    for seq in (19, 20, 39, 119, 121):
        out = await run_cli(config, url, "loads", "--at", f"seq:{seq}", "--json")
        assert out.returncode == 0, out.stderr
        fresh = await replay(nc, config, from_seq=1, to_seq=seq)
        assert rows_of(out.stdout) == [msgspec.to_builtins(r) for r in fresh.loads()], seq
        start = max(s for s in starts if s <= seq)
        source = f"snapshot {config.namespace}.{start:020d}" if start else "the first event"
        assert plain_lines(out.stderr)[0].endswith(f"; {seq - start} events folded from {source}")


async def test_a_long_tail_s_reader_starts_while_its_snapshot_is_restored(
    nc: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A look back whose tail the reader process folds starts that process before the
    snapshot is fetched and restored, not after: the two overlap. The answer is unchanged."""
    config = fresh_config("lr", snapshot_bucket=f"lrsnap{fresh_config().namespace}")
    last = await fill(nc, config, FAST_PATH_MIN_EVENTS + 2_000)
    events = await read_events(nc, config)
    at = 1_000
    state = folded(config, [e for e in events if e[0] <= at])
    store = await SnapshotStore(nc, config).open()
    await store.save(state.snapshot(), at, state.now_ns)
    order: list[str] = []
    start_reader, load = log_fold.start_reader, SnapshotStore.load

    async def started(*args: object) -> object:
        order.append("reader started")
        return await start_reader(*args)  # type: ignore[arg-type]

    async def restored(self: SnapshotStore, *args: object, **kwargs: object) -> object:
        loaded = await load(self, *args, **kwargs)  # type: ignore[arg-type]
        order.append("snapshot restored")
        return loaded

    monkeypatch.setattr(log_fold, "start_reader", started)
    monkeypatch.setattr(SnapshotStore, "load", restored)
    answer = await loads_at(nc, config, f"seq:{last}")
    assert order == ["reader started", "snapshot restored"]
    assert answer.replayed.snapshot is not None and answer.replayed.snapshot.applied_seq == at
    assert answer.replayed.events == last - at
    fresh = await replay(nc, config, from_seq=1)
    assert answer.replayed.state.snapshot() == fresh.state.snapshot()
    assert answer.replayed.loads() == fresh.loads()
