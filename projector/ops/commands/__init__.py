"""Every ``seqstate`` subcommand, a module per command or small family of commands.

:data:`COMMANDS` is the one list the parser and the dispatch loop over; its order is the
order ``seqstate --help`` lists them in.
"""

from __future__ import annotations

from projector.ops.commands.command import CliError, Command
from projector.ops.commands.dynamo import DYNAMO
from projector.ops.commands.inspecting import INSPECT
from projector.ops.commands.loads import LOADS, WATCH
from projector.ops.commands.pipeline import DEMO, PROJECTOR, RUN, WRITER
from projector.ops.commands.publish import PUBLISH
from projector.ops.commands.replay import REBUILD, REPLAY, SNAPSHOT
from projector.ops.commands.report import REPORT
from projector.ops.commands.serve_http import SERVE_HTTP
from projector.ops.commands.status import STATUS
from projector.ops.commands.top import TOP
from projector.ops.commands.worker import WORKER

COMMANDS: list[Command] = [
    RUN,
    WRITER,
    PROJECTOR,
    DEMO,
    PUBLISH,
    LOADS,
    WATCH,
    INSPECT,
    TOP,
    STATUS,
    REPLAY,
    REBUILD,
    SNAPSHOT,
    REPORT,
    WORKER,
    SERVE_HTTP,
    DYNAMO,
]

__all__ = ["COMMANDS", "CliError", "Command"]
