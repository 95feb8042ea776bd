"""The embedded server: starts from the venv's binary, serves JetStream, stops cleanly."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client

from projector.nats.server import NatsServer, NatsServerError, PortTaken, find_binary


async def test_fixture_server_serves_jetstream(nc: Client) -> None:
    js = nc.jetstream()
    info = await js.account_info()
    assert info.limits is not None
    assert nc.connected_server_version.major >= 2


def test_two_servers_get_distinct_ports_and_store_what_they_are_given(tmp_path: Path) -> None:
    with NatsServer(tmp_path / "a") as a, NatsServer(tmp_path / "b") as b:
        assert a.port != b.port and a.port > 0 and b.port > 0
        assert any("Server is ready" in line for line in a.log)
    assert (tmp_path / "a" / "jetstream").is_dir()
    assert a.log  # the tail survives the stop


async def test_async_use_and_clean_stop_keeps_the_data(tmp_path: Path) -> None:
    async with NatsServer(tmp_path) as server:
        nc = await nats.connect(server.url)
        js = nc.jetstream()
        await js.add_stream(name="KEEP", subjects=["keep.>"])
        await js.publish("keep.one", b"1")
        await nc.close()
    async with NatsServer(tmp_path) as server:
        nc = await nats.connect(server.url)
        info = await nc.jetstream().stream_info("KEEP")
        assert info.state.messages == 1
        await nc.close()


def test_missing_binary_is_reported_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SEQSTATE_NATS_SERVER", "/nonexistent/nats-server")
    with pytest.raises(NatsServerError, match="not an executable"):
        find_binary()


def test_binary_comes_from_the_environment() -> None:
    assert os.access(find_binary(), os.X_OK)


def test_an_unusable_store_directory_is_reported(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(NatsServerError, match=r"cannot use .* as the JetStream store"):
        NatsServer(blocker / "store").start()


def test_a_server_that_exits_early_is_reported(tmp_path: Path) -> None:
    with pytest.raises(NatsServerError, match="exited with"):
        NatsServer(tmp_path, extra_args=("--no-such-flag",), ready_timeout=5).start()


def test_a_port_taken_is_named(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(PortTaken, match=f"^port {port} on 127.0.0.1 is taken$"):
            NatsServer(tmp_path, port=port, ready_timeout=5).start()
