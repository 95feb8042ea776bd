"""The shape of a ``seqstate`` subcommand: its name and help, the flags it takes, its body.

A command declares its own grammar next to its body, so adding one is a module and a line in
:data:`projector.ops.commands.COMMANDS`; the parser and the dispatch are loops over that list.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from projector.settings.config import Config
from seqstate import SeqstateError

Body = Callable[[argparse.Namespace, Config], Coroutine[Any, Any, int]]
Flags = Callable[[argparse.ArgumentParser], None]


class CliError(SeqstateError):
    """An error worth one line to the operator; the message is that line."""


def no_flags(parser: argparse.ArgumentParser) -> None:
    """For a command whose settings are all it takes."""


@dataclass(frozen=True)
class Command:
    """One subcommand.

    ``settings`` names the :class:`~projector.settings.config.Config` fields offered as flags: only
    those the command reads, so a reader is not offered the writer's snapshot cadence (every
    setting is still read from its environment variable). ``epilog`` is a function so that a
    costly one (``publish``'s event reference) is built only with the parser.
    """

    name: str
    help: str
    run: Body
    settings: tuple[str, ...]
    flags: Flags = no_flags
    epilog: Callable[[], str] | None = None
