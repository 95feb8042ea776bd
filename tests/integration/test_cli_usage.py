"""The ``seqstate`` command line as an operator types it, before anything runs: a bad flag or
setting, a missing file, a server that is not there or never answers, each in one line; the
help in the user's words, and the version."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from cli_kit import one_line_error
from pipeline_kit import seqstate


def test_bad_flag_is_one_line_and_exit_2() -> None:
    result = seqstate("run", "--no-such-flag")
    assert result.returncode == 2
    assert "--no-such-flag" in one_line_error(result)


def test_missing_trace_is_one_line() -> None:
    line = one_line_error(seqstate("run", "--demo", "--trace", "/nonexistent/trace.jsonl"))
    assert "/nonexistent/trace.jsonl" in line


def test_unreachable_nats_is_one_line() -> None:
    line = one_line_error(seqstate("loads", NATS_URL="nats://127.0.0.1:1"))
    assert "cannot reach NATS at nats://127.0.0.1:1" in line


@pytest.mark.parametrize(
    ("args", "env", "said"),
    [
        (
            ("projector", "--flush-interval-s", "soon"),
            {},
            "--flush-interval-s 'soon': not a number (seconds)",
        ),
        (
            ("writer", "--expiry-s", "banana"),
            {},
            "--expiry-s 'banana': not a number (seconds, or 'off')",
        ),
        (("run", "--flush-interval-s", "-1"), {}, "--flush-interval-s '-1': must be positive"),
        (
            ("writer",),
            {"SEQSTATE_EXPIRY_S": "banana"},
            "SEQSTATE_EXPIRY_S='banana': not a number (seconds, or 'off')",
        ),
        (("loads",), {"NATS_URL": "garbage"}, "NATS_URL='garbage': 'garbage' is not a NATS URL"),
        (
            ("status", "--nats-url", "http://x:1"),
            {},
            "--nats-url 'http://x:1': 'http://x:1' is not a NATS URL",
        ),
    ],
)
def test_a_bad_setting_is_one_line_naming_it_as_typed(
    args: tuple[str, ...], env: dict[str, str], said: str
) -> None:
    assert one_line_error(seqstate(*args, **env)).startswith(f"seqstate: error: {said}")


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (("demo", "--speedup", "0"), "--speedup 0: must be a positive number"),
        (("demo", "--speedup", "-2"), "--speedup -2: must be a positive number"),
        (("demo", "--speedup", "nan"), "--speedup nan: must be a positive number"),
        (("demo", "--rate", "0"), "--rate 0: must be a positive number"),
        (("demo", "--workers", "0"), "--workers 0: must be at least 1"),
        (("run", "--demo", "--speedup", "0"), "--speedup 0: must be a positive number"),
        (("run", "--port", "-3"), "--port -3: must be a port (1-65535), or 0 for any free port"),
        (
            ("run", "--port", "70000"),
            "--port 70000: must be a port (1-65535), or 0 for any free port",
        ),
    ],
)
def test_a_bad_demo_or_port_number_is_one_line_before_anything_starts(
    args: tuple[str, ...], said: str, tmp_path: Path
) -> None:
    # --speedup 0 divided the arrival rate by zero once the run was up: a traceback.
    # run: its embedded server, in a store of its own; demo: a server that is not there.
    where = {} if args[0] == "run" else {"NATS_URL": "nats://127.0.0.1:1"}
    store = ("--store-dir", str(tmp_path / "store")) if args[0] == "run" else ()
    result = seqstate(*args, *store, "--duration", "5", timeout=30, **where)
    assert one_line_error(result) == f"seqstate: error: {said}"
    assert not (tmp_path / "store").exists()  # refused before a server was started


def test_help_speaks_the_users_language() -> None:
    helps = {
        name: seqstate(name, "--help").stdout
        for name in (
            "run",
            "writer",
            "projector",
            "demo",
            "publish",
            "loads",
            "watch",
            "status",
            "replay",
            "rebuild",
            "snapshot",
            "report",
            "inspect",
            "top",
        )
    }
    top = seqstate("--help").stdout
    helps = {name: " ".join(text.split()) for name, text in helps.items()}  # unwrapped
    for name, text in [*helps.items(), ("", top)]:
        assert "``" not in text and ":class:" not in text, name  # no markup leaks
        assert "-durable" not in text, name  # settings that nothing read are gone
        shown = text.replace("[env SEQSTATE_", "").replace("SEQSTATE_EVENTS", "")
        shown = shown.replace("_SEQSTATE_INBOX", "")  # the inbox prefix's default, a subject
        assert "SEQSTATE_" not in shown.replace("SEQSTATE_DELTAS", ""), name  # not as metavars
    assert "unset: start an embedded nats-server" in helps["run"]
    for name in ("loads", "status", "publish", "writer"):
        assert "embedded" not in helps[name], name
        assert "--nats-url URL" in helps[name]
    readers = ("loads", "watch", "status", "publish", "replay", "inspect", "top")
    for name in readers:  # readers: no writer knobs
        for knob in ("--flush-interval-s", "--snapshot-every-events", "--idle-tick-s"):
            assert knob not in helps[name], (name, knob)
    writer = helps["writer"]
    assert "(default: 300) [env SEQSTATE_EXPIRY_S]" in writer
    assert "(default: 10000) [env SEQSTATE_SNAPSHOT_EVERY_EVENTS]" in writer
    publish = helps["publish"]
    for event in (
        "AddRequest",
        "MarkPrefillCompleted",
        "Free",
        "AddOutputBlock",
        "WorkerAdded",
        "WorkerRemoved",
        "Tick",
    ):
        assert f"{event}:" in publish
    assert "request_id, worker_id, dp_rank=0, block_hashes=[], prefill_tokens=0," in publish
    assert "(default: 4222) [env SEQSTATE_PORT]" in helps["run"]


def test_version_is_the_package_version() -> None:
    from importlib.metadata import version

    result = seqstate("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"seqstate {version('seqstate')} (event schema 1)"


def test_a_server_that_never_answers_fails_in_one_line_within_seconds() -> None:
    # A host that accepts and then says nothing (no INFO): a one-shot command gives up after
    # one attempt and a little, instead of retrying for about 14 s as it did.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        url = f"nats://127.0.0.1:{silent.getsockname()[1]}"
        line = one_line_error(seqstate("status", NATS_URL=url, timeout=30))
    assert line == f"seqstate: error: cannot reach NATS at {url}: no answer in time"
