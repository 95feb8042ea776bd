"""A small Dynamo 1.6.1 fleet on loopback: mocker workers and KV-router frontends, no GPU.

What ``make dynamo-demo`` brings up, and what the live suite (tests/dynamo) starts for each of
its modules. Dynamo is never a dependency of seqstate: it lives in a venv of its own (built by
``deploy/dynamo/install_dynamo.sh``, see :func:`default_venv`), and its processes are started
from that venv's Python, so nothing of Dynamo is ever imported here.

Every Dynamo process is on the NATS event plane (its routers' replica-sync messages reach NATS,
where seqstate captures them) and the TCP request plane, with no hub access; discovery is
Dynamo's file backend (``discovery="file"``: one file a key under the fleet's ``discovery/``
directory) or an etcd of the fleet's own (``discovery="etcd"``, started by
:meth:`Fleet.start_etcd` before any Dynamo process and stopped after them).

Every process runs in a process group of its own, its stdout and stderr in a log file under the
fleet's root (``logs/NAME.log``), so a failed run can be read afterwards. Stopping is SIGTERM to
the group, then SIGKILL to the group if it has not exited within ``STOP_S``: a frontend or a
mocker spawns threads and helpers, and a stopped parent must not leave them holding ports. A
process that starts a fleet and dies without stopping it (SIGKILL) takes the fleet with it:
each process is started with Linux's ``PR_SET_PDEATHSIG`` (SIGTERM), as seqstate's own
nats-server is.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from projector.nats.server import _death_signal_setter
from seqstate.errors import SeqstateError

DYNAMO_VERSION = "1.6.1"
MODEL = "tiny"
BLOCK_SIZE = 16
NAMESPACE, COMPONENT, ENDPOINT = "dynamo", "backend", "generate"
# What `seqstate run --dynamo-endpoint` takes, and the subject Dynamo publishes it on.
DYNAMO_ENDPOINT = f"{NAMESPACE}.{COMPONENT}.{ENDPOINT}"
EVENTS_SUBJECT = (
    f"namespace.{NAMESPACE}.component.{COMPONENT}.endpoint.{ENDPOINT}.active_sequences_events"
)
# Each token takes ~0.1 s of the mocker's simulated decode, so a request stays in flight long
# enough to be seen (and a stream with a large max_tokens until its client closes it).
DECODE_SPEEDUP = "0.05"
STOP_S = 10.0
DISCOVERIES = ("file", "etcd")
TINY_MODEL_SCRIPT = Path(__file__).with_name("tiny_model.py")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


class FleetError(SeqstateError, RuntimeError):
    """A fleet process could not be started, or exited; the message says which and why."""


def cache_dir() -> Path:
    """``${XDG_CACHE_HOME:-~/.cache}/seqstate``: where the Dynamo venv and etcd are kept,
    outside any checkout, built once."""
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "seqstate"


def default_venv() -> Path:
    """The Dynamo venv: ``DYNAMO_VENV``, else the cache's ``dynamo-1.6.1`` (where ``make
    dynamo-demo`` and ``make test-dynamo`` build it)."""
    configured = os.environ.get("DYNAMO_VENV")
    return Path(configured) if configured else cache_dir() / f"dynamo-{DYNAMO_VERSION}"


def etcd_binary() -> Path | None:
    """Where the etcd binary is, or None: ``ETCD_BIN``, ``PATH``, else where
    ``tests/tools/install_etcd.sh`` unpacks Debian's ``etcd-server`` (the cache's
    ``etcd-3.4``)."""
    configured = os.environ.get("ETCD_BIN")
    if configured:
        return Path(configured)
    on_path = shutil.which("etcd")
    if on_path:
        return Path(on_path)
    unpacked = cache_dir() / "etcd-3.4" / "usr" / "bin" / "etcd"
    return unpacked if unpacked.exists() else None


def etcd_args(binary: Path, data_dir: Path, client_port: int, peer_port: int) -> list[str]:
    """A single member on loopback: its own cluster, nothing shared with another fleet's."""
    client = f"http://127.0.0.1:{client_port}"
    peer = f"http://127.0.0.1:{peer_port}"
    return [
        str(binary),
        "--name",
        "fleet",
        "--data-dir",
        str(data_dir),
        "--listen-client-urls",
        client,
        "--advertise-client-urls",
        client,
        "--listen-peer-urls",
        peer,
        "--initial-advertise-peer-urls",
        peer,
        "--initial-cluster",
        f"fleet={peer}",
        "--log-level",
        "warn",
    ]


def free_ports(count: int) -> list[int]:
    """``count`` distinct loopback ports free right now (bound together, then released)."""
    socks: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            socks.append(sock)
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


@dataclass
class Proc:
    """One process of the fleet: its group is the unit that is stopped, its log what is read."""

    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    rpc_port: int

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def lines(self) -> list[str]:
        """Its log, line by line, ANSI colours stripped (Dynamo colours its logs regardless)."""
        return [_ANSI.sub("", line) for line in self.log.read_text(errors="replace").splitlines()]

    def tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.lines()[-lines:])
        except OSError as exc:
            return f"(no log: {exc})"

    def check(self) -> None:
        """Raise with the log's tail if the process has exited: a wait for it is then over."""
        if not self.alive:
            raise FleetError(
                f"{self.name} exited with {self.popen.returncode}; log {self.log}:\n{self.tail()}"
            )

    def _signal_group(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, sig)

    def stop(self) -> None:
        """SIGTERM to the group, SIGKILL to the group after ``STOP_S``; reaps the leader."""
        if self.alive:
            self._signal_group(signal.SIGTERM)
            try:
                self.popen.wait(STOP_S)
            except subprocess.TimeoutExpired:
                self._signal_group(signal.SIGKILL)
                self.popen.wait()
        # Helpers the leader left behind die with their group even when the leader exited.
        self._signal_group(signal.SIGKILL)

    def kill(self) -> None:
        """SIGKILL the group, as a crash would."""
        self._signal_group(signal.SIGKILL)
        self.popen.wait()


@dataclass
class Frontend(Proc):
    """A KV-router frontend with replica sync; ``router_id`` is learnt from its first AddRequest
    by whoever needs it."""

    http_port: int = 0
    router_id: int | None = None


@dataclass
class Fleet:
    """The processes of one fleet, sharing a nats-server and a discovery (files or etcd)."""

    python: Path
    root: Path
    nats_url: str
    discovery: str = "file"
    nats_monitor: str | None = None  # nats-server's HTTP monitoring, if it serves one
    model_dir: Path = field(init=False)
    file_kv: Path = field(init=False)
    etcd: Proc | None = None
    mockers: list[Proc] = field(default_factory=list)
    frontends: list[Frontend] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.discovery not in DISCOVERIES:
            raise FleetError(f"discovery {self.discovery!r}: one of {', '.join(DISCOVERIES)}")
        self.model_dir = self.root / "model"
        self.file_kv = self.root / "discovery"
        (self.root / "logs").mkdir(parents=True, exist_ok=True)
        self.file_kv.mkdir(exist_ok=True)

    # ---- starting -------------------------------------------------------------------------

    def write_model(self) -> None:
        """The tiny tokenizer and config, written by the Dynamo venv (it has ``tokenizers``)."""
        done = subprocess.run(
            [str(self.python), str(TINY_MODEL_SCRIPT), str(self.model_dir)],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise FleetError(f"writing the tiny model with {self.python} failed: {last}")

    def start_etcd(self) -> Proc:
        """The fleet's etcd (``discovery="etcd"`` only): ready once it answers on
        :attr:`etcd_url` (``/health``)."""
        assert self.discovery == "etcd" and self.etcd is None
        binary = etcd_binary()
        if binary is None or not binary.exists():
            raise FleetError(
                f"no etcd binary ({binary or 'none found'}): run tests/tools/install_etcd.sh,"
                " or set ETCD_BIN"
            )
        client, peer = free_ports(2)
        args = etcd_args(binary, self.root / "etcd-data", client, peer)
        self.etcd = Proc(
            "etcd", self._spawn("etcd", args, dict(os.environ)), self._log("etcd"), client
        )
        return self.etcd

    @property
    def etcd_url(self) -> str:
        assert self.etcd is not None, "no etcd in a fleet on file discovery"
        return f"http://127.0.0.1:{self.etcd.rpc_port}"

    def discovery_env(self) -> dict[str, str]:
        """Dynamo's discovery variables for this fleet: what its processes are started with,
        and what seqstate, started with them too, follows with no flag."""
        env = {"DYN_DISCOVERY_BACKEND": self.discovery}
        if self.discovery == "etcd":
            env["ETCD_ENDPOINTS"] = self.etcd_url
        else:
            env["DYN_FILE_KV"] = str(self.file_kv)
        return env

    def _env(self, rpc_port: int, response_port: int | None = None) -> dict[str, str]:
        """The NATS event plane, the TCP request plane, the fleet's discovery, no hub;
        distinct TCP ports per process, so two never fight over one."""
        env = dict(os.environ)
        env.update(
            NATS_SERVER=self.nats_url,
            DYN_EVENT_PLANE="nats",
            DYN_REQUEST_PLANE="tcp",
            DYN_TCP_RPC_HOST="127.0.0.1",
            DYN_TCP_RESPONSE_STREAM_HOST="127.0.0.1",
            DYN_TCP_RPC_PORT=str(rpc_port),
            HF_HUB_OFFLINE="1",
            NO_COLOR="1",
            **self.discovery_env(),
        )
        if response_port is not None:
            env["DYN_TCP_RESPONSE_STREAM_PORT"] = str(response_port)
        return env

    def _log(self, name: str) -> Path:
        return self.root / "logs" / f"{name}.log"

    def _spawn(self, name: str, args: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        with self._log(name).open("ab") as out:
            return subprocess.Popen(
                args,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # its own process group: stopped as one
                cwd=self.root,
                # SIGTERM when the starting process dies, even by SIGKILL: no fleet outlives it.
                preexec_fn=_death_signal_setter(),
            )

    def spawn(self, name: str, args: list[str], env: dict[str, str]) -> Proc:
        """Another process beside the fleet (seqstate's), started and logged as the fleet's are;
        the caller stops it."""
        return Proc(name, self._spawn(name, args, env), self._log(name), 0)

    def _dynamo(self, name: str, args: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        return self._spawn(name, [str(self.python), "-m", *args], env)

    def start_mocker(self, name: str, *, dp: int = 1, env: dict[str, str] | None = None) -> Proc:
        """A mocker worker serving the tiny model (``dp`` data-parallel ranks)."""
        (rpc,) = free_ports(1)
        args = [
            "dynamo.mocker",
            "--model-path",
            str(self.model_dir),
            "--model-name",
            MODEL,
            "--block-size",
            str(BLOCK_SIZE),
            "--decode-speedup-ratio",
            DECODE_SPEEDUP,
        ]
        if dp > 1:
            args += ["--data-parallel-size", str(dp)]
        popen = self._dynamo(name, args, {**self._env(rpc), **(env or {})})
        proc = Proc(name, popen, self._log(name), rpc)
        self.mockers.append(proc)
        return proc

    def start_frontend(self, name: str, *extra: str, env: dict[str, str] | None = None) -> Frontend:
        """A KV-router frontend with replica sync on the NATS event plane; ``env`` adds to (or
        overrides) Dynamo's environment, e.g. ``DYN_ROUTER_ACTIVE_REQUEST_EXPIRY_SECS``."""
        rpc, response, http = free_ports(3)
        args = [
            "dynamo.frontend",
            "--http-host",
            "127.0.0.1",
            "--http-port",
            str(http),
            "--router-mode",
            "kv",
            "--router-replica-sync",
            "--event-plane",
            "nats",
            "--discovery-backend",
            self.discovery,
            "--request-plane",
            "tcp",
            *extra,
        ]
        popen = self._dynamo(name, args, {**self._env(rpc, response), **(env or {})})
        front = Frontend(name, popen, self._log(name), rpc, http_port=http)
        self.frontends.append(front)
        return front

    # ---- stopping and reading ---------------------------------------------------------------

    def stop_proc(self, proc: Proc) -> None:
        proc.stop()
        if proc in self.mockers:
            self.mockers.remove(proc)
        if isinstance(proc, Frontend) and proc in self.frontends:
            self.frontends.remove(proc)

    def kill_proc(self, proc: Proc) -> None:
        """SIGKILL a process of the fleet (its group), as a crash would, and forget it."""
        proc.kill()
        self.stop_proc(proc)

    def stop(self) -> None:
        """Frontends first (they route), then the workers, then etcd (they hold leases on it);
        each group SIGTERM, then SIGKILL."""
        for proc in [*self.frontends, *self.mockers]:
            proc.stop()
        self.frontends.clear()
        self.mockers.clear()
        if self.etcd is not None:
            self.etcd.stop()

    @property
    def procs(self) -> list[Proc]:
        return [*self.mockers, *self.frontends, *([self.etcd] if self.etcd else [])]

    def check(self) -> None:
        for proc in self.procs:
            proc.check()

    def tails(self, lines: int = 40) -> str:
        logs = sorted((self.root / "logs").glob("*.log"))
        parts = []
        for log in logs:
            text = log.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {log} ---\n" + "\n".join(_ANSI.sub("", t) for t in text))
        return "\n".join(parts)
