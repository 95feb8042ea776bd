"""A Dynamo-fed namespace through a real writer on a real server: its requests expire as
Dynamo's routers expire them (a lease scanned on log time, driven by the writer's Ticks), and a
worker removed for good (``seqstate worker remove``) never comes back through late messages.
``replay --verify`` agrees with the bucket both times."""

from __future__ import annotations

import json

from dynamo_capture import BIG_WORKER, CAPTURE, SMALL_WORKER
from eventually import eventually
from nats.aio.client import Client
from pipeline_kit import bucket_values, events_in, fresh_config, logged, read_events, run_cli

from projector.nats.resources import ensure
from projector.nats.server import NatsServer
from projector.run.pipeline import Pipeline
from projector.settings.config import Config
from seqstate import Fold, Tick, decode_event
from seqstate.dynamo import ADD, decode_dynamo, dynamo_subject

SCAN_S = 1.0
SCAN_NS = 1_000_000_000


async def publish(nc: Client, config: Config, messages: list[bytes]) -> None:
    """The messages of the real capture, on the subject of the namespace's Dynamo endpoint
    (one of each test's own: two namespaces of one server cannot capture one endpoint)."""
    for data in messages:
        await nc.publish(dynamo_subject(config.dynamo_endpoints[0]), data)  # NATS Core
    await nc.flush()


def ranks_in(out: str) -> dict[tuple[int, int], int]:
    """``loads --json``: active requests per rank shown."""
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return {(r["worker_id"], r["dp_rank"]): r["active_requests"] for r in rows}


def fold_flags(config: Config) -> list[str]:
    """The fold's rules as an operator gives them to every command that folds the log."""
    assert config.dynamo_endpoint is not None
    return [
        "--dynamo-endpoint",
        config.dynamo_endpoint,
        "--expiry-scan-s",
        repr(config.expiry_scan_s),
    ]


async def test_a_dynamo_request_nobody_frees_expires_by_the_lease_on_log_time(
    nc: Client, nats_server: NatsServer
) -> None:
    config = fresh_config(
        "dx", dynamo_endpoint="dx.backend.generate", expiry_scan_s=SCAN_S, idle_tick_s=0.2
    )
    await ensure(nc, config)
    first_add = next(m.data for m in CAPTURE if decode_dynamo(m.data).op == ADD)
    request_id = decode_dynamo(first_add).request_id
    async with Pipeline(nc, config) as pipeline:
        await publish(nc, config, [first_add])  # its Mark and Free never come
        await eventually(
            lambda: pipeline.writer.state.counters["expired"],
            lambda n: n == 1,
            what="the writer's idle Ticks expire the request",
            timeout=30,
        )
        expired_at = pipeline.writer.stats.last_seq
        await pipeline.wait_applied(expired_at)
        url = nats_server.url
        out = await run_cli(config, url, "loads", "--json")
        assert out.returncode == 0, out.stderr
        assert set(ranks_in(out.stdout).values()) == {0}
        out = await run_cli(config, url, "replay", "--verify", "--no-progress", *fold_flags(config))
        assert out.returncode == 0, out.stdout + out.stderr
    # When, exactly: at the first event (a writer's Tick) at or past the second scan boundary
    # after the Add's log time, as one fold of the stored log decides.
    log = await read_events(nc, config)
    fold = Fold(config.new_state(), config.fold_rules)
    verdicts = [fold(*message) for message in log]
    (added,) = [i for i, (_, _, subject, _) in enumerate(log) if subject != config.control_subject]
    assert getattr(verdicts[added], "outcome", None) == "applied"
    due = (log[added][1] // SCAN_NS + 2) * SCAN_NS
    (i,) = [i for i, v in enumerate(verdicts) if getattr(v, "expired", [])]
    assert getattr(verdicts[i], "expired", None) == [request_id]
    assert log[i][1] >= due > log[i - 1][1]
    assert isinstance(decode_event(log[i][3]), Tick)
    # The writer may have stored one more Tick than it folded before it stopped: the same fold
    # over what the writer had applied gives its state byte for byte.
    applied = pipeline.writer.stats.last_seq
    again = Fold(config.new_state(), config.fold_rules)
    for message in log:
        if message[0] <= applied:
            again(*message)
    assert again.state.snapshot() == pipeline.writer.state.snapshot()


async def test_a_worker_removed_for_good_never_comes_back_through_late_messages(
    nc: Client, nats_server: NatsServer
) -> None:
    config = fresh_config(
        "dw", dynamo_endpoint="dw.backend.generate", idle_tick_s=3600.0, tick_every_s=3600.0
    )  # no Tick: the log holds the capture's messages and the control events alone
    await ensure(nc, config)
    url = nats_server.url
    half = 60
    async with Pipeline(nc, config) as pipeline:
        await publish(nc, config, [m.data for m in CAPTURE[:half]])
        await pipeline.wait_applied(await logged(nc, config, half))
        out = await run_cli(config, url, "loads", "--json")
        assert {w for w, _ in ranks_in(out.stdout)} == {BIG_WORKER, SMALL_WORKER}

        owner = pipeline.writer.state.requests.owner
        cut = sorted(rid for rid, rank in owner.items() if rank[0] == BIG_WORKER)
        assert cut, "the worker has requests in flight"
        endpoint = ("--dynamo-endpoint", "dw.backend.generate")
        out = await run_cli(config, url, "worker", "remove", str(BIG_WORKER), *endpoint)
        assert out.returncode == 0, out.stderr
        assert out.stdout.startswith(f"worker {BIG_WORKER}: removed from the registry, for good")
        removal = pipeline.writer.stats.last_seq
        out = await run_cli(config, url, "inspect", "request", cut[0], "--json", "--no-progress")
        report = json.loads(out.stdout)
        assert report["state"] == "ended", report
        assert report["detail"] == (
            f"dropped with its rank at event {removal} (worker removed for good)"
        ), report

        # Late messages: the frontends' Adds routed before they noticed, the Marks and Frees
        # of its cut requests (the rest of the capture names the worker many times).
        rest = [m.data for m in CAPTURE[half:]]
        late_adds = sum(
            1
            for d in rest
            if decode_dynamo(d).op == ADD and decode_dynamo(d).worker_id == BIG_WORKER
        )
        assert late_adds > 0
        before = events_in(await read_events(nc, config))  # a record batch holds many
        await publish(nc, config, rest)
        await pipeline.wait_applied(await logged(nc, config, before + len(rest)))
        state = pipeline.writer.state
        assert state.counters["removed_worker"] == late_adds
        assert not any(w == BIG_WORKER for w, _ in state.workers.slots)
        out = await run_cli(config, url, "loads", "--json")
        assert {w for w, _ in ranks_in(out.stdout)} == {SMALL_WORKER}
        assert not [k for k in await bucket_values(nc, config) if f".{BIG_WORKER}." in k]
        out = await run_cli(config, url, "replay", "--verify", "--no-progress", *fold_flags(config))
        assert out.returncode == 0, out.stdout + out.stderr

        # Added again (a worker an operator brings back by hand): it starts empty.
        out = await run_cli(config, url, "worker", "add", str(BIG_WORKER), "--dp-size", "2")
        assert out.returncode == 0, out.stderr
        out = await run_cli(config, url, "loads", "--json")
        shown = ranks_in(out.stdout)
        assert {r: n for r, n in shown.items() if r[0] == BIG_WORKER} == {
            (BIG_WORKER, 0): 0,
            (BIG_WORKER, 1): 0,
        }
    removed = [
        decode_event(data)
        for _, _, subject, data in await read_events(nc, config)
        if subject == config.control_subject
    ]
    assert [(type(e).__name__, getattr(e, "final", None)) for e in removed] == [
        ("WorkerRemoved", True),
        ("WorkerAdded", None),
    ]


async def test_outside_a_dynamo_namespace_a_removed_worker_comes_back_with_its_next_request(
    nc: Client, nats_server: NatsServer
) -> None:
    """A worker known only by its requests (no WorkerAdded): a plain removal, as always, so
    the next request of a router that still uses it brings it back."""
    from projector.route.publisher import RouterPublisher

    config = fresh_config("dp")
    url = nats_server.url
    async with Pipeline(nc, config) as pipeline:
        pub = RouterPublisher(nc, namespace=config.namespace, router_id="dp", config=config)
        await pipeline.wait_applied(await pub.add("a", 5, block_hashes=[1]))
        out = await run_cli(config, url, "worker", "remove", "5")
        assert out.stdout.strip().startswith("worker 5: removed from the registry (event ")
        await pipeline.wait_applied(await pub.add("b", 5, block_hashes=[2]))
        out = await run_cli(config, url, "loads", "--json")
        assert ranks_in(out.stdout) == {(5, 0): 1}
        assert pipeline.writer.state.counters["removed_worker"] == 0


async def test_a_due_lease_scan_is_ticked_at_its_boundary_not_at_the_idle_tick(
    nc: Client,
) -> None:
    """With the idle Tick an hour away, the writer still logs a Tick once a lease scan is due
    by its clock: the request expires within a second or so of Dynamo's replicas, not an idle
    interval later. The Tick's log time is at or past the boundary that expired it."""
    config = fresh_config(
        "dt", dynamo_endpoint="dt.backend.generate", expiry_scan_s=SCAN_S, idle_tick_s=3600.0
    )
    await ensure(nc, config)
    first_add = next(m.data for m in CAPTURE if decode_dynamo(m.data).op == ADD)
    async with Pipeline(nc, config) as pipeline:
        await publish(nc, config, [first_add])
        await eventually(
            lambda: pipeline.writer.state.counters["expired"],
            lambda n: n == 1,
            what="a Tick at the due lease scan expires the request",
            timeout=30,
        )
        assert pipeline.writer.stats.ticks_published >= 1
    log = await read_events(nc, config)
    added_ns = log[0][1]
    ticks = [
        at
        for _, at, subject, data in log
        if subject == config.control_subject and isinstance(decode_event(data), Tick)
    ]
    assert ticks and ticks[-1] >= (added_ns // SCAN_NS + 2) * SCAN_NS
