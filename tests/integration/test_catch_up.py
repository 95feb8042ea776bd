"""Bounded catch-up: a runner far behind holds at most its window, on a real server.

A writer paused under load once queued half a million events (612 MB) in the client and
dropped the rest: the runner's consumer now has the server send at most ``window`` messages
past the last one handled. Here a processor is held on its first message while thousands wait;
the server stops at the window, the runner holds no more than that, and once released every
message is handled once, in order, without a restart. A consumer deleted under the runner (its
server restarted, say) is started again after the last message handled, losing nothing.
"""

from __future__ import annotations

import asyncio

from eventually import eventually
from nats.aio.client import Client
from nats.aio.msg import Msg
from pipeline_kit import fresh_config

from projector.nats.consumer import OrderedConsumer
from projector.nats.resources import ensure
from projector.nats.stream import Refused, log_time_ns
from projector.run.pipeline import Pipeline
from projector.settings.config import Config

WAIT_S = 30.0


class Held:
    """Records each message's sequence; waits at ``hold_at`` (a sequence) until released."""

    def __init__(self, hold_at: int = 0) -> None:
        self.seen: list[int] = []
        self.hold_at = hold_at
        self.release = asyncio.Event()
        self.holding = asyncio.Event()

    async def handle(self, msg: Msg) -> Refused | None:
        seq = log_time_ns(msg)[0]
        if seq == self.hold_at:
            self.holding.set()
            await self.release.wait()
        self.seen.append(seq)
        return None


async def fill_raw(nc: Client, config: Config, n: int) -> list[int]:
    """``n`` small messages on the namespace's event subjects; their sequences."""
    await ensure(nc, config)
    js = nc.jetstream()
    acks = [await js.publish_async(config.event_subject(i % 4), f"m{i}".encode()) for i in range(n)]
    return [ack.seq for ack in await asyncio.gather(*acks)]


async def held_runner(
    nc: Client, prefix: str, count: int, hold_index: int, *, window: int
) -> tuple[Config, list[int], Held, list[BaseException], OrderedConsumer]:
    """``count`` raw events, and a started runner (``window``) whose processor holds at the
    ``hold_index``-th of them until released; its failures are collected."""
    config = fresh_config(prefix)
    seqs = await fill_raw(nc, config, count)
    held = Held(hold_at=seqs[hold_index])
    failures: list[BaseException] = []
    runner = OrderedConsumer(
        nc.jetstream(),
        config.events_stream,
        config.events_subjects,
        held,
        on_failure=failures.append,
        window=window,
    )
    await runner.start()
    return config, seqs, held, failures, runner


async def test_a_runner_far_behind_holds_at_most_its_window_then_handles_all_in_order(
    nc: Client,
) -> None:
    """Broke: 5,000 messages waiting, a runner with a window of 64 whose processor is stuck on
    the first. Expected: the server's consumer has 64 unacknowledged messages and no more; the
    runner never held more than 64; released, it handles all 5,000 once, in order, with no
    restart (nothing dropped, nothing sent twice)."""
    config, seqs, held, failures, runner = await held_runner(nc, "cu", 5000, 0, window=64)
    try:
        await asyncio.wait_for(held.holding.wait(), WAIT_S)
        js = nc.jetstream()
        assert runner.feed._consumer is not None
        name = runner.feed._consumer

        async def pending() -> tuple[int, int | None]:
            info = await js.consumer_info(config.events_stream, name)
            return info.num_ack_pending, info.config.max_ack_pending

        assert await eventually(
            pending, lambda p: p[0] == 64, what="the server stops at the window", timeout=WAIT_S
        ) == (64, 64)
        # Heartbeats come every second and the server sends nothing more: the window holds.
        await eventually(
            lambda: runner.feed._heard_at,
            lambda at: at > asyncio.get_running_loop().time() - 0.5,
            what="a heartbeat while held",
            timeout=WAIT_S,
        )
        assert (await pending())[0] == 64 and runner.held <= 63 and runner.peak_held <= 64
        held.release.set()
        await runner.position.wait(seqs[-1], WAIT_S)
    finally:
        await runner.stop()
    assert not failures
    assert held.seen == seqs, "not every message once, in order"
    assert runner.peak_held <= 64 and runner.restarts == 0
    assert runner.caught_up.is_set()


async def test_a_consumer_deleted_under_the_runner_is_started_again_after_the_last_handled(
    nc: Client,
) -> None:
    """Broke: deleted the runner's consumer on the server while its processor was stuck in
    the middle of 3,000 messages. Expected: it starts a new consumer after the last message it
    handled and goes on: every message handled once, in order."""
    config, seqs, held, failures, runner = await held_runner(nc, "cd", 3000, 1000, window=128)
    try:
        await asyncio.wait_for(held.holding.wait(), WAIT_S)
        assert runner.feed._consumer is not None
        await nc.jetstream().delete_consumer(config.events_stream, runner.feed._consumer)
        held.release.set()
        await runner.position.wait(seqs[-1], WAIT_S)
        last = await nc.jetstream().publish(config.event_subject(1), b"after")
        await runner.position.wait(last.seq, WAIT_S)
    finally:
        await runner.stop()
    assert not failures
    assert held.seen == [*seqs, last.seq], "not every message once, in order"
    assert runner.restarts >= 1


async def test_the_consumer_window_setting_bounds_the_writer_and_the_projector(
    nc: Client,
) -> None:
    """``consumer_window`` (``--consumer-window``) reaches both consumers' servers."""
    config = fresh_config("cw", consumer_window=100)
    async with Pipeline(nc, config) as pipeline:
        js = nc.jetstream()
        for stream in (config.events_stream, config.deltas_stream):
            infos = await eventually(
                lambda stream=stream: js.consumers_info(stream),  # type: ignore[misc]
                lambda found: len(found) == 1,
                what=f"one consumer of {stream}",
            )
            assert infos[0].config.max_ack_pending == 100, stream
        assert pipeline.writer._events.window == pipeline.projector._consumer.window == 100


async def test_an_event_with_a_status_header_is_a_message_not_a_control(nc: Client) -> None:
    """A router may put any header on an event; a ``Status: 409`` (what the server says when
    a consumer is deleted) or ``Status: 100`` must not make the runner restart or pass the
    message over: it is handed to the processor like any other, once."""
    config = fresh_config("cs")
    await ensure(nc, config)
    js = nc.jetstream()
    seqs = []
    for status, data in (("409", b""), ("100", b"x"), ("404", b"y")):
        headers = {"Status": status, "Description": "Consumer Deleted"}
        seqs.append((await js.publish(config.event_subject(1), data, headers=headers)).seq)
    seqs.append((await js.publish(config.event_subject(1), b"plain")).seq)
    held = Held()
    failures: list[BaseException] = []
    runner = OrderedConsumer(
        js, config.events_stream, config.events_subjects, held, on_failure=failures.append
    )
    await runner.start()
    try:
        await runner.position.wait(seqs[-1], WAIT_S)
    finally:
        await runner.stop()
    assert not failures and held.seen == seqs and runner.restarts == 0
