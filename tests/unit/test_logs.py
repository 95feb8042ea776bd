"""Log formats (projector.settings.logs): JSON lines a pipeline parses, console lines a person
reads."""

from __future__ import annotations

import io
import json
import logging
import re
import sys
from collections.abc import Iterator

import pytest

from projector.settings.logs import (
    FIELDS,
    ConsoleFormatter,
    JsonFormatter,
    error_line,
    event_fields,
    handler_for,
    resolve,
    setup_logging,
)
from seqstate import AddRequest, Tick


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def _record(
    msg: str = "hello %s",
    args: tuple[object, ...] = ("world",),
    **extra: object,
) -> logging.LogRecord:
    logger = logging.getLogger("seqstate.test")
    return logger.makeRecord(
        "seqstate.test", logging.WARNING, __file__, 1, msg, args, None, extra=extra or None
    )


@pytest.fixture
def logger() -> Iterator[tuple[logging.Logger, io.StringIO]]:
    out = io.StringIO()
    handler = handler_for("json", out)
    log = logging.getLogger("seqstate.test.logs")
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    log.propagate = False
    yield log, out
    log.removeHandler(handler)
    log.propagate = True


def test_a_json_record_parses_with_its_fields() -> None:
    line = JsonFormatter().format(_record())
    record = json.loads(line)
    assert record["level"] == "warning" and record["logger"] == "seqstate.test"
    assert record["msg"] == "hello world"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", record["ts"])
    assert set(record) == {"ts", "level", "logger", "msg"}


def test_allow_listed_extras_are_kept_and_others_are_not() -> None:
    extra = {
        "request_id": "r1",
        "worker": 3,
        "dp_rank": 1,
        "stream_seq": 42,
        "router_id": "router-a",
        "namespace": "ns",
        "prompt": "secret text",
        "block_hashes": [1, 2, 3],
    }
    record = json.loads(JsonFormatter().format(_record(**extra)))
    for key in FIELDS:
        assert record[key] == extra[key]
    assert "prompt" not in record and "block_hashes" not in record
    # Nor any of the LogRecord's own attributes.
    assert "pathname" not in record and "lineno" not in record and "args" not in record


def test_newlines_in_a_message_stay_on_one_line() -> None:
    line = JsonFormatter().format(_record("first\nsecond\r\nthird %s", ("x\ny",)))
    assert "\n" not in line and "\r" not in line
    assert json.loads(line)["msg"] == "first\nsecond\r\nthird x\ny"


def test_an_exception_is_its_traceback_text(logger: tuple[logging.Logger, io.StringIO]) -> None:
    log, out = logger
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("it failed", extra={"stream_seq": 7})
    lines = out.getvalue().splitlines()
    assert len(lines) == 1
    record = json.loads(lines[0])
    assert record["level"] == "error" and record["msg"] == "it failed"
    assert record["stream_seq"] == 7
    assert "Traceback" in record["exc"] and "ValueError: boom" in record["exc"]


def test_an_odd_extra_value_is_shown_not_fatal() -> None:
    record = json.loads(JsonFormatter().format(_record(request_id=object())))
    assert record["request_id"].startswith("<object object")


def test_event_fields_name_ids_never_content() -> None:
    event = AddRequest(
        request_id="r1",
        worker_id=3,
        dp_rank=1,
        block_hashes=[11, 12],
        prefill_tokens=1200,
        router_id="ra",
    )
    assert event_fields(event) == {"request_id": "r1", "worker": 3, "dp_rank": 1, "router_id": "ra"}
    assert event_fields(Tick()) == {}


def test_the_console_never_wraps_a_long_message(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "40")
    out = _Tty()
    handler = handler_for("console", out)
    log = logging.getLogger("seqstate.test.console")
    log.addHandler(handler)
    log.propagate = False
    try:
        path = "/very/long/" + "x" * 300
        log.warning("store at %s", path, extra={"request_id": "r1", "worker": 0})
    finally:
        log.removeHandler(handler)
        log.propagate = True
    lines = out.getvalue().splitlines()
    assert len(lines) == 1, lines
    assert path in lines[0]
    assert lines[0].endswith("request_id=r1 worker=0")
    assert "\x1b[33m" in lines[0]  # a terminal gets the level's colour


def test_the_console_off_a_terminal_is_plain() -> None:
    line = ConsoleFormatter(colour=False, short_time=False).format(_record(stream_seq=5))
    assert "\x1b" not in line and "\n" not in line
    assert " WARNING seqstate.test: hello world  stream_seq=5" in line


def test_auto_is_console_on_a_terminal_and_json_elsewhere() -> None:
    assert resolve("auto", _Tty()) == "console"
    assert resolve("auto", io.StringIO()) == "json"
    assert resolve("json", _Tty()) == "json"
    assert resolve("console", io.StringIO()) == "console"
    assert isinstance(handler_for("auto", _Tty()).formatter, ConsoleFormatter)
    assert isinstance(handler_for("auto", io.StringIO()).formatter, JsonFormatter)


def test_setup_and_the_error_line_follow_stderr(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert json.loads(error_line("NATS: gone", "auto")) | {"ts": 0} == {
        "ts": 0,
        "level": "error",
        "logger": "seqstate",
        "msg": "NATS: gone",
    }
    assert error_line("NATS: gone", "console") == "seqstate: error: NATS: gone"
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        setup_logging("info", "auto")
        assert isinstance(root.handlers[0].formatter, JsonFormatter)
        monkeypatch.setattr(sys, "stderr", _Tty())
        setup_logging("debug", "auto")
        assert isinstance(root.handlers[0].formatter, ConsoleFormatter)
        assert root.level == logging.DEBUG
        assert error_line("x", "auto") == "seqstate: error: x"
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
