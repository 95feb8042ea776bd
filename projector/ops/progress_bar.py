"""The progress bar of long commands (replay, rebuild, snapshot save): events/s and ETA.

It is on by default, so it must render from its first frame, when rich has no speed to show
yet. In a terminal it is a rich bar; when stderr is a pipe or a file, where a bar cannot
redraw, it is a plain line at most every ``PLAIN_EVERY_S`` seconds (none for a short run), so a
log never fills with frames or blank lines. The tests run these commands with it on, under a
pseudo-terminal and with stderr a pipe.
"""

from __future__ import annotations

import contextlib
import sys
import time
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
PLAIN_EVERY_S = 5.0


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
    console = Console(stderr=True)
    if not console.is_terminal:
        yield _plain(what)
        return
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TaskProgressColumn(),
        Rate(),
        TimeRemainingColumn(),
    )
    # Results go to stdout while the bar is up (replay --verify prints its diffs): rich would
    # redirect them to the bar's console, stderr, by default.
    with Progress(
        *columns, console=console, transient=True, redirect_stdout=False, redirect_stderr=False
    ) as bar:
        task = bar.add_task(what, total=None)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        yield update


def _plain(what: str) -> Update:
    started = last = time.monotonic()

    def update(done: int, total: int) -> None:
        nonlocal last
        now = time.monotonic()
        if now - last < PLAIN_EVERY_S or done >= total:
            return
        last = now
        rate = done / (now - started)
        print(
            f"{what}: {done:,} of {total:,} events ({done / total:.0%}), {rate:,.0f} events/s",
            file=sys.stderr,
            flush=True,
        )

    return update
