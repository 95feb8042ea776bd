"""Log setup for every ``seqstate`` command: JSON lines for a log pipeline, one readable line
for a person.

``--log-format`` (env ``SEQSTATE_LOG_FORMAT``) chooses: ``json`` writes one JSON object per
record on stderr, ``console`` one text line per record, and ``auto`` (the default) is console
on a terminal and JSON anywhere else (a pipe, a file, a container's log collector), so a
pipeline parses every line without being told to.

A JSON record has ``ts`` (ISO 8601, UTC, milliseconds), ``level``, ``logger`` and ``msg``,
plus the context a caller passed with ``extra={...}``: only the keys in :data:`FIELDS`
(``request_id``, ``worker``, ``dp_rank``, ``stream_seq``, ``router_id``, ``namespace``), so a
stray attribute of a :class:`logging.LogRecord` never leaks into a record; and ``exc``, the
traceback's text, when an exception is attached. A newline inside a message is escaped by
JSON: a record is always exactly one line.

A console line is never wrapped at the terminal's width (a long store path or NATS URL stays
whole, so it can be copied and grepped); its context follows the message as ``key=value``.

The rule for every log call: never log prompt content. Events carry token-block hashes and
counts, not prompts, and even those stay out of the log: a line names a message by its stream
sequence, its request id and worker, and its size in bytes, and never dumps a payload, an
event's or a delta's body, or its block hashes.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any, TextIO

import msgspec

FORMATS = ("auto", "json", "console")
ENV = "SEQSTATE_LOG_FORMAT"
LEVELS = ("debug", "info", "warning", "error")
LEVEL_ENV = "SEQSTATE_LOG_LEVEL"
# The context a record may carry, in the order it is shown; anything else passed in ``extra``
# (or set on the record by logging itself) is never written.
FIELDS = ("request_id", "worker", "dp_rank", "stream_seq", "router_id", "namespace")

_encoder = msgspec.json.Encoder(enc_hook=str)  # an odd value in ``extra`` is shown, not fatal


def _one_of(what: str, flag: str, env: str, options: tuple[str, ...]) -> Callable[[str], str]:
    """A flag's type that names a bad value as typed. Applied to the flag and to the
    variable's value alike: argparse checks no default against ``choices``, so a bad
    ``SEQSTATE_LOG_FORMAT`` or ``SEQSTATE_LOG_LEVEL`` would otherwise pass silently."""

    def check(value: str) -> str:
        if value not in options:
            raise argparse.ArgumentTypeError(
                f"{value!r} is not a {what} (one of {', '.join(options)}; from {flag} or {env})"
            )
        return value

    return check


def add_log_flags(group: argparse._ArgumentGroup) -> None:
    """``--log-level`` and ``--log-format``, offered on every command."""
    for what, env, options, default, says in (
        ("log level", LEVEL_ENV, LEVELS, "info", ""),
        ("log format", ENV, FORMATS, "auto", "auto: console on a terminal, JSON lines elsewhere "),
    ):
        flag = "--" + what.replace(" ", "-")
        group.add_argument(
            flag,
            default=os.environ.get(env, default),
            type=_one_of(what, flag, env, options),
            choices=options,
            metavar="{" + ",".join(options) + "}",
            help=f"{says}(default: {default}) [env {env}]",
        )


def resolve(fmt: str, stream: TextIO | None = None) -> str:
    """``json`` or ``console``: what ``auto`` means for ``stream`` (stderr by default)."""
    if fmt != "auto":
        return fmt
    return "console" if _isatty(sys.stderr if stream is None else stream) else "json"


def context(record: logging.LogRecord) -> dict[str, Any]:
    """The allow-listed context fields the record carries."""
    given = record.__dict__
    return {key: given[key] for key in FIELDS if given.get(key) is not None}


def event_fields(event: object) -> dict[str, Any]:
    """The context an event names (its ids, never its content), for ``extra``."""
    fields: dict[str, Any] = {}
    for name, key in (
        ("request_id", "request_id"),
        ("worker_id", "worker"),
        ("dp_rank", "dp_rank"),
        ("router_id", "router_id"),
    ):
        value = getattr(event, name, None)
        if value is not None and value != "":
            fields[key] = value
    return fields


def iso_ms(at: float) -> str:
    """``2026-12-02T01:41:47.123Z``: what a log pipeline parses as UTC without a guess."""
    return datetime.fromtimestamp(at, tz=UTC).isoformat(timespec="milliseconds")[:-6] + "Z"


def json_line(
    level: str,
    logger: str,
    msg: str,
    fields: Mapping[str, Any] | None = None,
    *,
    at: float | None = None,
) -> str:
    """One JSON record (no newline); also how ``main`` prints its final error."""
    record: dict[str, Any] = {
        "ts": iso_ms(time.time() if at is None else at),
        "level": level,
        "logger": logger,
        "msg": msg,
    }
    if fields:
        record.update(fields)
    return _encoder.encode(record).decode()


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line."""

    def format(self, record: logging.LogRecord) -> str:
        fields = context(record)
        if record.exc_info:
            record.exc_text = record.exc_text or self.formatException(record.exc_info)
        if record.exc_text:
            fields["exc"] = record.exc_text
        if record.stack_info:
            stack = self.formatStack(record.stack_info)
            fields["exc"] = f"{fields['exc']}\n{stack}" if "exc" in fields else stack
        return json_line(
            record.levelname.lower(), record.name, record.getMessage(), fields, at=record.created
        )


_COLOURS = {
    "DEBUG": "\x1b[2m",
    "INFO": "\x1b[36m",
    "WARNING": "\x1b[33m",
    "ERROR": "\x1b[31m",
    "CRITICAL": "\x1b[1;31m",
}
_RESET = "\x1b[0m"


class ConsoleFormatter(logging.Formatter):
    """``time LEVEL logger: message key=value ...``, one line, whatever the terminal's width.

    Written here rather than rich's RichHandler, which lays a record out in columns at the
    console's width and so wraps a long path or URL across lines (and pads every line).
    """

    def __init__(self, *, colour: bool, short_time: bool) -> None:
        super().__init__(datefmt="%H:%M:%S" if short_time else None)
        self.colour = colour

    def format(self, record: logging.LogRecord) -> str:
        level = record.levelname
        shown = f"{level:<7}"
        if self.colour:
            shown = f"{_COLOURS.get(level, '')}{shown}{_RESET}"
        line = f"{self.formatTime(record, self.datefmt)} {shown} {record.name}: "
        line += record.getMessage()
        fields = context(record)
        if fields:
            line += "  " + " ".join(f"{k}={v}" for k, v in fields.items())
        if record.exc_info:
            record.exc_text = record.exc_text or self.formatException(record.exc_info)
        if record.exc_text:
            line += "\n" + record.exc_text
        if record.stack_info:
            line += "\n" + self.formatStack(record.stack_info)
        return line


def handler_for(fmt: str, stream: TextIO | None = None) -> logging.Handler:
    """A handler writing ``fmt`` (auto, json or console) to ``stream`` (stderr by default)."""
    stream = sys.stderr if stream is None else stream
    handler = logging.StreamHandler(stream)
    if resolve(fmt, stream) == "json":
        handler.setFormatter(JsonFormatter())
    else:
        tty = _isatty(stream)
        handler.setFormatter(
            ConsoleFormatter(colour=tty and "NO_COLOR" not in os.environ, short_time=tty)
        )
    return handler


def _isatty(stream: TextIO) -> bool:
    """A closed or odd stream is no terminal."""
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def setup_logging(level: str, fmt: str = "auto") -> None:
    """The root logger at ``level``, writing ``fmt`` to stderr (replacing any earlier setup)."""
    logging.basicConfig(level=level.upper(), handlers=[handler_for(fmt)], force=True)


def error_line(message: str, fmt: str) -> str:
    """The final ``seqstate: error: ...`` line, as a JSON record when the logs are JSON."""
    if resolve(fmt) == "json":
        return json_line("error", "seqstate", message)
    return f"seqstate: error: {message}"


class Quiet:
    """When to log an event that may come by the thousand (a dead letter, a refused
    connection): the first at once, those within ``every_s`` of the last line held, and one
    line for them at the interval's end (:meth:`flush` says it earlier, at a stop); a quiet
    interval later, the next is said at once again. The caller says the lines and counts what
    is held: ``say_held(seconds)`` is called with the time the held ones span."""

    def __init__(self, every_s: float, say_held: Callable[[float], None]) -> None:
        self.every_s = every_s
        self._say_held = say_held
        self.holding = False
        self._since = 0.0  # when the interval of the held ones began
        self._quiet_until = 0.0  # loop time
        self._timer: asyncio.TimerHandle | None = None

    def now(self) -> bool:
        """One more: True if the caller says it now; False if it is held (and counted)."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        if now >= self._quiet_until and not self.holding:
            self._since, self._quiet_until = now, now + self.every_s
            return True
        self.holding = True
        if self._timer is None:
            self._timer = loop.call_at(self._quiet_until, self.flush)
        return False

    def flush(self) -> None:
        """Say the held ones now, if any."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self.holding:
            return
        now = asyncio.get_running_loop().time()
        self.holding = False
        self._say_held(now - self._since)
        self._since, self._quiet_until = now, now + self.every_s
