"""``seqstate publish FILE --router-id R``, interrupted and resumed: what Ctrl-C says it
stored, and ``--resume`` storing each event of the file once, in order; a router id that no
msg-id can carry refused. Subprocesses against a real server."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from pathlib import Path

import nats
from cli_kit import one_line_error
from eventually import eventually
from holding_proxy import HoldingProxy
from log_text import plain_lines
from nats.js.errors import NotFoundError
from pipeline_kit import REPO, cli_env, fresh_config, name_flags, seqstate

from projector.nats.server import NatsServer
from projector.settings.config import Config


async def _publishing(
    url: str, config: Config, path: Path, *flags: str
) -> asyncio.subprocess.Process:
    """``seqstate publish FILE --router-id p3 FLAGS`` started against ``url``, as typed."""
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "projector",
        "publish",
        str(path),
        "--router-id",
        "p3",
        *name_flags(config),
        *flags,
        env=cli_env(NATS_URL=url),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


async def _interrupted_publish(
    nats_server: NatsServer, config: Config, path: Path, *flags: str
) -> tuple[int, str]:
    """``seqstate publish FILE --router-id p3`` interrupted (SIGINT, as Ctrl-C sends it) once
    it has stored 200 events; its exit code and its one line."""
    proc = await _publishing(nats_server.url, config, path, *flags)
    nc = await nats.connect(nats_server.url)
    try:
        js = nc.jetstream()

        async def stored() -> int:
            try:
                return (await js.stream_info(config.events_stream)).state.messages
            except NotFoundError:
                return 0

        await eventually(stored, lambda n: n >= 200, what="200 events stored")
    finally:
        await nc.close()
    proc.send_signal(signal.SIGINT)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert out == b"", out
    (line,) = plain_lines(err.decode())
    return proc.returncode or 0, line


def _frees(count: int) -> str:
    return "".join(
        json.dumps({"type": "Free", "request_id": f"f{i}", "worker_id": 1}) + "\n"
        for i in range(count)
    )


async def _stored_ids(nats_server: NatsServer, config: Config) -> list[str]:
    """The request id of every event stored, in stream order."""
    from seqstate import decode_event

    nc = await nats.connect(nats_server.url)
    try:
        js = nc.jetstream()
        count = (await js.stream_info(config.events_stream)).state.messages
        msgs = [await js.get_msg(config.events_stream, s) for s in range(1, count + 1)]
        return [decode_event(m.data).request_id for m in msgs]  # type: ignore[union-attr]
    finally:
        await nc.close()


async def _resumed(
    nats_server: NatsServer, config: Config, path: Path, stored: int, total: int
) -> None:
    """``publish FILE --router-id p3 --resume``: the rest published, the whole file stored
    once, in order."""
    resumed = seqstate(
        "publish",
        str(path),
        "--router-id",
        "p3",
        "--resume",
        *name_flags(config),
        NATS_URL=nats_server.url,
    )
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stdout == (
        f"published {total - stored} events ({stored} already stored), last sequence {total}\n"
    )
    assert await _stored_ids(nats_server, config) == [f"f{i}" for i in range(total)]


async def test_an_interrupted_publish_says_what_it_stored_and_resumes(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    """Ctrl-C on ``publish FILE`` of 20,000 events: exit 130 and one line saying how many
    were stored and how to resume. Run again with the same router id, without ``--resume``:
    refused in one line, nothing stored. With ``--resume``: the rest, each event once, in
    the file's order."""
    config = fresh_config("pub")
    path = tmp_path / "frees.jsonl"
    path.write_text(_frees(20_000))
    rc, line = await _interrupted_publish(nats_server, config, path)
    assert rc == 130
    hint = f"`seqstate publish {path} --router-id p3 --resume` checks them and publishes the rest"
    assert line.startswith("seqstate: interrupted: "), line
    assert line.endswith(
        f"of 20000 events of {path} stored (router id 'p3'; the next one may be too); {hint}"
    ), line
    said = int(line.split("interrupted: ")[1].split(" of ")[0])
    assert said >= 200
    stored = len(await _stored_ids(nats_server, config))
    assert stored in (said, said + 1)

    again = seqstate(
        "publish", str(path), "--router-id", "p3", *name_flags(config), NATS_URL=nats_server.url
    )
    assert again.returncode == 1 and again.stdout == ""
    error = one_line_error(again)
    assert error.startswith(
        "seqstate: error: router id 'p3' already stored events (msg-id p3:1:"
    ), error
    assert "is at stream sequence 1; 0 stored by this run)" in error, error
    assert len(await _stored_ids(nats_server, config)) == stored

    await _resumed(nats_server, config, path, stored, 20_000)


def test_publish_refuses_a_router_id_no_msg_id_can_carry_in_one_line(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    """``--router-id`` of 257 characters ended in a traceback (the publisher's ValueError),
    and an empty one published under a default id instead. Each is one line, nothing
    stored."""
    config = fresh_config("rid")
    path = tmp_path / "one.jsonl"
    path.write_text(_frees(1))
    refused = {
        "r" * 257: "router_id 'rrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrr'… (257 "
        "characters): at most 256 characters (what a RouterHeartbeat carries)",
        "": "router_id must not be empty",
    }
    for router_id, why in refused.items():
        result = seqstate(
            "publish",
            str(path),
            "--router-id",
            router_id,
            *name_flags(config),
            NATS_URL=nats_server.url,
        )
        assert one_line_error(result) == f"seqstate: error: --router-id: {why}"
        assert result.returncode == 1


async def test_ctrl_c_before_a_resume_has_read_the_log_says_that_nothing_was_published(
    tmp_path: Path,
) -> None:
    """Ctrl-C on ``publish FILE --resume`` while it reads the log for the events its router id
    stored: exit 130 and one line saying that this run published none and how to go on. It
    exited 130 without a word, and only after its drain had waited for the read called off.
    A proxy holds the command at the consumer it reads the log with, whatever the speed."""
    path = tmp_path / "frees.jsonl"
    path.write_text(_frees(300))
    config = fresh_config("pub")
    with NatsServer(tmp_path / "nats") as server:
        first = seqstate(
            "publish", str(path), "--router-id", "p3", *name_flags(config), NATS_URL=server.url
        )
        assert first.returncode == 0, first.stderr
        port = int(server.url.rsplit(":", 1)[1])
        proxy = await HoldingProxy(port, hold_at="$JS.API.CONSUMER.CREATE.").start()
        try:
            proc = await _publishing(proxy.url, config, path, "--resume")
            await asyncio.wait_for(proxy.held.wait(), 60)
            proc.send_signal(signal.SIGINT)
            out, err = await asyncio.wait_for(proc.communicate(), 60)
        finally:
            await proxy.stop()
        assert len(await _stored_ids(server, config)) == 300
    assert (proc.returncode, out) == (130, b""), err
    assert plain_lines(err.decode()) == [
        "seqstate: interrupted before checking the events router id 'p3' stored earlier: none "
        f"of {path} published by this run; `seqstate publish {path} --router-id p3 --resume` "
        "checks them and publishes the rest"
    ]


async def test_a_resume_after_the_duplicate_window_stores_each_event_once(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    """The stream's duplicate window (here 100 ms, its least) has long passed when
    ``--resume`` runs, so JetStream no longer knows the first run's msg-ids: the log does, and
    each event of the file is stored once, none skipped. A file that is not the one the router
    id published is refused, nothing stored."""
    config = fresh_config("pub")
    nc = await nats.connect(nats_server.url)
    try:  # the deployment's streams, the events stream's window shrunk below any run's gap
        from projector.nats.resources import ensure

        info = (await ensure(nc, config)).events
        info.config.duplicate_window = 0.1
        await nc.jetstream().update_stream(info.config)
    finally:
        await nc.close()
    path = tmp_path / "frees.jsonl"
    path.write_text(_frees(5_000))
    rc, line = await _interrupted_publish(nats_server, config, path)
    assert rc == 130, line
    stored = len(await _stored_ids(nats_server, config))

    other = tmp_path / "other.jsonl"
    other.write_text(_frees(3) + _frees(5_000)[3 * len(_frees(1)) :].replace('"f5"', '"g5"'))
    refused = seqstate(
        "publish",
        str(other),
        "--router-id",
        "p3",
        "--resume",
        *name_flags(config),
        NATS_URL=nats_server.url,
    )
    assert one_line_error(refused) == (
        "seqstate: error: router id 'p3' stored, as its event 6 (stream sequence 6), another "
        f"event than {other}:6: not a run of this file, not resuming"
    )

    await _resumed(nats_server, config, path, stored, 5_000)
