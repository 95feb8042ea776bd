"""The progress bar of long commands (replay, rebuild, snapshot save): events/s and ETA.

It is on by default, in a terminal or not, so it must render from its first frame, when rich
has no speed to show yet; the tests run these commands with it on, under a pseudo-terminal and
with stderr a pipe.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TaskProgressColumn,
    TextColumn,
    TimeRemainingColumn,
)
from rich.text import Text

Update = Callable[[int, int], None]  # (events done, events in all)


class Rate(ProgressColumn):
    """Events per second; a dash until rich has the two samples a speed needs."""

    def render(self, task: Task) -> Text:
        speed = task.finished_speed or task.speed
        shown = "-" if speed is None else f"{speed:,.0f}"
        return Text(f"{shown:>9} events/s")


@contextlib.contextmanager
def progress_bar(enabled: bool, what: str) -> Iterator[Update | None]:
    """A rich progress bar on stderr; None when disabled."""
    if not enabled:
        yield None
        return
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TaskProgressColumn(), Rate(), TimeRemainingColumn())  # fmt: skip
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(what, total=None)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        yield update
