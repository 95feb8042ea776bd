"""The ``seqstate`` command line's grammar: commands, their flags, their help.

Each command takes as flags only the settings it uses (a reader is not offered the writer's
snapshot cadence); every setting is still read from its environment variable everywhere, and a
flag wins over the variable. Help texts, metavars and defaults come from the fields of
:class:`~projector.wire.config.Config`, so the help cannot drift from what the code reads.
"""

from __future__ import annotations

import argparse
import os
import textwrap
from dataclasses import MISSING, Field, fields
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, NoReturn

import msgspec

from projector.nats.logs import add_log_flags
from projector.wire.config import Config, env_name
from seqstate import SCHEMA_VERSION
from seqstate.events import Event

EXIT_USAGE = 2
DEFAULT_STORE_DIR = ".seqstate/jetstream"
DESCRIPTION = (
    "A durable, replayable ledger of in-flight LLM requests: run the pipeline,\n"
    "publish events, read the registry, replay the log."
)
DEFAULT_PORT = 4222  # the NATS convention, so nats://127.0.0.1:4222 works across restarts

CONNECT = (
    "nats_url",
    "namespace",
    "tls_ca",
    "tls_cert",
    "tls_key",
    "nats_user",
    "nats_password",
    "nats_token",
    "nats_nkey_seed",
    "nats_creds",
)
NAMES = ("events_stream", "deltas_stream", "registry_bucket", "snapshot_bucket")
PROVISION = ("duplicate_window_s", "replicas")  # what creating the streams and buckets needs
FOLD = (
    "expiry_s",
    "forget_lazy_ranks_s",
    "orphan_after_s",
    "rules",
    "worker_grace_s",
    "max_ranks_per_worker",
    "max_ranks",
    "max_tombstones",
    "max_ended",
)  # every fold
WRITER = (
    *FOLD,
    "idle_tick_s",
    "tick_every_s",
    "snapshot_every_events",
    "snapshot_every_s",
    "snapshots_keep",
    "retain_events",
)
BEHIND = ("behind_warn_events", "behind_warn_s")  # when a consumer's lag is worth a warning
LAG = (*BEHIND, "lag_check_s")  # what the writer and the projector watch of their lag
PROJECTOR = ("flush_interval_s",)
METRICS = ("metrics_port", "metrics_host", "ready_lag_events")  # the long-running consumers'
READ = CONNECT + NAMES
SETTINGS: dict[str, tuple[str, ...]] = {
    "run": READ + PROVISION + WRITER + PROJECTOR + LAG + METRICS,
    "writer": READ + PROVISION + WRITER + LAG + METRICS,
    "projector": READ + PROVISION + PROJECTOR + LAG + METRICS,
    "demo": READ + PROVISION,
    "publish": READ + PROVISION,
    "loads": READ,
    "watch": READ,
    "inspect": READ,
    "top": READ,
    "status": READ + BEHIND,
    "replay": (*READ, *FOLD),
    "rebuild": (*READ, *PROVISION, *FOLD),
    "snapshot": (*READ, *PROVISION, *FOLD, "snapshots_keep"),
    "worker": (*READ, *PROVISION, "max_ranks_per_worker"),
    # The rules are the slot tracker's, always; a grace has no place there.
    "serve-http": (
        *READ,
        *PROVISION,
        *(s for s in WRITER if s not in ("rules", "worker_grace_s")),
        *PROJECTOR,
        *METRICS,
    ),
}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _Help(argparse.RawDescriptionHelpFormatter):
    """Descriptions and epilogs keep their line breaks (the event list of ``publish``)."""


def package_version() -> str:
    try:
        return version("seqstate")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


def _shown(value: object) -> str:
    if value is None:
        return "off"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _setting_help(f: Field[Any], command: str) -> str:
    text = f.metadata["help"]
    if f.name == "nats_url":
        text += "; unset: start an embedded nats-server" if command == "run" else "; required"
    elif f.default is not MISSING and not (
        f.default is None and f.metadata["metavar"] in ("PATH", "USER", "SECRET")
    ):
        text += f" (default: {_shown(f.default)})"
    return f"{text} [env {env_name(f.name)}]"


def _add_settings(parser: argparse.ArgumentParser, command: str) -> None:
    group = parser.add_argument_group("settings (each also read from its environment variable)")
    wanted = SETTINGS[command]
    for f in fields(Config):
        if f.name in wanted:
            group.add_argument(
                f"--{f.name.replace('_', '-')}",
                dest=f"cfg_{f.name}",
                metavar=f.metadata["metavar"] or "VALUE",
                help=_setting_help(f, command),
            )
    add_log_flags(group)


def config_from(args: argparse.Namespace) -> Config:
    """The settings: defaults, then the environment, then this command's flags."""
    given = {}
    for f in fields(Config):
        raw = getattr(args, f"cfg_{f.name}", None)
        if raw is not None:
            given[f.name] = (f"--{f.name.replace('_', '-')}", raw)
    return Config.from_env(flags=given)


def _add_demo_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("demo router")
    group.add_argument(
        "--workers", type=int, default=8, metavar="N", help="workers to drive (default: 8)"
    )
    group.add_argument(
        "--dp-size",
        type=int,
        default=1,
        metavar="N",
        help="data-parallel ranks per worker (default: 1)",
    )
    group.add_argument(
        "--trace", type=Path, metavar="PATH", help="replay a Mooncake-format JSONL trace"
    )
    group.add_argument(
        "--speedup",
        type=float,
        metavar="X",
        help="time compression (default: 10 for a trace, 1 otherwise)",
    )
    group.add_argument(
        "--rate",
        type=float,
        default=40.0,
        metavar="PER_S",
        help="synthetic arrivals per second (default: 40)",
    )
    group.add_argument(
        "--seed", type=int, default=0, metavar="N", help="synthetic workload seed (default: 0)"
    )
    group.add_argument(
        "--duration",
        type=float,
        metavar="SECONDS",
        help="stop after this many seconds (default: run until Ctrl-C)",
    )
    group.add_argument("--no-live", action="store_true", help="no live table; a line per second")


def event_reference() -> str:
    """Every event type and its fields, from the schema itself (for ``publish --help``)."""
    lines = [
        'events: one JSON object per line, "type" naming the event; fields with "=" are',
        "optional (their default shown):",
        "",
    ]
    for kind in Event.__args__:
        parts = []
        for info in msgspec.structs.fields(kind):
            if info.required:
                parts.append(info.name)
            else:
                default = info.default if info.default is not msgspec.NODEFAULT else []
                parts.append(f"{info.name}={msgspec.json.encode(default).decode()}")
        text = f"{kind.__name__}: {', '.join(parts) or '(no fields)'}"
        lines += textwrap.wrap(text, 78, initial_indent="  ", subsequent_indent="      ")
    lines += [
        "",
        "example:",
        '  {"type": "AddRequest", "request_id": "r1", "worker_id": 3,',
        '   "block_hashes": [11, 12], "prefill_tokens": 1200}',
        '  {"type": "Free", "request_id": "r1", "worker_id": 3}',
    ]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="seqstate", formatter_class=_Help, description=DESCRIPTION)
    shown = f"seqstate {package_version()} (event schema {SCHEMA_VERSION})"
    parser.add_argument("--version", action="version", version=shown)
    sub = parser.add_subparsers(dest="command", parser_class=_Parser, metavar="COMMAND")

    def command(name: str, text: str, epilog: str | None = None) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=text, description=text, epilog=epilog, formatter_class=_Help)
        _add_settings(p, name)
        return p

    run = command(
        "run", "writer + projector in one process; an embedded nats-server unless NATS_URL is set"
    )
    run.add_argument(
        "--store-dir",
        type=Path,
        metavar="PATH",
        default=Path(os.environ.get("SEQSTATE_STORE_DIR", DEFAULT_STORE_DIR)),
        help=f"the embedded server's JetStream directory (default: "
        f"{DEFAULT_STORE_DIR}) [env SEQSTATE_STORE_DIR]",
    )
    run.add_argument(
        "--port",
        type=int,
        metavar="N",
        default=int(os.environ.get("SEQSTATE_PORT", DEFAULT_PORT)),
        help=f"the embedded server's client port; a free one if it is taken "
        f"(default: {DEFAULT_PORT}) [env SEQSTATE_PORT]",
    )
    run.add_argument("--demo", action="store_true", help="also run the demo router + live view")
    _add_demo_flags(run)
    command("writer", "the write-model consumer: SEQSTATE_EVENTS to SEQSTATE_DELTAS")
    command("projector", "the read-model consumer: SEQSTATE_DELTAS to the registry bucket")
    demo = command("demo", "the demo router alone, against a running pipeline")
    _add_demo_flags(demo)
    publish = command(
        "publish",
        "publish events given as JSON lines (a file, or - for stdin)",
        epilog=event_reference(),
    )
    publish.add_argument(
        "file", nargs="?", default="-", metavar="FILE", help="JSON lines (default: - reads stdin)"
    )
    publish.add_argument(
        "--router-id",
        default=f"cli-{os.getpid()}",
        metavar="ID",
        help="msg-id prefix, unique per publisher (default: cli-PID)",
    )
    loads = command("loads", "print every rank's load from the registry bucket")
    loads.add_argument("--json", action="store_true", help="JSON lines instead of a table")
    watch = command("watch", "a live table of the registry bucket")
    watch.add_argument(
        "--duration", type=float, metavar="SECONDS", help="stop after this many seconds"
    )
    watch.add_argument(
        "--json", action="store_true", help="one JSON object per changed rank, as it changes"
    )
    inspect = command(
        "inspect",
        "one request's owner, state and events; one worker's ranks",
        epilog="examples:\n  seqstate inspect request req-1\n"
        "  seqstate inspect request req-1 --since-seq 1   # the whole log\n"
        "  seqstate inspect worker 3 --json",
    )
    inspect.add_argument("what", choices=["request", "worker"])
    inspect.add_argument("id", metavar="ID", help="a request id, or a worker id")
    inspect.add_argument(
        "--since-seq",
        type=int,
        metavar="N",
        help="for a request not in the bucket: look for its events from "
        "event N on (default: the newest --window events)",
    )
    inspect.add_argument(
        "--window",
        type=int,
        default=100_000,
        metavar="N",
        help="for a request not in the bucket: how many of the newest events "
        "to look through (default: 100000)",
    )
    inspect.add_argument("--json", action="store_true", help="one JSON object")
    inspect.add_argument("--no-progress", action="store_true", help="no progress bar")
    top = command("top", "a live table of workers with their add and free rates")
    top.add_argument(
        "--interval",
        type=float,
        default=1.0,
        metavar="SECONDS",
        help="seconds between refreshes; the rates are over this (default: 1)",
    )
    top.add_argument(
        "--once", action="store_true", help="print one table (rates over one interval) and exit"
    )
    top.add_argument("--json", action="store_true", help="JSON lines, one per worker")
    top.add_argument(
        "--duration", type=float, metavar="SECONDS", help="stop after this many seconds"
    )
    status = command("status", "streams, consumers, the bucket's position and the lag")
    status.add_argument("--json", action="store_true", help="one JSON object")
    replay = command("replay", "fold the log into a fresh state and print per-rank loads")
    replay.add_argument(
        "--from-seq",
        type=int,
        metavar="N",
        help="start from an empty state at event N (a partial replay)",
    )
    replay.add_argument("--to-seq", type=int, metavar="M", help="stop after event M")
    replay.add_argument(
        "--at",
        metavar="TIME",
        help="the state at a log time: ISO 8601 (UTC unless it says), or a "
        "time of day HH:MM[:SS] in UTC on the log's newest day (the day "
        "before if that is after the log's newest event)",
    )
    replay.add_argument("--json", action="store_true", help="JSON lines instead of a table")
    replay.add_argument(
        "--verify",
        action="store_true",
        help="compare with the bucket; exit 1 naming differing keys",
    )
    replay.add_argument("--no-progress", action="store_true", help="no progress bar")
    rebuild = command("rebuild", "re-derive the whole bucket from the write model")
    rebuild.add_argument("--no-progress", action="store_true", help="no progress bar")
    snapshot = command("snapshot", "write-model snapshots: list, show, save")
    snapshot.add_argument("action", choices=["list", "show", "save"])
    snapshot.add_argument(
        "name",
        nargs="?",
        default="latest",
        metavar="NAME",
        help="for show: a snapshot name (default: latest)",
    )
    snapshot.add_argument("--json", action="store_true", help="machine-readable output")
    snapshot.add_argument("--no-progress", action="store_true", help="no progress bar")
    worker = command(
        "worker",
        "the control plane: add, remove or list workers",
        epilog="examples:\n  seqstate worker add 7 --dp-size 2\n"
        "  seqstate worker remove 7\n  seqstate worker list",
    )
    worker.add_argument("action", choices=["add", "remove", "list"])
    worker.add_argument(
        "worker_id",
        nargs="?",
        type=int,
        metavar="WORKER_ID",
        help="for add and remove: the worker's id",
    )
    worker.add_argument(
        "--dp-start",
        type=int,
        default=0,
        metavar="N",
        help="for add: its first data-parallel rank (default: 0)",
    )
    worker.add_argument(
        "--dp-size",
        type=int,
        default=1,
        metavar="N",
        help="for add: how many data-parallel ranks (default: 1)",
    )
    worker.add_argument(
        "--wait",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="wait this long for the registry to show the change; 0: do not wait (default: 10)",
    )
    worker.add_argument("--json", action="store_true", help="for list: JSON lines")
    serve_http = command(
        "serve-http",
        "Dynamo's standalone slot-tracker HTTP API, durable: "
        "each (model_name, routing_group) a namespace of the ledger",
    )
    serve_http.add_argument(
        "--host",
        default=os.environ.get("SEQSTATE_HTTP_HOST", "0.0.0.0"),
        help="the address to listen on (default: 0.0.0.0, as Dynamo's) [env SEQSTATE_HTTP_HOST]",
    )
    serve_http.add_argument(
        "--port",
        type=int,
        metavar="N",
        default=int(os.environ.get("SEQSTATE_HTTP_PORT", "8091")),
        help="the port (default: 8091, as Dynamo's) [env SEQSTATE_HTTP_PORT]",
    )
    return parser
