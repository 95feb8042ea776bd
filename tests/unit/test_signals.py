"""A command's loop ends quietly when a second stop signal arrives while it closes.

The race is made certain rather than hoped for: the loop signals its own process at the moment
asyncio has shut the socket its signals wake it through and has not yet taken its handlers off.
That runs in a child process, so that the signals are its own and not pytest's.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import textwrap
import threading

import pytest

from projector.aio import signals

LATE_SIGNALS = textwrap.dedent(
    """
    import asyncio, os, signal, sys
    from projector.aio import signals

    class LateSignals(asyncio.SelectorEventLoop):
        def _close_self_pipe(self):
            super()._close_self_pipe()
            for sig in (signal.SIGINT, signal.SIGTERM):
                os.kill(os.getpid(), sig)

    async def command():
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        os.kill(os.getpid(), signal.SIGINT)  # the terminal's Ctrl-C
        await stop.wait()
        return 0

    code = signals.run(command(), loop_factory=LateSignals)
    print("stopped", flush=True)
    sys.exit(code)
    """
)


def test_a_signal_while_the_loop_closes_is_neither_a_traceback_nor_a_kill() -> None:
    done = subprocess.run(
        [sys.executable, "-c", LATE_SIGNALS], capture_output=True, text=True, timeout=60
    )
    assert (done.returncode, done.stdout, done.stderr) == (0, "stopped\n", "")


def test_the_process_handlers_are_back_once_the_loop_is_closed() -> None:
    before = {sig: signal.getsignal(sig) for sig in signals.STOPPING}

    async def command() -> str:
        loop = asyncio.get_running_loop()
        for sig in signals.STOPPING:
            loop.add_signal_handler(sig, lambda: None)
        return "done"

    assert signals.run(command()) == "done"
    assert {sig: signal.getsignal(sig) for sig in signals.STOPPING} == before


def test_a_command_that_fails_still_gives_the_handlers_back() -> None:
    before = {sig: signal.getsignal(sig) for sig in signals.STOPPING}

    async def command() -> None:
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, lambda: None)
        raise LookupError("the command's own failure")

    with pytest.raises(LookupError, match="the command's own failure"):
        signals.run(command())
    assert {sig: signal.getsignal(sig) for sig in signals.STOPPING} == before


def test_a_loop_run_in_another_thread_leaves_signals_alone() -> None:
    """Only the main thread may set handlers: a command run from a thread never tries to."""
    before = {sig: signal.getsignal(sig) for sig in signals.STOPPING}

    async def command() -> str:
        return "done"

    done: list[str] = []
    worker = threading.Thread(target=lambda: done.append(signals.run(command())))
    worker.start()
    worker.join(30)
    assert done == ["done"]
    assert {sig: signal.getsignal(sig) for sig in signals.STOPPING} == before
