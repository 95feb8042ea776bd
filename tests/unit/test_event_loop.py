"""serve-http's event loop: uvloop when installed, asyncio otherwise or on request,
and one clear error where uvloop is asked for and missing, as ``main`` runs it."""

from __future__ import annotations

import sys

import pytest

from projector.ops.cli import event_loop, main
from projector.settings.config import Config, ConfigError


def test_auto_takes_uvloop_when_installed_and_asyncio_on_request() -> None:
    uvloop = pytest.importorskip("uvloop")
    assert event_loop(Config(), True) is uvloop.new_event_loop
    assert event_loop(Config(event_loop="uvloop"), True) is uvloop.new_event_loop
    assert event_loop(Config(event_loop="asyncio"), True) is None
    assert event_loop(Config(event_loop="uvloop"), False) is None  # not serve-http's command


def test_without_uvloop_auto_falls_back_and_uvloop_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # as if not installed: import fails
    assert event_loop(Config(), True) is None
    code = main(["serve-http", "--event-loop", "uvloop", "--nats-url", "nats://127.0.0.1:1"])
    err = capsys.readouterr().err
    assert code == 1
    (line,) = err.strip().splitlines()  # one line, no traceback (JSON when piped)
    assert "--event-loop uvloop: uvloop is not installed (pip install 'seqstate[fast]')" in line


def test_an_unknown_loop_is_refused() -> None:
    with pytest.raises(ConfigError, match="'auto', 'uvloop' or 'asyncio'"):
        Config(event_loop="trio")
