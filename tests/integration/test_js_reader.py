"""examples/js, a reader and a publisher in JavaScript written from docs/bucket-format.md and
docs/events-format.md alone, against a real pipeline: ``loads.mjs --json`` prints the bytes
``seqstate loads --json`` prints, its ``--watch`` view converges to them, and what
``publish.mjs`` sends is applied by the writer. Worker ids and hashes are u64 above 2^53,
where a plain ``JSON.parse`` rounds them.

Node.js and the example's node_modules are required, never skipped: ``make test`` and
``.ci/run`` install them (``npm ci --prefix examples/js``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import shutil
import subprocess

import pytest
from eventually import eventually
from nats.aio.client import Client
from pipeline_kit import REPO, clean_env, fresh_config, run_cli

from projector.bucket.reader import RegistryView
from projector.nats.server import NatsServer
from projector.route.publisher import RouterPublisher
from projector.run.pipeline import Pipeline
from projector.settings.config import Config

JS = REPO / "examples" / "js"
# Dynamo draws worker ids at random: most are past 2^53 (9007199254740992), and the
# first one here is where a JSON.parse of the load value printed 18446744073709552000.
WORKERS = [2**64 - 59, 2**64 - 2**40 + 3, 2**53 + 1, 7]


def node() -> str:
    found = shutil.which("node")
    if found is None:
        pytest.fail("node (Node.js 20 or newer) is not on the PATH: examples/js needs it")
    if not (JS / "node_modules" / "@nats-io" / "kv").is_dir():
        pytest.fail("examples/js/node_modules is missing: run `npm ci --prefix examples/js`")
    return found


def js_args(script: str, config: Config, url: str, *args: str) -> list[str]:
    bucket = ["--registry-bucket", config.registry_bucket] if script == "loads.mjs" else []
    return [
        node(),
        str(JS / script),
        "--nats-url",
        url,
        "--namespace",
        config.namespace,
        *bucket,
        *args,
    ]


async def run_js(script: str, config: Config, url: str, *args: str) -> str:
    """``node examples/js/SCRIPT ...`` as a user types it; its output, once it exited 0."""
    result = await asyncio.to_thread(
        subprocess.run,
        js_args(script, config, url, *args),
        capture_output=True,
        text=True,
        timeout=60,
        env=clean_env(),
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


async def python_loads(config: Config, url: str) -> str:
    out = await run_cli(config, url, "loads", "--json")
    assert out.returncode == 0, out.stderr
    return out.stdout


async def churn(
    pub: RouterPublisher, rng: random.Random, rounds: int, stop: asyncio.Event
) -> dict[str, tuple]:  # type: ignore[type-arg]
    """Requests booked, marked and freed on WORKERS' ranks, with shared prefixes, some
    prefills modeled and some not, for at least ``rounds`` and until ``stop``; returns the
    ones still live: id -> (worker, rank, modeled)."""
    live: dict[str, tuple] = {}  # type: ignore[type-arg]
    prefixes = [[rng.getrandbits(64) for _ in range(8)] for _ in range(4)]
    n = 0
    while n < rounds or not stop.is_set():
        n += 1
        worker, rank = rng.choice(WORKERS), rng.randrange(2)
        modeled = rng.random() < 0.5
        rid = f"r{n}"
        hashes = rng.choice(prefixes)[: rng.randrange(1, 9)] + [
            2**64 - 1 - rng.getrandbits(40) for _ in range(rng.randrange(4))
        ]
        await pub.add(
            rid,
            worker_id=worker,
            dp_rank=rank,
            block_hashes=hashes,
            prefill_tokens=16 * len(hashes),
            expected_prefill_ms=rng.choice([3.0, 40.0, 1500.0]) if modeled else None,
        )
        live[rid] = (worker, rank, modeled)
        for old in rng.sample(sorted(live), k=min(len(live), rng.randrange(3))):
            w, r, _ = live[old]
            if rng.random() < 0.4:
                await pub.mark_prefill_completed(old, worker_id=w, dp_rank=r)
                live[old] = (w, r, False)  # no prefill left: nothing of it decays
            else:
                await pub.free(old, worker_id=w, dp_rank=r)
                del live[old]
    return live


def folded(watch_lines: list[str]) -> tuple[list[str], int]:
    """The last record of each rank in ``--watch`` output, removed ranks dropped, as
    ``loads --json`` lines in its order; and the last position the records named."""
    rows: dict[tuple[int, int], dict] = {}  # type: ignore[type-arg]
    seq = 0
    for line in watch_lines:
        record = json.loads(line)
        seq = record.pop("applied_seq")
        rank = (record["worker_id"], record["dp_rank"])
        if record.get("removed"):
            rows.pop(rank, None)
        else:
            rows[rank] = record
    return [json.dumps(rows[r], separators=(",", ":")) for r in sorted(rows)], seq


async def test_loads_mjs_prints_what_seqstate_loads_prints_under_load(
    nc: Client, nats_server: NatsServer
) -> None:
    url = nats_server.url
    config = fresh_config("js")
    rng = random.Random(7)
    async with Pipeline(nc, config):
        pub = RouterPublisher(nc, namespace=config.namespace, router_id="js-load")
        first = await pub.add("first", worker_id=WORKERS[0], block_hashes=[2**64 - 1])
        async with RegistryView(nc, namespace=config.namespace, config=config) as view:
            await view.wait_for(first, timeout=30)  # a row to read from the start
        watcher = subprocess.Popen(
            js_args("loads.mjs", config, url, "--watch", "--json"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=clean_env(),
            cwd=REPO,
        )
        try:
            watched: list[str] = []
            assert watcher.stdout is not None
            reading = asyncio.create_task(
                asyncio.to_thread(lambda: watched.extend(iter(watcher.stdout.readline, "")))  # type: ignore[union-attr]
            )
            stop = asyncio.Event()
            load = asyncio.create_task(churn(pub, rng, 300, stop))
            # Read while the load runs: every line is a row of a known rank, exit 0.
            during = await run_js("loads.mjs", config, url, "--json")
            stop.set()
            assert during and all(
                json.loads(line)["worker_id"] in WORKERS for line in during.splitlines()
            )
            live = await load

            # Stop the load with every live prefill unmodeled (a modeled one is marked
            # completed): the loads then stand still, whatever the reader's "now", and two
            # readers started a moment apart must print the same bytes.
            for rid, (worker, rank, modeled) in live.items():
                if modeled:
                    last = await pub.mark_prefill_completed(rid, worker_id=worker, dp_rank=rank)
            last = await pub.free("first", worker_id=WORKERS[0])
            async with RegistryView(nc, namespace=config.namespace, config=config) as view:
                await view.wait_for(last, timeout=30)

            expected = await python_loads(config, url)
            got = await run_js("loads.mjs", config, url, "--json")
            assert got == expected
            rows = [json.loads(line) for line in expected.splitlines()]
            assert f'"worker_id":{WORKERS[0]},' in expected  # exact, not 1.8446744073709552e19
            assert {r["worker_id"] for r in rows} == set(WORKERS)
            assert sum(r["active_requests"] for r in rows) == len(live)
            assert any(r["active_prefill_tokens"] > 0 for r in rows)

            # The live view converges to the same rows. (The position its lines name is not
            # compared: a flush whose position comes over HOLD_MS late is shown without it,
            # as the page says; test/view.test.mjs checks the hold itself.)
            await eventually(
                lambda: folded(list(watched)),
                lambda f: f[0] == expected.splitlines() and 0 < f[1] <= last,
                what="loads.mjs --watch to show the last event's loads",
                watch=lambda: "\n".join(watched[-5:]),
            )
        finally:
            watcher.terminate()
            watcher.wait(timeout=30)
        await reading
        assert watcher.returncode == 0, watcher.stderr.read()  # type: ignore[union-attr]


async def test_publish_mjs_books_a_request_the_ledger_applies(
    nc: Client, nats_server: NatsServer
) -> None:
    url = nats_server.url
    config = fresh_config("jsp")
    worker = WORKERS[0]
    hashes = [2**64 - 1, 2**63 + 5, 12]
    flags = ["--request-id", "js-1", "--worker-id", str(worker), "--dp-rank", "1"]
    async with Pipeline(nc, config):
        add = await run_js(
            "publish.mjs",
            config,
            url,
            *flags,
            "--hashes",
            ",".join(map(str, hashes)),
            "--prefill-tokens",
            "48",
            "add",
        )
        assert add == "add 1\n"
        async with RegistryView(nc, namespace=config.namespace, config=config) as view:
            await view.wait_for(1, timeout=30)
            # Every hash came through whole: the rank holds the prompt's three blocks.
            assert view.rank_of("js-1") == (worker, 1)
            assert view.overlap_depths(hashes) == {(worker, 1): 3}
        booked = await run_js("loads.mjs", config, url, "--json")
        assert booked == (
            f'{{"worker_id":{worker},"dp_rank":1,"active_blocks":3,"active_prefill_tokens":48,'
            '"active_requests":1,"modeled_remaining_prefill_ms":null}\n'
        )
        assert await run_js("publish.mjs", config, url, *flags, "mark", "free") == (
            "mark 2\nfree 3\n"
        )
        async with RegistryView(nc, namespace=config.namespace, config=config) as view:
            await view.wait_for(3, timeout=30)
        out = await run_cli(config, url, "inspect", "request", "js-1", "--json")
        report = json.loads(out.stdout)
        assert (report["state"], report["worker_id"], report["dp_rank"]) == ("ended", worker, 1)
        assert [(e["seq"], e["type"], e["outcome"]) for e in report["events"]] == [
            (1, "AddRequest", "applied"),
            (2, "MarkPrefillCompleted", "applied"),
            (3, "Free", "applied"),
        ]
        assert report["router"] == "js-example"
        assert await run_js("loads.mjs", config, url, "--json") == await python_loads(config, url)

        # A namespace the bucket does not know is said so, never answered with no rows.
        other = dataclasses.replace(config, namespace="jsnone")
        unknown = await asyncio.to_thread(
            subprocess.run,
            js_args("loads.mjs", other, url, "--json"),
            capture_output=True,
            text=True,
            timeout=60,
            env=clean_env(),
        )
        assert (unknown.returncode, unknown.stdout) == (1, "")
        assert unknown.stderr == (
            f"loads.mjs: namespace jsnone is unknown to bucket {config.registry_bucket}: "
            "no jsnone.position or lease\n"
        )


def test_loads_mjs_says_an_unknown_namespace_is_unknown(nats_server: NatsServer) -> None:
    config = fresh_config("jsu")
    result = subprocess.run(
        js_args("loads.mjs", config, nats_server.url, "--json"),
        capture_output=True,
        text=True,
        timeout=60,
        env=clean_env(),
        cwd=REPO,
    )
    assert result.returncode == 1 and result.stdout == ""
    assert (
        result.stderr.startswith("loads.mjs: no registry bucket")
        and len(result.stderr.splitlines()) == 1
    )


def test_the_js_reader_computes_the_pages_test_vectors() -> None:
    result = subprocess.run(
        [node(), str(JS / "vectors.mjs")], capture_output=True, text=True, timeout=60, cwd=REPO
    )
    assert (result.returncode, result.stderr) == (0, "")
    assert result.stdout == "11 vectors: every row as the page says\n"


def test_the_js_view_holds_a_flush_until_its_position() -> None:
    result = subprocess.run(
        [node(), "--test", str(JS / "test")], capture_output=True, text=True, timeout=60, cwd=REPO
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "# pass 2\n" in result.stdout and "# fail 0\n" in result.stdout
