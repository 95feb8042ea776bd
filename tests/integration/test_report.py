"""``seqstate report``'s page and the live ``/ui``, opened in headless Chromium.

Each page must draw every chart it has data for with real points (the chart's ``data-points``
and its first series' pixels on the canvas), log no error, and ask nothing of another machine
(every request the page made, through DevTools' Network domain).
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
from pathlib import Path

from browser_kit import Page, browser
from dynamo_capture import CAPTURE, ENDPOINT, FRONTEND_A, SUBJECT
from eventually import eventually
from nats.aio.client import Client
from pipeline_kit import fill, forwarding, fresh_config, logged, name_flags, run_cli, spawned_run
from test_metrics import command, free_port, pick, scrape

from projector.nats.resources import ensure
from projector.nats.server import NatsServer
from projector.ops.ui.page import MAX_POINTS
from projector.settings.config import Config
from seqstate.dynamo import decode_dynamo

WRITER_CHARTS = ("blocks", "prefill", "rate", "faults", "oldest")


def drawn(charts: dict[str, dict[str, str | int]], names: tuple[str, ...]) -> bool:
    counts = [str(charts.get(n, {}).get("points", "")) for n in names]
    return all(c.isdigit() and int(c) > 1 for c in counts)


async def open_and_check(page: Page, url: str, names: tuple[str, ...]) -> dict[str, dict]:
    """Open ``url``, wait until every chart of ``names`` has drawn points; the charts."""
    await page.open(url)
    charts = await eventually(page.charts, lambda c: drawn(c, names), what=f"charts of {url}")
    for name in names:
        assert charts[name]["ink"] > 20, (name, charts)  # lines drawn on its canvas
    assert page.errors == [], page.errors
    assert page.off_machine() == [], page.off_machine()
    assert page.requests and page.requests[0] == url
    return charts


async def test_the_report_draws_every_chart_from_the_log(
    nc: Client, nats_server: NatsServer, tmp_path: Path
) -> None:
    config = fresh_config("rep")
    await fill(nc, config, 3000)  # 2,000 adds over 8 workers, 1,000 frees, one undecodable
    out = tmp_path / "report.html"
    done = await run_cli(config, nats_server.url, "report", "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert re.fullmatch(r"wrote \S+ \([\d,]+ bytes, \d+ points per series\)\n", done.stdout)
    text = out.read_text()
    model = json.loads(
        text.split('<script id="seqstate-data" type="application/json">')[1].split("</script>")[0]
    )
    points = model["points"]
    assert 2 <= len(points) <= MAX_POINTS + 2
    last = points[-1]
    assert (last["events"], last["dead"], last["holes"]) == (3001, 1, 0)
    assert len(last["workers"]) == 8
    assert sum(blocks for blocks, _ in last["workers"].values()) > 0
    assert len(last["oldest"]) == 10 and last["oldest"][0][0] == "x1"
    # All of it inline: no script, style or image from anywhere (the icon is an empty data: URL).
    assert not re.search(r"""<(script|img)[^>]+src=|<link[^>]+href=["'](?!data:)""", text)
    async with browser() as page:
        charts = await open_and_check(page, out.as_uri(), WRITER_CHARTS)
        assert charts["capture"]["points"] == "none"  # no Dynamo publisher here
        assert await page.evaluate("document.querySelectorAll('#oldest-table tbody tr').length")


async def test_a_dynamo_namespace_shows_each_frontends_capture_rate_and_its_holes(
    nc: Client, nats_server: NatsServer, tmp_path: Path
) -> None:
    config = fresh_config("repdyn", dynamo_endpoint=ENDPOINT, idle_tick_s=3600.0)
    await ensure(nc, config)
    # Frontend A's 4th and 5th messages never reach the log: 2 messages lost.
    from_a = [i for i, m in enumerate(CAPTURE) if decode_dynamo(m.data).publisher_id == FRONTEND_A]
    dropped = set(from_a[3:5])
    kept = [m.data for i, m in enumerate(CAPTURE) if i not in dropped]
    async with forwarding(nc, config):  # what the namespace's writer does
        # In four bursts, each stored before the next is sent: a burst is one record batch at
        # one log time, and a rate needs intervals between them.
        quarter = -(-len(kept) // 4)
        for start in range(0, len(kept), quarter):
            for data in kept[start : start + quarter]:
                await nc.publish(SUBJECT, data)
            await nc.flush()
            await logged(nc, config, min(len(kept), start + quarter))
    out = tmp_path / "dynamo.html"
    done = await run_cli(config, nats_server.url, "report", "--out", str(out), "--no-progress")
    assert done.returncode == 0, done.stderr
    async with browser() as page:
        charts = await open_and_check(page, out.as_uri(), (*WRITER_CHARTS, "capture"))
        last = await page.evaluate(
            "JSON.parse(document.getElementById('seqstate-data').textContent).points.at(-1)"
        )
        assert last["holes"] == 2
        assert last["publishers"][str(FRONTEND_A)][1] == 2  # both were frontend A's
        assert charts["capture"]["points"] != "none"


async def test_report_errors_are_one_line_and_fail(
    nc: Client, nats_server: NatsServer, tmp_path: Path
) -> None:
    config = fresh_config("reperr")
    await fill(nc, config, 10)
    url, out = nats_server.url, str(tmp_path / "r.html")
    cases = {
        ("--out", "/nonexistent-folder/r.html"): "folder /nonexistent-folder does not exist",
        ("--out", out, "--since", "2100-01-01T00:00:00"): "no event between",
        ("--out", out, "--until", "2000-01-01T00:00:00"): "no event between",
        ("--out", out, "--since", "yesterday"): "--since 'yesterday': not an ISO 8601 time",
    }
    for args, why in cases.items():
        done = await run_cli(config, url, "report", *args, "--no-progress")
        assert done.returncode != 0, args
        assert why in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    other = fresh_config("repnone")
    done = await run_cli(other, url, "report", "--out", out, "--no-progress")
    assert done.returncode != 0 and other.namespace in done.stderr, done.stderr
    assert not Path(out).exists()
    done = await run_cli(config, url, "report", "--out", out, "--since=-1d", "--no-progress")
    assert done.returncode == 0, done.stderr


def test_the_live_page_of_seqstate_run_updates_every_second(tmp_path: Path) -> None:
    import asyncio

    proc, lines = spawned_run(
        tmp_path / "store",
        "--port",
        "0",
        "--metrics-port",
        "0",
        "--demo",
        "--no-live",
        until=("metrics on http://", "writer and projector running"),
    )
    try:
        port = re.search(r"metrics on http://127\.0\.0\.1:(\d+)/", "".join(lines))
        assert port, lines
        url = f"http://127.0.0.1:{port[1]}/ui"

        async def check() -> None:
            async with browser() as page:
                await open_and_check(page, url, WRITER_CHARTS)
                first = int(await page.evaluate("document.body.dataset.drawn"))
                await eventually(
                    lambda: page.evaluate("document.body.dataset.drawn"),
                    lambda n: int(n) >= first + 2,
                    what="two more points, a second apart",
                )
                # The page stays on the namespace it opened with (the process's only one).
                data = f"{url}/data?namespace={Config().namespace}"
                assert set(page.requests) == {url, data}, page.requests
                assert page.errors == []

        asyncio.run(check())
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def test_the_live_page_of_a_projector_draws_what_its_image_knows(
    nc: Client, nats_server: NatsServer, tmp_path: Path
) -> None:
    """A projector alone knows loads and counts (its image of the bucket), not requests' ages
    nor Dynamo's publishers: those charts say so, the others draw."""
    config = fresh_config("repui")
    last = await fill(nc, config, 300)
    port = free_port()
    url = f"http://127.0.0.1:{port}/ui"
    async with (
        command(nats_server.url, tmp_path / "writer.log", "writer", *name_flags(config)),
        command(
            nats_server.url,
            tmp_path / "projector.log",
            "projector",
            *name_flags(config),
            "--metrics-port",
            str(port),
        ),
    ):
        await eventually(
            lambda: scrape(port),
            lambda s: (
                pick(s, "seqstate_applied_seq", namespace=config.namespace, role="projector")
                >= last
            ),  # and the writer's idle ticks after them
            what="every event in the bucket",
            retry_on=(OSError,),
        )
        async with browser() as page:
            charts = await open_and_check(page, url, ("blocks", "prefill", "rate", "faults"))
            assert charts["oldest"]["points"] == charts["capture"]["points"] == "none"
            point = await page.evaluate("fetch('/ui/data').then((r) => r.json())")
            assert (point["role"], point["dead"]) == ("projector", 0)
            assert point["events"] >= last and "oldest" not in point
            assert len(point["workers"]) == 8


async def test_the_live_page_of_serve_http_shows_each_tracker_and_links_the_others(
    nats_server: NatsServer,
) -> None:
    """``serve-http`` runs a writer and a projector for each tracker (model) whose lease it
    holds: ``/ui?namespace=NS`` shows one, links the others, and its data stays on it; a
    namespace no consumer here runs is said so, naming those that do."""
    from http_kit import exchange, http_get, serve_http

    from projector.http.tracker_names import namespace_for

    config = fresh_config("uiht")
    models = {"model-a": 2, "model-b": 3}  # model: its workers
    spaces = {m: namespace_for(m, "default", config.namespace) for m in models}
    port = free_port()
    async with serve_http(nats_server.url, config, "--metrics-port", str(port)) as http:
        calls = [
            (
                "POST",
                "/register",
                {"model_name": m, "worker_id": w, "block_size": 16, "dp_start": 0, "dp_size": 1},
            )
            for m, count in models.items()
            for w in range(1, count + 1)
        ]
        calls += [
            (
                "POST",
                "/add",
                {
                    "model_name": m,
                    "request_id": "r",
                    "worker_id": 1,
                    "dp_rank": 0,
                    "sequence_hashes": [1, 2],
                    "new_isl_tokens": 20,
                },
            )
            for m in models
        ]
        assert {s for s, _ in await exchange(http, calls)} == {201}

        async def points() -> dict[str, dict]:
            out = {}
            for model, ns in spaces.items():
                status, _, body = await http_get(port, f"/ui/data?namespace={ns}")
                out[model] = json.loads(body) if status == 200 else {"status": status}
            return out

        got = await eventually(
            points,
            lambda p: all(len(p[m].get("workers", ())) == n for m, n in models.items()),
            what="each tracker's writer with its workers",
            retry_on=(OSError,),
        )
        for model, ns in spaces.items():
            assert (got[model]["namespace"], got[model]["role"]) == (ns, "writer")

        status, kind, body = await http_get(port, f"/ui?namespace={spaces['model-b']}")
        assert (status, kind.split(";")[0]) == (200, "text/html")
        assert f'<a href="/ui?namespace={spaces["model-a"]}">' in body
        assert f"/ui/data?namespace={spaces['model-b']}" in body

        status, _, body = await http_get(port, "/ui?namespace=st-nope-default")
        assert status == 404 and "'st-nope-default'" in body, body
        assert all(ns in body for ns in spaces.values()), body
        status, _, body = await http_get(port, "/ui/data?namespace=st-nope-default")
        assert status == 503 and "'st-nope-default'" in body, body
        status, _, body = await http_get(port, "/ui?" + "&".join(["namespace=a"] * 5))
        assert (status, body) == (400, "at most 4 query fields\n")

        # A page opened on one namespace draws it, and asks for that namespace's data only.
        url = f"http://127.0.0.1:{port}/ui?namespace={spaces['model-a']}"
        async with browser() as page:
            await open_and_check(page, url, ("blocks", "rate"))
            data = f"http://127.0.0.1:{port}/ui/data?namespace={spaces['model-a']}"
            assert set(page.requests) == {url, data}, page.requests
            links = await page.evaluate(
                "[...document.querySelectorAll('#namespaces a')].map((a) => a.textContent)"
            )
            assert links == [spaces["model-b"]]
