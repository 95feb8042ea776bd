"""The ``seqstate`` command line's grammar: the settings as flags, the parser, its help.

Each command (:mod:`projector.ops.commands`) takes as flags only the settings it uses (a reader
is not offered the writer's snapshot cadence), naming them with the groups below; every setting
is still read from its environment variable everywhere, and a flag wins over the variable.
Help texts, metavars and defaults come from the fields of
:class:`~projector.settings.config.Config`, so the help cannot drift from what the code reads.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from dataclasses import MISSING, Field, fields
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any, NoReturn

from projector.settings.config import Config, env_name
from projector.settings.logs import add_log_flags
from seqstate import SCHEMA_VERSION

if TYPE_CHECKING:  # a type only: the commands import this module for its groups
    from projector.ops.commands.command import Command

EXIT_USAGE = 2
DESCRIPTION = (
    "A durable, replayable ledger of in-flight LLM requests: run the pipeline,\n"
    "publish events, read the registry, replay the log."
)

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
    "nats_inbox_prefix",
)
NAMES = ("events_stream", "deltas_stream", "registry_bucket", "snapshot_bucket")
# what creating the streams and buckets needs
PROVISION = ("duplicate_window_s", "replicas", "capture_max_bytes", "dead_letter_max_bytes")
DYNAMO = ("dynamo_endpoint",)  # the consumers that provision a Dynamo capture
FOLLOW = ("dynamo_discovery", "dynamo_resync")  # `run`: following the Dynamo fleet
LEASE = ("expiry_scan_s", "dynamo_endpoint")  # a Dynamo-fed namespace expires by its lease
FOLD = (
    "expiry_s",
    *LEASE,
    "forget_lazy_ranks_s",
    "orphan_after_s",
    "rules",
    "worker_grace_s",
    "max_ranks_per_worker",
    "max_ranks",
    "max_event_bytes",
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
    "snapshot_history_every",
    "snapshot_history_keep",
    "retain_events",
)
BEHIND = ("behind_warn_events", "behind_warn_s")  # when a consumer's lag is worth a warning
# what the writer and the projector watch of their lag, and how much of a backlog they hold
LAG = (*BEHIND, "lag_check_s", "consumer_window")
PROJECTOR = ("flush_interval_s",)
METRICS = (
    "metrics_port",
    "metrics_host",
    "ready_lag_events",
    "ready_lag_s",
)  # the long-running consumers'
HTTP = (
    "http_host",
    "http_port",
    "http_max_connections",
    "max_trackers",
    "http_token",
    "http_token_file",
    "event_loop",
)  # serve-http's own port
READ = CONNECT + NAMES  # every command


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


def _add_settings(parser: argparse.ArgumentParser, command: Command) -> None:
    group = parser.add_argument_group("settings (each also read from its environment variable)")
    for f in fields(Config):
        if f.name in command.settings:
            group.add_argument(
                f"--{f.name.replace('_', '-')}",
                dest=f"cfg_{f.name}",
                metavar=f.metadata["metavar"] or "VALUE",
                help=_setting_help(f, command.name),
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


def build_parser(commands: Iterable[Command]) -> argparse.ArgumentParser:
    """The whole grammar: each command's settings first, then the flags it declares."""
    parser = _Parser(prog="seqstate", formatter_class=_Help, description=DESCRIPTION)
    shown = f"seqstate {package_version()} (event schema {SCHEMA_VERSION})"
    parser.add_argument("--version", action="version", version=shown)
    sub = parser.add_subparsers(dest="command", parser_class=_Parser, metavar="COMMAND")
    for command in commands:
        p = sub.add_parser(
            command.name,
            help=command.help,
            description=command.help,
            epilog=command.epilog() if command.epilog else None,
            formatter_class=_Help,
        )
        _add_settings(p, command)
        command.flags(p)
    return parser
