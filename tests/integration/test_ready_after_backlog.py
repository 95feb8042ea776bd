"""``/readyz`` after a start on a backlog (a restart's tail, a replay): ready once the backlog is
folded and in the bucket, not one lag check (``--lag-check-s``) later."""

from __future__ import annotations

from pathlib import Path

from eventually import eventually
from http_kit import Readyz
from nats.aio.client import Client
from pipeline_kit import fresh_config, name_flags
from test_metrics import command, free_port

from projector.nats.resources import ensure
from projector.nats.server import NatsServer
from projector.nats.stream import last_seq_of
from seqstate import AddRequest, Free, encode_event

REQUESTS = 10_000  # an Add and a Free each: 20,000 events, 20 times what /readyz allows behind
LAG_CHECK_S = 300.0


async def test_run_started_on_a_backlog_is_ready_once_it_has_folded_it(
    nc: Client, nats_server: NatsServer, tmp_path: Path
) -> None:
    """Broke: 20,000 events stored before ``seqstate run --lag-check-s 300`` starts; its
    consumers' first lag measurements, taken as they start, find them 20,000 events behind,
    over the 1,000 ``/readyz`` allows. Expected: ``/readyz`` 200 once they have caught up, well
    before the second measurement a check every 300 s would bring."""
    config = fresh_config("rb")
    await ensure(nc, config)
    js = nc.jetstream(publish_async_max_pending=2_000)
    for i in range(REQUESTS):
        rank = i % 4
        subject = config.event_subject(rank, 0)
        await js.publish_async(subject, encode_event(AddRequest(f"b{i}", rank, 0, [i, i + 1])))
        await js.publish_async(subject, encode_event(Free(f"b{i}", rank, 0)))
    await js.publish_async_completed()
    last = await last_seq_of(js, config.events_stream, config.events_subjects)
    assert last == 2 * REQUESTS
    port = free_port()
    log = tmp_path / "run.log"
    readyz = Readyz(port, log)
    said = readyz.said

    async with command(
        nats_server.url,
        log,
        "run",
        *name_flags(config),
        "--metrics-port",
        str(port),
        "--lag-check-s",
        str(LAG_CHECK_S),
    ):
        await eventually(
            readyz,
            lambda a: a == (200, "ready\n"),
            what="run ready after folding the backlog",
            timeout=LAG_CHECK_S / 5,
            retry_on=(OSError,),
            watch=said,
        )
