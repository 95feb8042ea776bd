"""``seqstate dynamo uncapture``: a namespace's capture of a Dynamo endpoint removed, on a real
server, through the CLI as an operator types it.

A typo'd ``--dynamo-endpoint dyn.backend.generat`` left its subject in the namespace's capture
stream for good, since provisioning only adds. The command takes it out (all of the
namespace's endpoints when none is named: the capture stream is then deleted, and the events
stream's source of it removed), refuses an endpoint or a namespace it does not know in one line,
and leaves the log alone: replay still folds the events the endpoint had. After it, a Dynamo
message on that subject is stored nowhere; a process still given the endpoint captures it again
at its next start.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from dynamo_capture import CAPTURE
from log_text import error_line
from nats.aio.client import Client
from nats.js.errors import NoStreamResponseError, NotFoundError
from pipeline_kit import forwarding, fresh_config, logged, run_cli

from projector.nats.resources import dynamo_capture, ensure
from projector.nats.server import NatsServer
from projector.route.publisher import RouterPublisher
from projector.run.pipeline import Pipeline
from projector.settings.config import Config
from seqstate.dynamo import captured_subject, decode_dynamo, dynamo_subject

ADD = CAPTURE[0].data  # an AddRequest of a frontend, worker above 2^63, rank 0
RANK = (decode_dynamo(ADD).worker_id, decode_dynamo(ADD).dp_rank)


async def subjects(nc: Client, config: Config) -> list[str]:
    return list((await nc.jetstream().stream_info(dynamo_capture(config))).config.subjects or [])


async def sources(nc: Client, config: Config) -> list[str]:
    info = await nc.jetstream().stream_info(config.events_stream)
    return [s.name for s in info.config.sources or []]


async def stored_nowhere(nc: Client, subject: str) -> None:
    """No stream listens on ``subject``: a JetStream publish there has no one to answer."""
    with pytest.raises(NoStreamResponseError):
        await nc.jetstream().publish(subject, ADD, timeout=2)


def replayed(out: str) -> dict[tuple[int, int], int]:
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return {(r["worker_id"], r["dp_rank"]): r["active_requests"] for r in rows}


async def test_a_typod_endpoint_is_uncaptured_and_the_log_keeps_its_events(
    nc: Client, nats_server: NatsServer
) -> None:
    config = fresh_config("unc", dynamo_endpoint="unc.backend.generate,unc.backend.generat")
    await ensure(nc, config)
    typo = dynamo_subject("unc.backend.generat")
    await nc.publish(typo, ADD)  # NATS Core, as Dynamo publishes: captured under the typo
    await nc.flush()
    async with forwarding(nc, config):  # a writer's
        await logged(nc, config, 1)
    url = nats_server.url
    done = await run_cli(
        config, url, "dynamo", "uncapture", "--dynamo-endpoint", "unc.backend.generat"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        f"uncaptured Dynamo endpoint unc.backend.generat of namespace '{config.namespace}': "
        "the log keeps its 1 event, and replay still folds it",
        "still captured: unc.backend.generate",
        "a seqstate process still given it (--dynamo-endpoint, SEQSTATE_DYNAMO_ENDPOINT) "
        "captures it again when it next provisions (run: at every start): take it out there "
        "first",
    ]
    assert await subjects(nc, config) == [dynamo_subject("unc.backend.generate")]
    assert await sources(nc, config) == []  # the writer's forwarder stores what is captured
    await stored_nowhere(nc, typo)
    # The endpoint still captured goes on; the typo's subject took nothing meanwhile.
    await nc.publish(dynamo_subject("unc.backend.generate"), CAPTURE[1].data)
    await nc.flush()
    async with forwarding(nc, config):
        await logged(nc, config, 2)
    info = await nc.jetstream().stream_info(
        config.events_stream, subjects_filter=f"seqstate.events.{config.namespace}.>"
    )
    assert info.state.subjects == {
        captured_subject(config.namespace, "unc.backend.generat"): 1,
        captured_subject(config.namespace, "unc.backend.generate"): 1,
    }
    out = await run_cli(config, url, "replay", "--json", "--no-progress")
    assert out.returncode == 0, out.stderr
    assert replayed(out.stdout)[RANK] == 1  # the typo's AddRequest, folded from the log
    again = await run_cli(
        config, url, "dynamo", "uncapture", "--dynamo-endpoint", "unc.backend.generat"
    )
    assert error_line(again) == (
        f"seqstate: error: namespace '{config.namespace}' does not capture Dynamo endpoint "
        "unc.backend.generat; it captures unc.backend.generate"
    )


async def test_an_endpoint_the_namespace_does_not_capture_is_refused_changing_nothing(
    nc: Client, nats_server: NatsServer
) -> None:
    config = fresh_config("unk", dynamo_endpoint="unk.backend.generate,unk.prefill.generate")
    await ensure(nc, config)
    before = await subjects(nc, config)
    result = await run_cli(
        config,
        nats_server.url,
        "dynamo",
        "uncapture",
        "--dynamo-endpoint",
        "unk.prefill.generate,unk.backend.generat",
    )
    assert error_line(result) == (
        f"seqstate: error: namespace '{config.namespace}' does not capture Dynamo endpoint "
        "unk.backend.generat; it captures unk.backend.generate, unk.prefill.generate"
    )
    assert await subjects(nc, config) == before  # not even the one it does capture


async def test_an_unknown_namespace_and_one_without_a_capture_are_refused_in_one_line(
    nc: Client, nats_server: NatsServer
) -> None:
    config = fresh_config("nsk", dynamo_endpoint="nsk.backend.generate")
    await ensure(nc, config)
    # A namespace beside it in the same streams, that never captured anything.
    bare = dataclasses.replace(config, namespace=f"{config.namespace}-bare", dynamo_endpoint=None)
    await ensure(nc, bare)
    url = nats_server.url
    typo = config.with_namespace(f"{config.namespace}x")
    for argv in (("uncapture",), ("uncapture", "--dynamo-endpoint", "nsk.backend.generate")):
        assert error_line(await run_cli(typo, url, "dynamo", *argv)) == (
            f"seqstate: error: unknown namespace '{typo.namespace}': nothing of it in stream "
            f"{typo.events_stream} or bucket {typo.registry_bucket}; known namespaces: "
            f"{config.namespace}, {bare.namespace}"
        )
        assert error_line(await run_cli(bare, url, "dynamo", *argv)) == (
            f"seqstate: error: namespace '{bare.namespace}' captures no Dynamo endpoint (no "
            f"stream {dynamo_capture(bare)})"
        )
    assert await subjects(nc, config) == [dynamo_subject("nsk.backend.generate")]


async def test_the_last_endpoint_uncaptured_under_a_running_pipeline_and_provisioned_again(
    nc: Client, nats_server: NatsServer
) -> None:
    """``uncapture`` with no endpoint while the namespace's pipeline runs: the capture stream
    is deleted and the events stream no longer sources it; the pipeline goes on folding its
    own events. Started again with the endpoint (what ``seqstate run --dynamo-endpoint`` does
    at its next start, a supervised restart included), it captures the endpoint afresh, from
    the new capture stream's first message."""
    config = fresh_config("last", dynamo_endpoint="last.backend.generate", idle_tick_s=3600.0)
    subject = dynamo_subject("last.backend.generate")
    url = nats_server.url
    js = nc.jetstream()
    async with Pipeline(nc, config) as pipeline:
        await nc.publish(subject, ADD)
        await nc.flush()
        await pipeline.wait_applied(await logged(nc, config, 1))
        done = await run_cli(config, url, "dynamo", "uncapture")
        assert done.returncode == 0, done.stderr
        assert done.stdout.splitlines()[:2] == [
            f"uncaptured Dynamo endpoint last.backend.generate of namespace "
            f"'{config.namespace}': the log keeps its 1 event, and replay still folds it",
            f"stream {dynamo_capture(config)} deleted: namespace '{config.namespace}' captures "
            "no Dynamo endpoint",
        ]
        with pytest.raises(NotFoundError):
            await js.stream_info(dynamo_capture(config))
        assert await sources(nc, config) == []
        await stored_nowhere(nc, subject)
        router = RouterPublisher(nc, config=config, router_id="r")
        await pipeline.wait_applied(await router.add("own", 3, block_hashes=[1]))
        assert set(pipeline.writer.state.requests.owner) == {"own", decode_dynamo(ADD).request_id}
    async with Pipeline(nc, config) as pipeline:  # its next start provisions it again
        assert await subjects(nc, config) == [subject]
        assert await sources(nc, config) == []
        await nc.publish(subject, CAPTURE[1].data)
        await nc.flush()
        last = await logged(nc, config, 3)
        await pipeline.wait_applied(last)
    assert (await js.stream_info(dynamo_capture(config))).state.last_seq == 1  # a new stream
    out = await run_cli(config, url, "replay", "--verify", "--no-progress")
    assert out.returncode == 0 and "identical: 0 keys differ" in out.stdout, out.stdout


async def test_what_the_capture_still_holds_reaches_the_log_before_it_is_deleted(
    nc: Client, nats_server: NatsServer
) -> None:
    """The events stream full (an operator's limit of 1 message): a second captured message
    waits in the capture stream. ``uncapture`` stops capturing, waits for the events stream to
    take it (``DRAIN_S``), and, since it cannot, refuses in one line, keeping the capture
    stream and its source. Once the events stream has room, the message reaches the log and
    ``uncapture`` again deletes the capture: nothing captured before it was lost."""
    config = fresh_config("full", dynamo_endpoint="full.backend.generate")
    await ensure(nc, config)
    js = nc.jetstream()
    events = (await js.stream_info(config.events_stream)).config
    events.max_msgs = 1
    await js.update_stream(events)
    subject = dynamo_subject("full.backend.generate")
    await nc.publish(subject, ADD)
    await nc.flush()
    async with forwarding(nc, config):  # a writer's, while the stream has room
        await logged(nc, config, 1)
    await nc.publish(subject, CAPTURE[1].data)
    await nc.flush()
    url = nats_server.url
    assert error_line(await run_cli(config, url, "dynamo", "uncapture")) == (
        f"seqstate: error: 1 Dynamo message captured for namespace '{config.namespace}' is "
        f"not in stream {config.events_stream} yet (the stream is full: maximum messages "
        f"exceeded (JetStream error 10077)); "
        f"{dynamo_capture(config)} captures nothing more, and is kept until the events stream "
        "has it: run this again then"
    )
    assert await subjects(nc, config) == [dynamo_capture(config)]  # no Dynamo subject
    await stored_nowhere(nc, subject)
    events = (await js.stream_info(config.events_stream)).config
    events.max_msgs = -1
    await js.update_stream(events)
    done = await run_cli(config, url, "dynamo", "uncapture")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == (  # its endpoint was taken out by the first run
        f"stream {dynamo_capture(config)} deleted: namespace '{config.namespace}' captures no "
        "Dynamo endpoint"
    )
    assert (await js.stream_info(config.events_stream)).state.messages == 2
    assert await sources(nc, config) == []
