"""A scheduler's view tells an idle current pipeline from a stalled one, from the bucket alone.

The projector's lease renewals (every second) carry its last lag measurement; the view counts
them as signs of life and reads from them how far the log is ahead of it. ``seqstate run`` runs
as a user types it (its own defaults, ``--idle-tick-s`` 5 s included) and is SIGSTOPped: the
router's publishes are still acknowledged by the stream while the view stands still, and the
view says so. The writer alone, stopped, leaves the projector renewing: the view then counts
the events it lacks and how long the oldest has waited.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

from eventually import eventually
from nats.aio.client import Client
from pipeline_kit import fresh_config, name_flags, run_cli
from test_metrics import command, publish

from projector.bucket.reader import STALL_AFTER_S, RegistryUnavailable, RegistryView, Staleness
from projector.nats.lease import DEFAULT_TTL_S
from projector.nats.server import NatsServer
from projector.route.publisher import RouterPublisher
from projector.settings.config import Config
from seqstate import WorkerAdded

IDLE_TICK_S = Config().idle_tick_s  # the writer's default: a Tick after this much silence
WAIT_S = 30.0


@contextlib.asynccontextmanager
async def view_of(nc: Client, config: Config) -> AsyncIterator[RegistryView]:
    """A view of ``config``'s namespace once its projector has made the bucket."""
    view = await eventually(
        lambda: RegistryView(nc, config=config).start(),
        what="the bucket made by the projector",
        retry_on=(RegistryUnavailable,),
        timeout=WAIT_S,
    )
    try:
        yield view
    finally:
        await view.stop()


@contextlib.contextmanager
def stopped(proc: asyncio.subprocess.Process) -> Iterator[None]:
    proc.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        proc.send_signal(signal.SIGCONT)


async def caught_up(view: RegistryView, seq: int, log: Path) -> Staleness:
    """Wait for a measurement of the log at ``seq`` or later that finds the view lacking none."""
    return await eventually(
        view.staleness,
        lambda s: s.head >= seq and s.behind_events == 0 and s.applied_seq >= seq,
        what=f"a heartbeat of the log at event {seq} or later, the view lacking none of it",
        timeout=WAIT_S,
        watch=lambda: log.read_text()[-3000:],
    )


async def test_an_idle_current_view_hears_the_projector_every_second(
    nc: Client, nats_server: NatsServer, tmp_path: Path
) -> None:
    """On an idle pipeline nothing but the writer's Tick (after 5 s of silence) changes a read
    model value: the view's age_s passed 5 s while it was current. The lease renewals keep it
    near a second, over a whole idle spell up to the Tick."""
    config = fresh_config("idle")
    log = tmp_path / "run.log"
    async with (
        command(nats_server.url, log, "run", *name_flags(config)),
        view_of(nc, config) as view,
    ):
        seq = await publish(nc, config, [WorkerAdded(7)])
        await view.wait_for(seq, timeout=WAIT_S)
        renewals = view.renewals

        def young() -> None:
            s = view.staleness()
            assert s.age_s < STALL_AFTER_S, f"idle and current, yet {s}"

        # Idle from here: the next value of the read model is the writer's Tick, logged
        # after IDLE_TICK_S of silence; until it lands the view hears only renewals.
        young()
        ticked = await eventually(
            lambda: view.applied_seq,
            lambda applied: applied > seq,
            what=f"the writer's Tick after {IDLE_TICK_S}s idle",
            timeout=WAIT_S,
            interval=0.05,
            check=young,
            watch=log.read_text,
        )
        assert view.renewals - renewals >= 3, view.renewals - renewals
        s = await caught_up(view, ticked, log)
        assert s.behind_events == 0 and s.behind_s == 0.0 and not s.silent
        assert s.silent_after_s == DEFAULT_TTL_S


async def test_a_stopped_run_is_silent_then_catches_up(
    nc: Client, nats_server: NatsServer, tmp_path: Path
) -> None:
    """``seqstate run`` SIGSTOPped: a router's adds are acknowledged by the stream while the
    view stands still. The view's age grows past the lease TTL (silent); SIGCONT: the view
    catches up and a measurement finds it lacking nothing."""
    config = fresh_config("stop")
    log = tmp_path / "run.log"
    async with (
        command(nats_server.url, log, "run", *name_flags(config)) as run,
        view_of(nc, config) as view,
    ):
        first = await publish(nc, config, [WorkerAdded(7)])
        s = await caught_up(view, first, log)
        assert not s.silent and s.within(0, 0.0)
        publisher = RouterPublisher(nc, router_id="r-stop", config=config)
        with stopped(run):
            last = 0
            for i in range(5):
                last = await publisher.add(f"q{i}", 7, block_hashes=[i], prefill_tokens=16)
            assert last > first  # stored: the stream acknowledged each
            s = await eventually(
                view.staleness,
                lambda s: s.silent,
                what="the view hearing nothing past the lease TTL",
                timeout=WAIT_S,
                interval=0.05,
            )
            assert s.age_s > DEFAULT_TTL_S and not s.within(10**9, 1e9)
            assert s.applied_seq == first < last  # nothing of the stopped run landed
            # A view that starts now gets the same values at once: their stored times tell
            # it they are old.
            said = (await run_cli(config, nats_server.url, "loads")).stdout.splitlines()
            assert re.fullmatch(rf"as of event {first}; projector silent \d+s", said[-1]), said
        s = await caught_up(view, last, log)
        assert not s.silent and s.within(0, 0.0)  # at the adds, or a Tick the writer logged since
        assert [r.active_requests for r in view.loads()] == [5]
        said = (await run_cli(config, nats_server.url, "loads")).stdout.splitlines()
        match = re.fullmatch(r"as of event (\d+); current \(log at \1\)", said[-1])
        assert match and int(match[1]) >= last, said


async def test_a_stopped_writer_leaves_the_view_counting_what_it_lacks(
    nc: Client, nats_server: NatsServer, tmp_path: Path
) -> None:
    """The writer alone SIGSTOPped: the projector still renews, so the view is not silent, and
    its measurements say how many events the view lacks and for how long, up to the log's
    head; SIGCONT: none again."""
    config = fresh_config("wstop")
    common = (*name_flags(config), "--lag-check-s", "0.2")
    w_log, p_log = tmp_path / "writer.log", tmp_path / "projector.log"
    async with (
        command(nats_server.url, w_log, "writer", *common) as writer,
        command(nats_server.url, p_log, "projector", *common),
        view_of(nc, config) as view,
    ):
        first = await publish(nc, config, [WorkerAdded(7)])
        await caught_up(view, first, p_log)
        publisher = RouterPublisher(nc, router_id="r-w", config=config)
        with stopped(writer):
            seqs = [
                await publisher.add(f"q{i}", 7, block_hashes=[i], prefill_tokens=16)
                for i in range(4)
            ]
            s = await eventually(
                view.staleness,
                lambda s: s.head >= seqs[-1] and s.behind_s > 0.5,
                what="a heartbeat counting the 4 events the view lacks",
                timeout=WAIT_S,
                interval=0.05,
            )
            assert s.behind_events == 4 and s.applied_seq == first, s
            assert not s.silent and s.age_s < STALL_AFTER_S
            assert not s.within(3, 1e9) and not s.within(4, 0.5) and s.within(4, 1e9)
        s = await caught_up(view, seqs[-1], p_log)
        assert s.behind_events == 0 and s.behind_s == 0.0
