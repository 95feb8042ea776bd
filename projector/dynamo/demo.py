"""``make dynamo-demo``: a small CPU Dynamo fleet, seqstate following it, and its live view.

What an operator's recipe (docs/dynamo.md) sets up, on loopback, in one command:

- a nats-server with JetStream (Dynamo's NATS: seqstate's capture stream needs JetStream);
- a Dynamo 1.6.1 fleet (:mod:`projector.dynamo.fleet`, from its own venv): two mocker workers,
  one with ``--data-parallel-size 2``, and two KV-router frontends with ``--router-mode kv
  --router-replica-sync --event-plane nats``, on file discovery (or an etcd of its own);
- ``seqstate run --dynamo-endpoint dynamo.backend.generate`` with the fleet's discovery in its
  environment, started before any Dynamo process, so that nothing the fleet publishes is lost;
- a load generator: a few streaming chat requests at a time, through both frontends;
- ``seqstate top`` in the foreground: the live view (a table in a terminal, a table a second when
  piped).

Ctrl-C stops it all, in order (the load, so that every request is freed; the frontends, the
workers, seqstate, nats-server), removes the temporary directory and exits 0. Any process that
exits on its own stops it all too, with one line saying which and its last log line, and exit 1
(the logs are then kept, and the line says where).

Ctrl-C in a terminal signals the terminal's whole foreground process group, which includes
``make``: make, interrupted, reports "Interrupt" and exits 130 whatever its recipe did. So when
there is a terminal, the demo moves into a process group of its own and makes it the terminal's
foreground (as a shell does for a job), then hands the terminal back when it ends: Ctrl-C
reaches the demo and its live view only, and make sees the demo's own exit status.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import httpx

from projector.aio import signals
from projector.dynamo.fleet import (
    DISCOVERIES,
    DYNAMO_ENDPOINT,
    DYNAMO_VERSION,
    MODEL,
    Fleet,
    FleetError,
    Frontend,
    Proc,
    default_venv,
)
from projector.nats.server import NatsServer, NatsServerError
from seqstate.errors import SeqstateError

NAMESPACE = "dyn"
STREAMS = 6  # chat requests in flight at a time
START_S = 180.0  # only a hang reaches it: the fleet is up in ~20 s on 2 busy cores
POLL_S = 0.25
READY_LINE = "writer and projector running"  # seqstate run's, once it has provisioned
SEQSTATE = [sys.executable, "-m", "projector"]
SYSTEM_PROMPT = (
    "You are a helpful assistant for the quick brown fox. Answer in a few words, and say "
    "hello to the world from this tiny tokenizer for the dynamo mocker tests."
)
QUESTIONS = (
    "Why does the quick brown fox jump over the lazy dog?",
    "Say hello world to the mocker, please.",
    "What is this tiny tokenizer for?",
    "Tell the lazy dog a message from the system.",
    "How quick is the brown fox, in a few words?",
)


class Stopped(SeqstateError):
    """Ctrl-C (or SIGTERM) while the demo was still starting."""


def take_the_terminal() -> Callable[[], None]:
    """Make this process's own group the terminal's foreground; return what gives it back.

    See the module's docstring for why. Without a terminal (CI, a pipe with no terminal
    behind it), or already leading its group, nothing changes."""
    try:
        tty = os.open("/dev/tty", os.O_RDWR)
    except OSError:
        return lambda: None
    try:
        before = os.tcgetpgrp(tty)
        if before != os.getpgrp() or os.getpid() == os.getpgrp():
            os.close(tty)  # a background job, or already on its own: leave the terminal be
            return lambda: None
        os.setpgid(0, 0)
        with _ttou_ignored():
            os.tcsetpgrp(tty, os.getpgrp())
    except OSError:
        os.close(tty)
        return lambda: None

    def give_back() -> None:
        with _ttou_ignored(), contextlib.suppress(OSError):
            os.tcsetpgrp(tty, before)
        os.close(tty)

    return give_back


@contextlib.contextmanager
def _ttou_ignored() -> Iterator[None]:
    """A background group that sets the terminal's foreground gets SIGTTOU unless ignored."""
    old = signal.signal(signal.SIGTTOU, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGTTOU, old)


def _own_settings_only() -> dict[str, str]:
    """This environment without the caller's NATS and seqstate settings: seqstate's processes
    get the demo's server and namespace, by flag, and nothing else of a user's own setup."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("SEQSTATE_", "NATS_"))}


def _last_line(log: Path) -> str:
    with contextlib.suppress(OSError):
        for line in reversed(log.read_text(errors="replace").splitlines()):
            if line.strip():
                return line.strip()[-300:]
    return "nothing logged"


class Demo:
    """The processes of one demo run, started and stopped in order."""

    def __init__(
        self, python: Path, discovery: str, streams: int, root: Path, stop: asyncio.Event
    ) -> None:
        self.root = root
        self.streams = streams
        self.server = NatsServer(root / "jetstream", port=0, die_with_parent=True)
        self.fleet: Fleet | None = None
        self.python = python
        self.discovery = discovery
        self.seqstate: Proc | None = None
        self.top: subprocess.Popen[bytes] | None = None
        self.sent = self.completed = self.failed = 0
        self.stop = stop

    # ---- up ---------------------------------------------------------------------------------

    async def up(self) -> None:
        self.server.start()
        fleet = self.fleet = Fleet(self.python, self.root, self.server.url, self.discovery)
        await asyncio.to_thread(fleet.write_model)
        if self.discovery == "etcd":
            fleet.start_etcd()
            await self._until(self._etcd_healthy, "etcd answers healthy")
        # seqstate first: its capture stream then stores everything the fleet publishes.
        self.seqstate = self._seqstate_run()
        await self._until(
            lambda: READY_LINE in self.seqstate_log(), "seqstate run is capturing the endpoint"
        )
        fleet.start_mocker("mocker-a")
        fleet.start_mocker("mocker-b-dp2", dp=2)
        for name in ("frontend-1", "frontend-2"):
            fleet.start_frontend(name)
        for front in fleet.frontends:
            await self._until(
                functools.partial(self._serves_the_model, front), f"{front.name} lists the model"
            )

    def _seqstate_run(self) -> Proc:
        """``seqstate run`` as docs/dynamo.md starts it, with the fleet's discovery in its
        environment, which it follows with no flag (as Dynamo's own processes do)."""
        assert self.fleet is not None
        args = ["run", *self._connection(), "--dynamo-endpoint", DYNAMO_ENDPOINT]
        env = {**_own_settings_only(), **self.fleet.discovery_env()}
        return self.fleet.spawn("seqstate-run", [*SEQSTATE, *args], env)

    def _connection(self) -> list[str]:
        return ["--nats-url", self.server.url, "--namespace", NAMESPACE]

    def seqstate_log(self) -> str:
        assert self.seqstate is not None
        with contextlib.suppress(OSError):
            return self.seqstate.log.read_text(errors="replace")
        return ""

    async def _etcd_healthy(self) -> bool:
        assert self.fleet is not None
        async with httpx.AsyncClient(timeout=2) as client:
            answer = await client.get(self.fleet.etcd_url + "/health")
        return bool(answer.json().get("health") == "true")

    async def _serves_the_model(self, front: Frontend) -> bool:
        async with httpx.AsyncClient(timeout=2) as client:
            answer = await client.get(f"http://127.0.0.1:{front.http_port}/v1/models")
        return answer.status_code == 200 and any(
            m.get("id") == MODEL for m in answer.json().get("data", [])
        )

    async def _until(self, probe: Callable[[], object], what: str) -> None:
        """Until ``probe`` (sync or async) is true; a process that exits meanwhile, a
        Ctrl-C or ``START_S`` end the wait."""
        deadline = time.monotonic() + START_S
        while True:
            if self.stop.is_set():
                raise Stopped
            self.check()
            with contextlib.suppress(OSError, ValueError, httpx.HTTPError):
                got = probe()
                if isinstance(got, Awaitable):
                    got = await got
                if got:
                    return
            if time.monotonic() > deadline:
                raise FleetError(f"no {what} within {START_S:g}s")
            await asyncio.sleep(POLL_S)

    def check(self) -> None:
        """One line if any process exited: which, its status and its last log line."""
        self.server.check_alive()
        procs = [*(self.fleet.procs if self.fleet else []), *filter(None, [self.seqstate])]
        for proc in procs:
            if not proc.alive:
                raise FleetError(
                    f"{proc.name} exited with {proc.popen.returncode}: {_last_line(proc.log)}"
                )

    # ---- running ----------------------------------------------------------------------------

    def banner(self) -> str:
        assert self.fleet is not None
        fronts = "  ".join(f"http://127.0.0.1:{f.http_port}" for f in self.fleet.frontends)
        where = (
            f"etcd {self.fleet.etcd_url}"
            if self.discovery == "etcd"
            else f"files in {self.fleet.file_kv}"
        )
        url = self.server.url
        return "\n".join(
            [
                f"dynamo-demo: a Dynamo {DYNAMO_VERSION} fleet on loopback, seqstate following it",
                f"  nats-server  {url} (JetStream)",
                f"  discovery    {where}",
                "  workers      mocker-a (1 rank), mocker-b-dp2 (--data-parallel-size 2)",
                f"  frontends    {fronts} (--router-mode kv --router-replica-sync "
                "--event-plane nats)",
                f"  seqstate     seqstate run --nats-url {url} --namespace {NAMESPACE} "
                f"--dynamo-endpoint {DYNAMO_ENDPOINT}",
                f"  load         {self.streams} chat streams at a time through the frontends",
                f"  logs         {self.root / 'logs'}",
                f"  try          seqstate loads --nats-url {url} --namespace {NAMESPACE}",
                "Ctrl-C stops everything.",
            ]
        )

    def start_top(self) -> None:
        """``seqstate top`` in this process's group: on the terminal, and Ctrl-C reaches it."""
        self.top = subprocess.Popen(
            [*SEQSTATE, "top", *self._connection()],
            env=_own_settings_only(),
            stdin=subprocess.DEVNULL,
        )

    async def serve(self) -> None:
        """The load and the watch, until a stop or a process's exit (raised)."""
        async with httpx.AsyncClient(timeout=httpx.Timeout(30.0, connect=5.0)) as client:
            load = [asyncio.ensure_future(self._chat(i, client)) for i in range(self.streams)]
            try:
                while not self.stop.is_set():
                    self.check()
                    for task in load:
                        if task.done():  # a client loop never ends: it failed
                            raise FleetError(f"the load generator failed: {task.exception()!r}")
                    if self.top is not None and (code := self.top.poll()) is not None:
                        if code != 0:
                            raise FleetError(f"seqstate top exited with {code}")
                        break  # the live view was closed (a signal of its own): stop
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self.stop.wait(), POLL_S)
            finally:
                for task in load:
                    task.cancel()  # closing a stream cancels its request: Dynamo frees it
                await asyncio.gather(*load, return_exceptions=True)

    async def _chat(self, index: int, client: httpx.AsyncClient) -> None:
        """One client: streaming chat requests, one at a time, through the frontends in turn."""
        assert self.fleet is not None
        rng = random.Random(index)
        turn = index
        while True:
            front = self.fleet.frontends[turn % len(self.fleet.frontends)]
            turn += 1
            body = {
                "model": MODEL,
                "messages": [
                    {"role": "system", "content": SYSTEM_PROMPT},
                    {"role": "user", "content": rng.choice(QUESTIONS)},
                ],
                "max_tokens": rng.randint(10, 60),
                "stream": True,
            }
            self.sent += 1
            url = f"http://127.0.0.1:{front.http_port}/v1/chat/completions"
            try:
                async with client.stream("POST", url, json=body) as answer:
                    async for _ in answer.aiter_bytes():
                        pass
                if answer.status_code == 200:
                    self.completed += 1
                else:
                    self.failed += 1
            except httpx.HTTPError:
                self.failed += 1
                await asyncio.sleep(1.0)  # a frontend going away: the watch says why
            await asyncio.sleep(rng.uniform(0.0, 0.5))

    # ---- down -------------------------------------------------------------------------------

    def down(self) -> None:
        """The live view, the fleet (frontends, workers, etcd), seqstate, nats-server."""
        if self.top is not None and self.top.poll() is None:
            self.top.terminate()
            try:
                self.top.wait(15)
            except subprocess.TimeoutExpired:
                self.top.kill()
                self.top.wait()
        if self.fleet is not None:
            self.fleet.stop()
        if self.seqstate is not None:
            self.seqstate.stop()
        with contextlib.suppress(NatsServerError):
            self.server.stop()


async def _demo(args: argparse.Namespace, python: Path) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    root = Path(tempfile.mkdtemp(prefix="seqstate-dynamo-demo-"))
    demo = Demo(python, args.discovery, args.streams, root, stop)
    failure = None
    print(f"dynamo-demo: starting (logs in {root / 'logs'})", flush=True)
    try:
        await demo.up()
        print(demo.banner(), flush=True)
        demo.start_top()
        await demo.serve()
    except Stopped:
        pass
    except (FleetError, NatsServerError) as exc:
        failure = str(exc)
    finally:
        demo.down()  # blocking, with the signal handlers still on: a second Ctrl-C waits too
    if failure is not None:
        print(f"dynamo-demo: {failure} (logs kept in {root / 'logs'})", file=sys.stderr)
        return 1
    shutil.rmtree(root, ignore_errors=True)
    cut = demo.sent - demo.completed - demo.failed
    print(
        f"dynamo-demo: stopped; {demo.sent} chat requests sent, {demo.completed} completed, "
        f"{demo.failed} failed, {cut} cut short by the stop",
        flush=True,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="dynamo-demo", description="a CPU Dynamo fleet with seqstate following it"
    )
    parser.add_argument(
        "--dynamo-venv",
        type=Path,
        default=default_venv(),
        metavar="DIR",
        help="the venv holding Dynamo (default: $DYNAMO_VENV, else the cache's)",
    )
    parser.add_argument(
        "--discovery",
        choices=DISCOVERIES,
        default=os.environ.get("DYNAMO_DISCOVERY", "file"),
        help="Dynamo's discovery: files (default) or an etcd of the demo's own",
    )
    parser.add_argument("--streams", type=int, default=STREAMS, metavar="N")
    args = parser.parse_args(argv)
    python = args.dynamo_venv / "bin" / "python"
    if not python.exists():
        print(
            f"dynamo-demo: no Dynamo venv at {args.dynamo_venv}: `make dynamo-demo` builds one "
            "(deploy/dynamo/install_dynamo.sh), or set DYNAMO_VENV",
            file=sys.stderr,
        )
        return 2
    if args.streams < 1:
        print(f"dynamo-demo: --streams {args.streams}: must be at least 1", file=sys.stderr)
        return 2
    give_back = take_the_terminal()
    try:
        return signals.run(_demo(args, python))
    except KeyboardInterrupt:  # before the signal handlers were set: nothing started yet
        return 0
    finally:
        give_back()


if __name__ == "__main__":
    sys.exit(main())
