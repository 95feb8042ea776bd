"""How a failed NATS request reads in a log line: a full disk is named, never
``ServiceUnavailableError()`` (no server: the errors are built as nats-py builds them)."""

from __future__ import annotations

import logging

import nats.errors
import nats.js.errors
import pytest

from projector.nats.failures import describe, storage_full
from projector.nats.retry import retrying


def from_server(code: int, err_code: int, description: str) -> nats.js.errors.APIError:
    """The error nats-py raises for a JetStream API error answer (its ``from_error``)."""
    try:
        nats.js.errors.APIError.from_error(
            {"code": code, "err_code": err_code, "description": description}
        )
    except nats.js.errors.APIError as exc:
        return exc
    raise AssertionError("nats-py raised nothing for an error answer")


FULL = from_server(503, 10023, "insufficient resources")


def test_a_full_disk_was_nameless() -> None:
    # What the writer logged for as long as it retried: no word of storage.
    assert isinstance(FULL, nats.js.errors.ServiceUnavailableError)
    assert repr(FULL) == "ServiceUnavailableError()"


@pytest.mark.parametrize(
    ("error", "said"),
    [
        (FULL, "JetStream storage is full: insufficient resources (JetStream error 10023)"),
        (
            from_server(500, 10047, "insufficient storage resources available"),
            "JetStream storage is full: insufficient storage resources available (JetStream "
            "error 10047)",
        ),
        (
            from_server(400, 10002, "resource limits exceeded for account"),
            "JetStream storage is full: resource limits exceeded for account (JetStream "
            "error 10002)",
        ),
        (
            from_server(503, 10077, "maximum messages exceeded"),
            "the stream is full: maximum messages exceeded (JetStream error 10077)",
        ),
        (from_server(404, 10059, "stream not found"), "stream not found (JetStream error 10059)"),
        (nats.errors.TimeoutError(), "no answer in time"),
        (TimeoutError(), "no answer in time"),
        (
            nats.errors.NoRespondersError(),
            "NoRespondersError: nats: no responders available for request",
        ),
        (OSError("broken pipe"), "OSError: broken pipe"),
        (ValueError(), "ValueError"),
    ],
)
def test_describe_names_what_the_server_said(error: BaseException, said: str) -> None:
    assert describe(error) == said
    assert storage_full(error) == said.startswith("JetStream storage is full")


async def test_a_retried_request_names_the_full_disk_in_its_log_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    calls = 0

    async def refused() -> None:
        nonlocal calls
        calls += 1
        raise FULL

    with caplog.at_level(logging.WARNING, "seqstate"), pytest.raises(nats.js.errors.APIError):
        await retrying(refused, "a put", retry_for_s=0.05)
    said = [r.getMessage() for r in caplog.records]
    assert calls >= 2 and said, said
    assert said[0] == (
        "a put failed, retrying in 0.05s: JetStream storage is full: insufficient resources "
        "(JetStream error 10023)"
    )
