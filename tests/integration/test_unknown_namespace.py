"""A read of a namespace no pipeline has run is said so, with the namespaces that exist.

A mistyped ``--namespace dynn`` (or a namespace left out) printed an empty table "as of event
0" and exited 0; ``status`` even said "writer lag: nothing to fold" with no writer at all.
Each read command, run as a user types it, is asked about a namespace that is unknown (one
line naming it and listing the known ones, exit 1) and one that exists with nothing in it
yet (its pipeline running: an empty answer, exit 0).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import nats
import pytest
import pytest_asyncio
from log_text import error_line
from pipeline_kit import fresh_config, run_cli

from projector.nats.resources import ensure
from projector.nats.server import NatsServer
from projector.route.publisher import RouterPublisher
from projector.run.assemble import build_lease
from projector.run.pipeline import Pipeline
from projector.settings.config import Config

# One server and two pipelines for the module: each test runs commands against them.
pytestmark = pytest.mark.asyncio(loop_scope="module")

# Each read command, and what it answers for a namespace that exists with nothing in it: rc 0
# and that text in its output, or (None) a refusal of its own that is not "unknown namespace".
BUCKET_READERS: dict[tuple[str, ...], str | None] = {
    ("loads",): "worker  rank  requests  active_blocks  prefill_tokens  remaining_prefill_ms\n",
    ("loads", "--json"): "",
    ("watch", "--json", "--duration", "0.5"): "",
    ("top", "--once", "--interval", "0.2"): "as of event",
    ("inspect", "worker", "3"): None,  # worker 3 is not in its registry
    ("worker", "list"): "0 workers",
}
LOG_READERS: dict[tuple[str, ...], str | None] = {
    ("status",): "namespace '{ns}' on ",
    ("status", "--json"): '"namespace":"{ns}"',
    ("inspect", "request", "r1"): "state:  unknown",
    ("replay",): None,  # its log is empty
    ("loads", "--at", "-5m"): None,  # its log is empty
    ("replay", "--verify"): None,  # or the bucket holds no position yet
    ("snapshot", "list"): "name",
    ("snapshot", "show"): None,  # it has no snapshot
    ("rebuild",): None,  # its projector holds the lease
    ("dynamo", "resync", "--dynamo-endpoint", "dyn.backend.generate"): None,  # not captured
    ("dynamo", "uncapture"): None,  # it captures no Dynamo endpoint
}


# Asked of the empty namespace, these answer "not found" with exit 1 (a request no event names).
NOT_FOUND = {("inspect", "request", "r1")}


class Served:
    """One server's streams and bucket, with a pipeline in each of two namespaces: ``busy``
    (one request booked) and ``empty`` (nothing published yet)."""

    def __init__(self, url: str, busy: Config, empty: Config) -> None:
        self.url, self.busy, self.empty = url, busy, empty

    def other(self, namespace: str) -> Config:
        return self.busy.with_namespace(namespace)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(nats_server: NatsServer) -> AsyncIterator[Served]:
    busy = fresh_config("ns")
    empty = busy.with_namespace(f"{busy.namespace}-empty")
    nc = await nats.connect(nats_server.url)
    try:
        async with Pipeline(nc, busy) as first, Pipeline(nc, empty):
            router = RouterPublisher(nc, config=busy, router_id="r")
            seq = await router.add("r1", 3, block_hashes=[1, 2])
            await first.wait_applied(seq)
            yield Served(nats_server.url, busy, empty)
    finally:
        await nc.close()


@pytest.mark.parametrize("argv", [*BUCKET_READERS, *LOG_READERS], ids=" ".join)
async def test_a_mistyped_namespace_is_named_with_the_known_ones_and_an_empty_one_answers(
    served: Served, argv: tuple[str, ...]
) -> None:
    typo = served.other(f"{served.busy.namespace}x")
    result = await run_cli(typo, served.url, *argv)
    where = (
        f"stream {typo.events_stream} or bucket {typo.registry_bucket}"
        if argv in LOG_READERS
        else f"bucket {typo.registry_bucket}"
    )
    assert error_line(result) == (
        f"seqstate: error: unknown namespace '{typo.namespace}': nothing of it in {where}; "
        f"known namespaces: {served.busy.namespace}, {served.empty.namespace}"
    )
    # The namespace beside it, whose pipeline runs with nothing published: known.
    empty = await run_cli(served.empty, served.url, *argv)
    assert "unknown namespace" not in empty.stderr, empty.stderr
    says = {**BUCKET_READERS, **LOG_READERS}[argv]
    if says is not None:
        assert empty.returncode == (1 if argv in NOT_FOUND else 0), empty.stderr
        assert says.format(ns=served.empty.namespace) in empty.stdout, empty.stdout


async def test_many_known_namespaces_are_listed_in_one_bounded_line(served: Served) -> None:
    """Forty namespaces a projector has run (in a bucket of their own): the line names twenty
    and counts the rest."""
    config = fresh_config("many")
    names = [f"{config.namespace}-{i:02d}" for i in range(40)]
    nc = await nats.connect(served.url)
    try:
        await ensure(nc, config)
        for name in names:  # a lease taken and released: what a projector that ran leaves
            lease = build_lease(nc, config.with_namespace(name), "projector")
            await lease.acquire(wait=False)
            await lease.release()
    finally:
        await nc.close()
    result = await run_cli(config.with_namespace("nowhere"), served.url, "loads")
    assert error_line(result) == (
        f"seqstate: error: unknown namespace 'nowhere': nothing of it in bucket "
        f"{config.registry_bucket}; known namespaces: {', '.join(names[:20])} and 20 more"
    )


async def test_a_namespace_provisioned_but_never_projected_is_known_to_log_readers(
    served: Served,
) -> None:
    """``worker add --wait 0`` on streams and a bucket of their own provisions a namespace and
    stores its event, with no pipeline: the log's readers know it (status shows the event
    waiting), the bucket's readers do not (the bucket holds no namespace at all)."""
    fresh = fresh_config("unrun")
    added = await run_cli(fresh, served.url, "worker", "add", "5", "--wait", "0")
    assert added.returncode == 0, added.stderr
    status = await run_cli(fresh, served.url, "status")
    assert status.returncode == 0, status.stderr
    assert "stored but not folded yet" in status.stdout, status.stdout
    loads = await run_cli(fresh, served.url, "loads")
    assert error_line(loads) == (
        f"seqstate: error: unknown namespace '{fresh.namespace}': nothing of it in bucket "
        f"{fresh.registry_bucket}; no namespace is known there"
    )


async def test_reads_on_a_server_no_pipeline_has_used_say_what_is_missing_and_create_nothing(
    served: Served,
) -> None:
    """Streams, bucket and object store of names no command has used: each read says which
    one is missing and exits 1. ``worker list`` printed "0 workers" and ``snapshot list`` an
    empty table, both exit 0, the latter creating the object store as it read it."""
    bare = fresh_config("bare", snapshot_bucket=f"baresnap{fresh_config().namespace}")
    missing_bucket = (
        f"seqstate: error: bucket '{bare.registry_bucket}' does not exist: is a projector running?"
    )
    no_snapshots = f"seqstate: error: no snapshots for namespace '{bare.namespace}'"
    said = {
        ("loads",): missing_bucket,
        ("worker", "list"): missing_bucket,
        ("snapshot", "list"): f"{no_snapshots}: object store '{bare.snapshot_bucket}' does not "
        "exist (no writer has run with it)",
        ("snapshot", "show"): no_snapshots,
    }
    for argv, line in said.items():
        result = await run_cli(bare, served.url, *argv)
        assert error_line(result) == line, argv
    nc = await nats.connect(served.url)
    try:
        names = {info.config.name for info in await nc.jetstream().streams_info()}
    finally:
        await nc.close()
    mine = {bare.events_stream, f"KV_{bare.registry_bucket}", f"OBJ_{bare.snapshot_bucket}"}
    assert not names & mine, names & mine
