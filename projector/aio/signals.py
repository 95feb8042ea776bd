"""An event loop run to its end without a late signal turning into a traceback or a kill.

A process stopped by Ctrl-C is often signalled twice: the terminal's SIGINT reaches its whole
foreground group, and whoever started it (a demo, a supervisor) sends SIGTERM as well. When the
second arrives while the loop is closing, asyncio fails in either of two ways: ``close()`` shuts
the socket its signals wake it through before it takes its handlers off (the signal is then
reported on stderr as "Exception ignored when trying to write to the signal wakeup fd", with a
traceback), and taking them off restores Python's defaults (a KeyboardInterrupt in the middle of
the clean-up, or death by SIGTERM). By then the command has finished and has nothing left to
stop, so the loop's handlers are taken off while it is still open and the signals ignored until
it is closed; the process's own handlers are then put back.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

STOPPING = (signal.SIGINT, signal.SIGTERM)


def run(
    main: Coroutine[Any, Any, T],
    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None,
) -> T:
    """``asyncio.run(main)``, with the loop's SIGINT/SIGTERM handlers released before it closes."""
    before = {sig: signal.getsignal(sig) for sig in STOPPING}
    try:
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            try:
                return runner.run(main)
            finally:
                _release(runner.get_loop())
    finally:
        for sig, handler in before.items():
            # Only what changed (in a thread other than the main one, nothing can have):
            # None was set outside Python, and cannot be put back from it.
            if handler is not None and signal.getsignal(sig) is not handler:
                signal.signal(sig, handler)


def _release(loop: asyncio.AbstractEventLoop) -> None:
    for sig in STOPPING:
        if loop.remove_signal_handler(sig):
            signal.signal(sig, signal.SIG_IGN)
