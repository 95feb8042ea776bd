"""The worker control plane (``WorkerControl``, ``seqstate worker add|remove|list``) through a
real pipeline: a change is confirmed only once the read model shows it, a removal drops the
worker's keys, and a flap within the grace period keeps a busy worker's bookings."""

from __future__ import annotations

import json

import pytest
from log_text import plain_lines
from nats.aio.client import Client
from pipeline_kit import bucket_values, fresh_config, run_cli

from projector.bucket.reader import RegistryView
from projector.control.workers import (
    WorkerChange,
    WorkerControl,
    WorkerNotRegistered,
    WorkerRefused,
)
from projector.nats.server import NatsServer
from projector.ops.replay import rebuild, verify
from projector.route.publisher import RouterPublisher
from projector.run.pipeline import Pipeline
from projector.settings.config import Config


def keys_of(values: dict[str, bytes], config: Config, worker_id: int) -> list[str]:
    mine = (f"{config.namespace}.load.{worker_id}.", f"{config.namespace}.req.{worker_id}.")
    return sorted(k for k in values if k.startswith(mine))


async def test_add_list_and_remove_a_worker_and_its_keys(nc: Client) -> None:
    config = fresh_config("wc")
    async with Pipeline(nc, config) as pipeline:
        control = WorkerControl(nc, config=config)
        added = await control.add(7, dp_size=2)
        assert (added.worker_id, added.applied, added.dp_ranks) == (7, True, [0, 1])
        await control.add(8)
        pub = RouterPublisher(nc, namespace=config.namespace, router_id="wc", config=config)
        await pub.add("a", 7, 1, block_hashes=[1, 2, 3], prefill_tokens=48)
        await pipeline.wait_applied(await pub.add("b", 8, block_hashes=[4]))
        listed = await control.workers()
        assert [
            (w.worker_id, w.dp_ranks, w.active_requests, w.active_blocks, w.prefill_tokens)
            for w in listed
        ] == [(7, [0, 1], 1, 3, 48), (8, [0], 1, 1, 0)]
        ns = config.namespace
        assert keys_of(await bucket_values(nc, config), config, 7) == [
            f"{ns}.load.7.0",
            f"{ns}.load.7.1",
            f"{ns}.req.7.1.0",
        ]
        removed = await control.remove(7)
        assert (removed.applied, removed.dp_ranks) == (True, [])
        values = await bucket_values(nc, config)
        assert keys_of(values, config, 7) == []  # its loads and its request slots, all gone
        assert keys_of(values, config, 8) != []
        assert [w.worker_id for w in await control.workers()] == [8]
        with pytest.raises(WorkerNotRegistered, match="worker 7 has no rank in the registry"):
            await control.remove(7)
    assert await verify(nc, config) == []


async def test_a_worker_back_within_the_grace_keeps_its_bookings(nc: Client) -> None:
    config = fresh_config("wg", worker_grace_s=60.0)
    async with Pipeline(nc, config) as pipeline:
        control = WorkerControl(nc, config=config)
        await control.add(3, dp_size=2)
        pub = RouterPublisher(nc, namespace=config.namespace, router_id="wg", config=config)
        for i in range(5):
            await pub.add(f"q{i}", 3, i % 2, block_hashes=[i, 100 + i], prefill_tokens=32)
        await pipeline.wait_applied(await pub.mark_prefill_completed("q0", 3, 0))
        before = {w.worker_id: w for w in await control.workers()}[3]
        busy_keys = keys_of(await bucket_values(nc, config), config, 3)
        assert before.active_requests == 5 and len(busy_keys) == 2 + 5
        await control.remove(3)
        assert await control.workers() == []  # out of sight while it is away
        await pub.free("q4", 3, 0)  # its requests are still followed
        back = await control.add(3, dp_size=2)
        assert back.dp_ranks == [0, 1]
        after = {w.worker_id: w for w in await control.workers()}[3]
        assert after.active_requests == 4
        assert after.active_blocks == before.active_blocks - 2
        assert after.prefill_tokens == before.prefill_tokens - 32
    assert await verify(nc, config) == []


async def test_without_a_grace_a_re_added_worker_starts_empty(nc: Client) -> None:
    config = fresh_config("wn")
    async with Pipeline(nc, config):
        control = WorkerControl(nc, config=config)
        await control.add(4)
        pub = RouterPublisher(nc, namespace=config.namespace, router_id="wn", config=config)
        await pub.add("x", 4, block_hashes=[1])
        await control.remove(4)
        await control.add(4)
        assert [(w.worker_id, w.active_requests) for w in await control.workers()] == [(4, 0)]


async def test_refusals_name_the_bound_before_anything_is_published(nc: Client) -> None:
    config = fresh_config("wr", max_ranks_per_worker=4)
    async with Pipeline(nc, config) as pipeline:
        control = WorkerControl(nc, config=config)
        with pytest.raises(WorkerRefused, match="5 ranks, more than max_ranks_per_worker"):
            await control.add(1, dp_size=5)
        with pytest.raises(WorkerRefused, match="worker 1: "):
            await control.add(1, dp_size=0)
        assert pipeline.writer.stats.last_seq == 0  # nothing reached the log


async def test_without_a_pipeline_a_change_is_stored_and_said_to_be_pending(nc: Client) -> None:
    config = fresh_config("wp")
    from projector.nats.resources import ensure

    await ensure(nc, config)
    change = await WorkerControl(nc, config=config, wait_s=0.3).add(2)
    assert change == WorkerChange(2, 1, False, [])


async def test_the_cli_fails_a_change_the_registry_never_showed(nats_server: NatsServer) -> None:
    # No pipeline: the change is stored, never folded. "added" with exit 0 let a script route
    # to a worker no scheduler could see.
    config = fresh_config("wnone")
    url = nats_server.url
    out = await run_cli(config, url, "worker", "add", "4", "--wait", "0.5")
    lines = plain_lines(out.stderr)
    assert out.returncode == 1 and len(lines) == 1, out.stderr
    assert lines[0].startswith(
        "seqstate: error: worker 4: stored as event 1, but the registry did not show it "
        "within 0.5s: is the pipeline"
    ), lines
    assert out.stdout == ""
    # Asked not to wait, stored is the whole promise: said so, exit 0.
    out = await run_cli(config, url, "worker", "add", "4", "--wait", "0")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "worker 4: stored as event 2 (not waited for)"


async def test_the_cli_adds_lists_and_removes_workers(nc: Client, nats_server: NatsServer) -> None:
    config = fresh_config("wcli")
    url = nats_server.url
    async with Pipeline(nc, config):
        out = await run_cli(config, url, "worker", "add", "9", "--dp-size", "2")
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip().startswith("worker 9: ranks 0-1 in the registry (event ")
        out = await run_cli(config, url, "worker", "add", "12", "--dp-start", "3")
        assert "worker 12: ranks 3 in the registry" in out.stdout
        out = await run_cli(config, url, "worker", "list")
        lines = out.stdout.splitlines()
        assert lines[0].split() == ["worker", "ranks", "requests", "blocks", "prefill", "tok"]
        assert [line.split()[:2] for line in lines[1:3]] == [["9", "0-1"], ["12", "3"]]
        assert lines[-1] == "2 workers"
        out = await run_cli(config, url, "worker", "list", "--json")
        rows = [json.loads(line) for line in out.stdout.splitlines()]
        assert [(r["worker_id"], r["dp_ranks"]) for r in rows] == [(9, [0, 1]), (12, [3])]
        out = await run_cli(config, url, "worker", "remove", "9")
        assert out.returncode == 0 and out.stdout.startswith("worker 9: removed from the registry")
        for args, message in [
            (("remove", "9"), "seqstate: error: worker 9 has no rank in the registry"),
            (("add",), "seqstate: error: worker add needs a WORKER_ID"),
            (("list", "3"), "seqstate: error: worker list takes no WORKER_ID"),
            (("add", "5", "--dp-size", "0"), "seqstate: error: worker 5: "),
        ]:
            out = await run_cli(config, url, "worker", *args)
            lines = plain_lines(out.stderr)
            assert out.returncode == 1 and len(lines) == 1, out.stderr
            assert lines[0].startswith(message), lines


async def test_the_cli_records_the_namespaces_block_size_for_schedulers(
    nc: Client, nats_server: NatsServer
) -> None:
    """Under the router rules (the default) a registration naming a block size records it as
    the namespace's, the latest one winning: a scheduler reads it to count tokens in blocks."""
    config = fresh_config("wbs")
    url = nats_server.url
    async with Pipeline(nc, config), RegistryView(nc, config=config) as view:
        assert view.block_size is None
        out = await run_cli(config, url, "worker", "add", "5", "--block-size", "16")
        assert out.returncode == 0, out.stderr
        assert out.stdout.startswith("worker 5: ranks 0 in the registry (event 1)")
        await view.wait_for(1, timeout=10)
        assert view.block_size == 16
        await WorkerControl(nc, config=config).add(6, block_size=32)
        await view.wait_for(2, timeout=10)
        assert view.block_size == 32
        await WorkerControl(nc, config=config).remove(6)
        await view.wait_for(3, timeout=10)
        assert view.block_size == 32  # a removal leaves it
    out = await run_cli(config, url, "replay", "--verify")
    assert out.returncode == 0 and "identical: 0 keys differ" in out.stdout, out.stdout
    await rebuild(nc, config)
    assert await verify(nc, config) == []
    async with RegistryView(nc, config=config) as view:
        assert view.block_size == 32
