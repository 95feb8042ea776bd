"""Every backlog shows: events stored but not folded (the namespace's own, on a shared stream),
Dynamo messages waiting in the capture stream while the events stream refuses them, each
stream against its limits, publishes refused; and dead letters log at a bounded rate.

A probe filled the events stream to its limit while Dynamo published: 698 messages waited in
the capture stream after the writer resumed, while ``status`` said "nothing to fold" and
``/readyz`` 200. Here the same happens to ``seqstate run`` as an operator starts it, and
``status`` (text and ``--json``), ``/metrics`` and ``/readyz`` are read as they are read in
production, until the operator lifts the limit and everything is folded.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import sys
import time
from pathlib import Path

import pytest
from dynamo_capture import CAPTURE
from eventually import eventually
from http_kit import Readyz
from nats.aio.client import Client
from nats.js import api
from pipeline_kit import REPO, events_in, fresh_config, name_flags, read_events, run_cli
from test_metrics import cli_env, command, free_port, parse, pick, scrape

from projector.nats.resources import dead_letter_stream, dynamo_capture, ensure
from projector.nats.server import NatsServer
from projector.nats.stream import last_seq_of
from projector.route.publisher import RouterPublisher
from projector.run.pipeline import Pipeline
from projector.settings.config import Config
from projector.wire.capture import dynamo_subject
from seqstate import Free

LIMIT = 30  # the events stream's max_msgs, as an operator set it: far under the capture's 155
LOG_EVERY_S = 10.0  # dead letters: one log line per this many seconds at most, after the first
GIB = 1024**3


def dynamo_config(prefix: str) -> Config:
    """A namespace of its own that captures an endpoint of its own (one per test: two
    namespaces may not capture the same endpoint)."""
    config = fresh_config(prefix)
    return dataclasses.replace(config, dynamo_endpoint=f"{config.namespace}.backend.generate")


async def limit(nc: Client, stream: str, **limits: object) -> None:
    """What an operator does with ``nats stream edit``."""
    js = nc.jetstream()
    wanted = (await js.stream_info(stream)).config
    for key, value in limits.items():
        setattr(wanted, key, value)
    await js.update_stream(wanted)


async def status(config: Config, url: str) -> tuple[str, dict]:
    """``seqstate status``, as typed: its text, and its ``--json``."""
    text, raw = await asyncio.gather(
        run_cli(config, url, "status"), run_cli(config, url, "status", "--json")
    )
    assert text.returncode == 0 and raw.returncode == 0, text.stderr + raw.stderr
    return text.stdout, json.loads(raw.stdout)


def stream_of(report: dict, name: str) -> dict:
    return next(s for s in report["streams"] if s["name"] == name)


async def taken(nc: Client, config: Config) -> int:
    """Dynamo messages the events stream holds, each counted (not the sequence the status
    reads from the headers): alone, or in the forwarder's batches."""
    return events_in([m for m in await read_events(nc, config) if ".dynamo." in m[2]])


async def test_a_full_events_stream_shows_the_dynamo_backlog_until_it_is_lifted(
    nc: Client, nats_server: NatsServer, tmp_path: Path
) -> None:
    """Broke: the events stream limited to 30 messages (discard new) and filled by a
    router's events, then 155 Dynamo messages published on NATS Core while ``seqstate run``
    captured the endpoint; the writer folded all the events stream held. Expected:
    ``status`` names the Dynamo messages waiting in the capture stream, exactly, and the
    events stream 100% full of its 30; the metrics the same; ``/readyz`` 503 saying so; the
    writer's refused Ticks counted. Then the limit lifted: every message taken and folded,
    nothing waits, ``/readyz`` 200."""
    config = dynamo_config("bk")
    js = nc.jetstream()
    await ensure(nc, config)
    await limit(nc, config.events_stream, max_msgs=LIMIT)
    router = RouterPublisher(nc, namespace=config.namespace, router_id="fill", config=config)
    await router.publish_many([Free(f"f{i}", i % 3) for i in range(LIMIT)])
    port = free_port()
    log = tmp_path / "run.log"
    ns, capture = config.namespace, dynamo_capture(config)
    readyz = Readyz(port, log)
    said = readyz.said

    async with command(
        nats_server.url,
        log,
        "run",
        *name_flags(config),
        "--dynamo-endpoint",
        config.dynamo_endpoint or "",
        "--metrics-port",
        str(port),
        # The capture's router publishers are new to the log: the automatic resync would
        # republish what is in flight on the captured subject, and this test counts it exactly.
        "--dynamo-resync",
        "off",
    ):
        await eventually(
            readyz, lambda a: a[0] == 200, what="run ready", retry_on=(OSError,), watch=said
        )
        for message in CAPTURE:
            await nc.publish(dynamo_subject(config.dynamo_endpoint or ""), message.data)
        await nc.flush()
        await eventually(
            lambda: js.stream_info(capture),
            lambda info: info.state.messages == len(CAPTURE),
            what="every Dynamo message captured",
        )
        full = await eventually(
            lambda: js.stream_info(config.events_stream),
            lambda info: info.state.messages == LIMIT,
            what="the events stream full",
        )
        last = full.state.last_seq
        await eventually(
            lambda: scrape(port),
            lambda s: pick(s, "seqstate_applied_seq", namespace=ns, role="projector") == last,
            what="everything the events stream holds folded, and in the bucket",
            watch=said,
        )
        took = await taken(nc, config)
        waiting = len(CAPTURE) - took
        assert (took, waiting) == (0, len(CAPTURE))

        text, report = await status(config, nats_server.url)
        assert report["writer"]["events"] == 0 and report["writer"]["captured"] == waiting
        assert report["captured_behind"] == waiting and report["lag_events"] == 0
        got = report["capture"]
        assert (got["stream"], got["captured_seq"], got["taken_seq"]) == (
            capture,
            len(CAPTURE),
            took,
        )
        assert (got["waiting"], got["dropped"]) == (waiting, 0) and got["oldest_log_time"]
        events = stream_of(report, config.events_stream)
        assert (events["messages"], events["max_messages"], events["max_bytes"]) == (
            LIMIT,
            LIMIT,
            None,
        )
        assert events["full"] == 1.0 and events["discard"] == "new"
        kept = stream_of(report, capture)
        assert (kept["messages"], kept["max_bytes"], kept["discard"]) == (len(CAPTURE), GIB, "old")
        assert stream_of(report, dead_letter_stream(config))["max_bytes"] == 256 * 1024**2
        assert (
            f"writer lag: nothing to fold (folded up to event {last}); {waiting} Dynamo "
            f"messages captured but not in the events stream yet (captured up to "
            f"{len(CAPTURE)}, taken up to {took})"
        ) in text, text
        assert (
            f"lag: 0 events behind the log, and {waiting} Dynamo messages captured but not in "
            "the events stream yet"
        ) in text, text
        assert f"{LIMIT:,} messages (100% full), refuses new" in text, text
        assert "1.0 GiB (0% full), drops oldest" in text, text

        samples = await eventually(
            lambda: scrape(port),
            lambda s: pick(s, "seqstate_capture_waiting_messages", namespace=ns) == waiting,
            what="the metrics show the capture's backlog",
            watch=said,
        )
        assert pick(samples, "seqstate_capture_dropped_messages", namespace=ns) == 0
        assert pick(samples, "seqstate_stream_messages", stream=config.events_stream) == LIMIT
        assert pick(samples, "seqstate_stream_max_messages", stream=config.events_stream) == LIMIT
        assert pick(samples, "seqstate_stream_max_bytes", stream=capture) == GIB
        assert pick(samples, "seqstate_stream_messages", stream=capture) == len(CAPTURE)
        assert pick(samples, "seqstate_behind_events", namespace=ns, role="writer") == waiting
        assert pick(samples, "seqstate_lag_events", namespace=ns, role="writer") == 0

        _, body = await eventually(
            readyz,
            lambda a: a[0] == 503,
            what="/readyz 503 while the events stream refuses the capture",
            watch=said,
        )
        assert f"{waiting} Dynamo messages" in body and f"namespace {ns}" in body, body
        # The writer's idle Tick is refused too (the stream is full), and counted.
        refused = await eventually(
            lambda: scrape(port),
            lambda s: pick(
                s,
                "seqstate_publishes_refused_total",
                namespace=ns,
                role="writer",
                reason="stream_full",
            ),
            what="the writer's refused Tick counted",
            watch=said,
        )
        ticks = pick(
            refused,
            "seqstate_publishes_refused_total",
            namespace=ns,
            role="writer",
            reason="stream_full",
        )
        assert ticks is not None and ticks >= 1
        text, _ = await status(config, nats_server.url)
        assert "publishes refused: the running writer's Ticks: " in text, text

        await limit(nc, config.events_stream, max_msgs=-1)  # the operator lifts the limit
        report = await eventually(
            lambda: status(config, nats_server.url),
            lambda r: (
                r[1]["capture"]["waiting"] == 0
                and r[1]["writer"]["events"] == 0
                and r[1]["lag_events"] == 0
            ),
            what="everything captured taken, folded and in the bucket",
            watch=said,
        )
        assert report[1]["capture"]["taken_seq"] == len(CAPTURE)
        assert "nothing to fold" in report[0] and "Dynamo messages captured" not in report[0]
        assert await taken(nc, config) == len(CAPTURE)
        await eventually(readyz, lambda a: a == (200, "ready\n"), what="ready again", watch=said)
        samples = await eventually(
            lambda: scrape(port),
            lambda s: pick(s, "seqstate_capture_waiting_messages", namespace=ns) == 0,
            what="the metrics show nothing waiting",
        )
        assert pick(samples, "seqstate_stream_max_messages", stream=config.events_stream) is None


async def test_a_capture_refused_from_its_first_message_is_counted_exactly(
    nc: Client, nats_server: NatsServer
) -> None:
    """Broke: the events stream filled to its limit by a router's events, then 40 Dynamo
    messages captured: none could be taken, so no captured message in the events stream
    names where the capture stands. Expected: ``status`` counts all 40 waiting (not the
    server's source lag, which leaves out those in flight)."""
    config = dynamo_config("bf")
    await ensure(nc, config)
    await limit(nc, config.events_stream, max_msgs=LIMIT)
    router = RouterPublisher(nc, namespace=config.namespace, router_id="fill", config=config)
    await router.publish_many([Free(f"f{i}", i % 3) for i in range(LIMIT)])
    for message in CAPTURE[:40]:
        await nc.publish(dynamo_subject(config.dynamo_endpoint or ""), message.data)
    await nc.flush()
    js = nc.jetstream()
    await eventually(
        lambda: js.stream_info(dynamo_capture(config)),
        lambda info: info.state.messages == 40,
        what="40 Dynamo messages captured",
    )
    text, report = await status(config, nats_server.url)
    assert report["capture"]["waiting"] == 40 and report["capture"]["taken_seq"] == 0, report
    assert report["writer"]["events"] == LIMIT and report["writer"]["captured"] == 40
    assert (
        "40 Dynamo messages captured but not in the events stream yet (captured up to 40, "
        "taken up to 0)" in text
    ), text
    assert await taken(nc, config) == 0


async def test_status_counts_the_namespaces_own_events_on_a_shared_stream(
    nc: Client, nats_server: NatsServer
) -> None:
    """Broke: two namespaces on one events stream, 321 events of the other namespace, then 2
    of this one, no writer. ``status`` said 323 "stored but not folded" and 323 behind.
    Expected: 2, and the other namespace's 321."""
    mine = fresh_config("sh")
    other = dataclasses.replace(fresh_config("so"), events_stream=mine.events_stream)
    for config in (mine, other):
        await ensure(nc, config)
    theirs = RouterPublisher(nc, namespace=other.namespace, router_id="them", config=other)
    await theirs.publish_many([Free(f"o{i}", i % 5) for i in range(321)])
    ours = RouterPublisher(nc, namespace=mine.namespace, router_id="us", config=mine)
    await ours.publish_many([Free("m0", 0), Free("m1", 1)])
    newest = await last_seq_of(nc.jetstream(), mine.events_stream, mine.events_subjects)
    assert newest == 321 + 2

    text, report = await status(mine, nats_server.url)
    writer = report["writer"]
    assert (writer["events"], writer["newest"]) == (2, newest), writer
    assert report["lag_events"] == 2, report
    assert writer["exact"] is True  # counted by the server, not a sequence difference
    assert (
        "writer lag: 2 events stored but not folded yet (folded up to event 0, the log at "
        f"{newest})"
    ) in text, text
    assert "lag: 2 events behind the log" in text, text
    _, theirs_report = await status(other, nats_server.url)
    assert theirs_report["writer"]["events"] == 321 and theirs_report["lag_events"] == 321


async def test_twenty_thousand_dead_letters_make_a_bounded_number_of_log_lines(
    nc: Client, nats_server: NatsServer, tmp_path: Path
) -> None:
    """Broke: 20,000 undecodable events folded by ``seqstate writer``: 20,000 warning lines.
    Expected: the first at once, then one line per 10 s with the count and the kinds; the
    counts add up to 20,000, and the metrics count every one."""
    total = 20_000
    config = fresh_config("dl")
    await ensure(nc, config)
    js = nc.jetstream()
    for i in range(total):
        await nc.publish(config.event_subject(0), b"\xc1 not an event %d" % i)
        if i % 1000 == 999:
            await nc.flush()
    await eventually(
        lambda: js.stream_info(config.events_stream),
        lambda info: info.state.messages == total,
        what="every message stored",
    )
    port = free_port()
    log = tmp_path / "writer.log"
    started = time.monotonic()
    async with command(
        nats_server.url, log, "writer", *name_flags(config), "--metrics-port", str(port)
    ):
        await eventually(
            lambda: scrape(port),
            lambda s: (
                pick(
                    s,
                    "seqstate_dead_letters_total",
                    namespace=config.namespace,
                    role="writer",
                    reason="undecodable",
                )
                == total
            ),
            what="every dead letter written",
            timeout=300,
            interval=0.5,
            retry_on=(OSError,),
            watch=lambda: log.read_text()[-2000:],
        )
    elapsed = time.monotonic() - started
    records = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    dead = [r for r in records if r["logger"] == "seqstate.dead"]
    at_once = [r["msg"] for r in dead if r["msg"].startswith("dead letter: ")]
    held = [r["msg"] for r in dead if r["msg"].startswith("dead letters: ")]
    assert len(at_once) + len(held) == len(dead)
    assert dead[0]["msg"].startswith(f"dead letter: {config.events_stream} 1 on "), dead[0]
    counted = 0
    for line in held:
        n, kinds = line.split(" more in the last ")[0], line.split("s (")[1].split(")")[0]
        count = int(n.removeprefix("dead letters: ").replace(",", ""))
        assert kinds == f"undecodable {count:,}", line
        counted += count
    assert len(at_once) + counted == total, (len(at_once), counted)
    assert len(dead) <= 2 + 2 * elapsed / LOG_EVERY_S, (len(dead), elapsed)
    assert f"{config.events_stream} {total} on {config.event_subject(0)} (" in dead[-1]["msg"]


async def test_a_writer_whose_ticks_are_refused_says_so_once_per_interval(
    nc: Client, caplog: pytest.LogCaptureFixture
) -> None:
    """A full events stream refuses the writer's Ticks, tried again every ``idle_tick_s`` / 4:
    each refusal was a warning line (2,880 an hour for one namespace at the default 5 s, and
    serve-http runs a writer per tracker). The first is said at once, the rest once per
    10 s, counted; each line names its namespace."""
    caplog.set_level(logging.WARNING, "seqstate.writer")
    config = fresh_config("tq", idle_tick_s=0.4)
    await ensure(nc, config)
    await RouterPublisher(nc, config=config, router_id="tq").add("r1", 1, block_hashes=[1])
    await limit(nc, config.events_stream, max_msgs=1)  # full: every Tick is refused
    loop = asyncio.get_running_loop()
    async with Pipeline(nc, config) as pipeline:
        began = loop.time()
        refused = pipeline.writer.stats.publishes_refused
        await eventually(
            lambda: refused.get("stream_full", 0) >= 20, what="20 Ticks refused", timeout=60
        )
        elapsed = loop.time() - began
    records = [r for r in caplog.records if r.getMessage().startswith("Tick not logged")]
    said = [r.getMessage() for r in records]
    full = "the stream is full: maximum messages exceeded (JetStream error 10077)"
    assert said[0] == f"Tick not logged: {full}", said
    assert said[-1].endswith(f"; the last: {full}"), said
    assert len(said) <= 2 + elapsed // LOG_EVERY_S, (len(said), elapsed)
    assert {getattr(r, "namespace", None) for r in records} == {config.namespace}


async def test_provisioning_gives_the_capture_and_dead_letter_streams_byte_limits(
    nc: Client, caplog: pytest.LogCaptureFixture
) -> None:
    """Broke: the dead-letter stream grew to 85 MB and the capture stream had no limit at all.
    Expected: each gets a byte limit and drops its oldest beyond it (the settings' defaults,
    1 GiB and 256 MiB); streams made before the limits get them; a limit is only ever
    raised (an operator's larger one stays, a smaller setting is logged), 'off' lifts it."""
    config = dynamo_config("pl")
    js = nc.jetstream()
    capture, dead = dynamo_capture(config), dead_letter_stream(config)
    await ensure(nc, config)
    for name, wanted in ((capture, GIB), (dead, 256 * 1024**2)):
        made = (await js.stream_info(name)).config
        assert (made.max_bytes, made.discard) == (wanted, api.DiscardPolicy.OLD), name

    # Streams as an earlier version made them: no byte limit. The next start gives them one.
    for name in (capture, dead):
        await limit(nc, name, max_bytes=-1)
    await ensure(nc, dataclasses.replace(config, capture_max_bytes=64 * 1024**2))
    assert (await js.stream_info(capture)).config.max_bytes == 64 * 1024**2
    assert (await js.stream_info(dead)).config.max_bytes == 256 * 1024**2

    # An operator's larger limit stays; a process asking for less says so and lowers nothing.
    await limit(nc, capture, max_bytes=2 * GIB)
    with caplog.at_level(logging.WARNING, "seqstate.resources"):
        await ensure(nc, config)
    assert (await js.stream_info(capture)).config.max_bytes == 2 * GIB
    assert [r.getMessage() for r in caplog.records] == [
        f"stream {capture} keeps its byte limit of {2 * GIB} although this process asks for "
        f"{GIB}: seqstate never lowers a byte limit (lower it by hand, and the setting of "
        "every process, if you mean to)"
    ]
    await ensure(nc, dataclasses.replace(config, capture_max_bytes=3 * GIB))
    assert (await js.stream_info(capture)).config.max_bytes == 3 * GIB
    await ensure(
        nc, dataclasses.replace(config, capture_max_bytes=None, dead_letter_max_bytes=None)
    )
    assert (await js.stream_info(capture)).config.max_bytes == -1
    assert (await js.stream_info(dead)).config.max_bytes == -1


async def test_the_live_view_of_run_demo_shows_the_backlog_and_the_refusals(
    nc: Client, nats_server: NatsServer, tmp_path: Path
) -> None:
    """Broke: ``seqstate run --demo`` (piped: a line a second) capturing a Dynamo endpoint,
    the events stream limited to what it held plus 5 messages, then Dynamo's 155 messages.
    Expected: its lines show the Dynamo messages waiting outside the events stream, the
    events stream 100% full, the demo's requests refused (it goes on, rather than dying of
    the first refusal); once the limit is lifted, nothing waits."""
    config = dynamo_config("lv")
    js = nc.jetstream()
    await ensure(nc, config)
    lines: list[str] = []
    log = tmp_path / "run.log"
    with log.open("wb") as err:
        proc = await asyncio.create_subprocess_exec(
            *demo_command(config),
            env=cli_env(nats_server.url),
            cwd=REPO,
            stdout=asyncio.subprocess.PIPE,
            stderr=err,
        )
        assert proc.stdout is not None
        reader = asyncio.create_task(read_lines(proc.stdout, lines))

        def said() -> str:
            return "\n".join(lines[-3:]) + "\n" + log.read_text()[-2000:]

        def running() -> None:
            assert proc.returncode is None, f"run exited with {proc.returncode}\n{said()}"

        def line_with(*parts: str) -> str | None:
            return next((line for line in reversed(lines) if all(p in line for p in parts)), None)

        try:
            await eventually(
                lambda: line_with("unfolded=0", "captured waiting=0", "refused=0"),
                what="the backlog shown, nothing waiting",
                check=running,
                watch=said,
            )
            # Full at once: the forwarder would store a burst of the capture in one message.
            held, limited = -1, 0
            while held != limited:  # the demo's events may land before the limit does
                limited = (await js.stream_info(config.events_stream)).state.messages
                await limit(nc, config.events_stream, max_msgs=limited)
                held = (await js.stream_info(config.events_stream)).state.messages
            for message in CAPTURE:
                await nc.publish(dynamo_subject(config.dynamo_endpoint or ""), message.data)
            await nc.flush()
            stuck = await eventually(
                lambda: line_with(f"{config.events_stream}=100% full"),
                lambda line: (
                    line is not None
                    and field(line, "captured waiting") > 0
                    and field(line, "refused") > 0
                ),
                what="the capture's backlog and the refusals shown",
                check=running,
                watch=said,
            )
            assert stuck is not None and field(stuck, "unfolded") == 0, stuck
            mark = len(lines)
            await limit(nc, config.events_stream, max_msgs=-1)
            await eventually(
                lambda: [line for line in lines[mark:] if "captured waiting=0" in line],
                what="nothing waits once the limit is lifted",
                check=running,
                watch=said,
            )
        finally:
            if proc.returncode is None:
                proc.terminate()
            code = await asyncio.wait_for(proc.wait(), 60)
            await reader
    assert code == 0, said()
    summary = next(line for line in lines if line.startswith("demo: routed"))
    assert "refused by the log" in summary, summary


def demo_command(config: Config) -> list[str]:
    return [
        sys.executable,
        "-m",
        "projector",
        "run",
        *name_flags(config),
        "--dynamo-endpoint",
        config.dynamo_endpoint or "",
        "--demo",
        "--no-live",
        "--workers",
        "2",
        "--rate",
        "20",
    ]


async def read_lines(stream: asyncio.StreamReader, into: list[str]) -> None:
    while line := await stream.readline():
        into.append(line.decode().rstrip("\n"))


def field(line: str, key: str) -> int:
    """A number of a piped demo line: ``... captured waiting=125 ...``."""
    return int(line.split(f"{key}=", 1)[1].split()[0].replace(",", ""))


async def test_a_routers_refused_publishes_are_counted_in_its_own_metrics(nc: Client) -> None:
    """Broke: a router publishing into a full events stream: its PublishError said so, but
    nothing counted the refusals where an operator looks (the ledger never sees them).
    Expected: the publisher counts every refused attempt by why, and a router's registry
    exports them as ``seqstate_publishes_refused_total{role="router"}``."""
    from prometheus_client import CollectorRegistry, generate_latest

    from projector import publisher_collector
    from projector.route.publisher import PublishError

    config = fresh_config("rr")
    await ensure(nc, config)
    await limit(nc, config.events_stream, max_msgs=3)
    pub = RouterPublisher(nc, namespace=config.namespace, router_id="rr", config=config)
    registry = CollectorRegistry()
    registry.register(publisher_collector(pub))
    await pub.publish_many([Free(f"k{i}", 0) for i in range(3)])
    with pytest.raises(PublishError, match="the stream is full"):
        await pub.publish(Free("over", 0))
    attempts = pub.refused["stream_full"]
    assert attempts >= 1 and set(pub.refused) == {"stream_full"}
    samples = parse(generate_latest(registry).decode())
    labels = {"namespace": config.namespace, "role": "router", "reason": "stream_full"}
    assert pick(samples, "seqstate_publishes_refused_total", **labels) == attempts
