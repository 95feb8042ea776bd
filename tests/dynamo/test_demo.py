"""``make dynamo-demo`` as a user types it, in a terminal and piped to another program, then
Ctrl-C.

The demo is up when seqstate's live view (``seqstate top``: a table in a terminal, a table a
second when piped) shows the fleet's two workers, by the instance ids discovery holds, with
their ranks (1, and 2 for the dp 2 mocker), requests in flight and adds counted. Ctrl-C is the
terminal's: ``\\x03`` typed into the pseudo-terminal that is make's controlling terminal, which
signals its foreground process group, as a keyboard does. Then: make exits 0, having printed
how many chat requests completed and no "Interrupt"; every process the demo started is gone
(none of make's descendants seen while it ran is alive, and no process anywhere names the
demo's temporary directory); the ports it printed are free; the directory is removed.

A worker that dies (SIGKILL) stops it all the same, with one line naming it, and make fails.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import termios
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest
from eventually import eventually
from fleet import Fleet, default_venv

pytestmark = pytest.mark.dynamo

REPO = Path(__file__).resolve().parents[2]
START_S = 300.0  # only a hang reaches it: make, the fleet and the first rows take ~30 s
STOP_S = 60.0
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_BOX = re.compile(r"[│┃║|]")
_NUMBER = re.compile(r"-|\d+(\.\d+)?")


class Terminal:
    """``make dynamo-demo`` with a pseudo-terminal as its controlling terminal; its output on
    that terminal, or on a pipe (``piped``), gathered by a thread."""

    def __init__(self, piped: bool) -> None:
        self.master, slave = os.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0))
        env = {
            k: v for k, v in os.environ.items() if k != "NATS_URL" and not k.startswith("SEQSTATE_")
        }
        env.update(
            DYNAMO_VENV=str(default_venv()),
            PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
            TERM="xterm-256color",
            COLUMNS="200",
        )
        env.pop("NO_COLOR", None)
        out = subprocess.PIPE if piped else slave
        self.proc = subprocess.Popen(
            ["make", "dynamo-demo"],
            cwd=REPO,
            env=env,
            stdin=slave,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a session of its own, whose terminal is the pty
            preexec_fn=_claim_terminal,
        )
        os.close(slave)
        self.chunks: list[bytes] = []
        source = self.proc.stdout.fileno() if self.proc.stdout is not None else self.master
        self.reader = threading.Thread(target=self._read, args=(source,), daemon=True)
        self.reader.start()

    def _read(self, fd: int) -> None:
        while True:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # EIO: the last process on the terminal closed it
                return
            if not chunk:
                return
            self.chunks.append(chunk)

    @property
    def text(self) -> str:
        return _ANSI.sub("", b"".join(self.chunks).decode(errors="replace"))

    def running(self) -> None:
        """For a wait: make exiting before the demo is up ends it, with what it said."""
        if self.proc.poll() is not None:
            raise AssertionError(f"make exited with {self.proc.returncode}:\n{self.text[-3000:]}")

    def ctrl_c(self) -> None:
        os.write(self.master, b"\x03")

    def close(self) -> None:
        if self.proc.poll() is None:  # a failed test: stop what is left, by its group
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(STOP_S)
        self.reader.join(10)
        os.close(self.master)


def _claim_terminal() -> None:
    """In the child, a session leader by now: its stdin, the pty, becomes its terminal."""
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def banner(text: str) -> dict[str, str] | None:
    """What the demo printed of itself, once it has: its temp directory and its ports."""
    logs = re.search(r"^\s*logs\s+(\S+)/logs\s*$", text, re.M)
    nats = re.search(r"^\s*nats-server\s+nats://127\.0\.0\.1:(\d+)", text, re.M)
    fronts = re.search(r"^\s*frontends\s+(.*)$", text, re.M)
    if not (logs and nats and fronts):
        return None
    ports = re.findall(r"http://127\.0\.0\.1:(\d+)", fronts.group(1))
    return {"root": logs.group(1), "ports": " ".join([nats.group(1), *ports])}


def rows(text: str) -> list[list[str]]:
    """Every row of every table ``seqstate top`` drew: worker, ranks, requests, active blocks,
    prefill tokens, remaining prefill ms, adds/s, frees/s (the same columns, boxed or not)."""
    found = []
    for line in text.splitlines():
        cells = _BOX.sub(" ", line).split()
        if len(cells) == 8 and cells[0].isdigit() and all(_NUMBER.fullmatch(c) for c in cells):
            found.append(cells)
    return found


def flowing(text: str, workers: dict[int, int]) -> bool:
    """The view shows exactly the fleet's workers with their ranks, some row with requests in
    flight, and some with adds counted."""
    seen = rows(text)
    shown = {int(r[0]): int(r[1]) for r in seen}
    return (
        shown == workers
        and any(int(r[2]) > 0 for r in seen)
        and any(r[6] != "-" and float(r[6]) > 0 for r in seen)
    )


def descendants(root_pid: int) -> set[tuple[int, str]]:
    """(pid, start time) of every live descendant of ``root_pid``."""
    parent: dict[int, int] = {}
    started: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        parent[int(entry)] = int(fields[1])
        started[int(entry)] = fields[19]
    out, todo = set(), [root_pid]
    while todo:
        pid = todo.pop()
        for child, ppid in parent.items():
            if ppid == pid:
                out.add((child, started[child]))
                todo.append(child)
    return out


def alive(procs: set[tuple[int, str]]) -> set[tuple[int, str]]:
    still = set()
    for pid, start in procs:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        if stat.rsplit(")", 1)[1].split()[19] == start:  # not a new process on a reused pid
            still.add((pid, start))
    return still


def naming(root: str) -> set[int]:
    """Every process whose command line, environment or working directory names ``root``."""
    found = set()
    needle = root.encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            seen = [
                Path(f"/proc/{entry}/cmdline").read_bytes(),
                Path(f"/proc/{entry}/environ").read_bytes(),
                os.readlink(f"/proc/{entry}/cwd").encode(),
            ]
        except OSError:
            continue
        if any(needle in s for s in seen):
            found.add(int(entry))
    return found


def free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@dataclass
class Up:
    """A demo showing its fleet: its directory, its ports, what make had started by then."""

    root: str
    ports: list[int]
    started: set[tuple[int, str]]


async def up(term: Terminal, dynamo_python: Path) -> Up:
    """Until seqstate top shows the fleet's workers (by discovery's ids) with requests flowing."""
    said = await eventually(
        lambda: banner(term.text),
        what="the demo's banner (its directory and ports)",
        timeout=START_S,
        interval=0.2,
        check=term.running,
        watch=lambda: term.text[-3000:],
    )
    root = said["root"]
    ports = [int(p) for p in said["ports"].split()]
    assert len(ports) == 3, said  # nats-server and two frontends
    fleet = Fleet(dynamo_python, Path(root), "nats://unused")  # to read its discovery
    workers = await eventually(
        lambda: sorted(fleet.worker_ids().values()),
        lambda ids: len(ids) == 2,
        what="two workers in the demo's discovery",
        timeout=START_S,
        check=term.running,
    )
    ranks = {w: len([r for r in fleet.ranks() if r[0] == w]) for w in workers}
    assert sorted(ranks.values()) == [1, 2], ranks
    await eventually(
        lambda: flowing(term.text, ranks),
        what=f"seqstate top showing workers {ranks} (id: ranks) with requests flowing",
        timeout=START_S,
        interval=0.2,
        check=term.running,
        watch=lambda: term.text[-3000:],
    )
    started = descendants(term.proc.pid)
    # nats-server, seqstate run and top, two mockers and two frontends, the demo itself.
    assert len(started) >= 8, started
    assert naming(root), "no process names the demo's directory: the check below is void"
    return Up(root, ports, started)


async def exited(term: Terminal) -> tuple[int, str]:
    code = await eventually(
        term.proc.poll,
        lambda c: c is not None,
        what="make dynamo-demo exits",
        timeout=STOP_S,
        interval=0.1,
        watch=lambda: term.text[-3000:],
    )
    term.reader.join(10)
    return code, term.text


def all_stopped(demo: Up) -> None:
    assert alive(demo.started) == set()
    assert naming(demo.root) == set()
    assert [p for p in demo.ports if not free(p)] == []


@pytest.mark.parametrize("piped", [False, True], ids=["terminal", "piped"])
async def test_make_dynamo_demo_shows_the_fleet_and_ctrl_c_stops_it_all(
    dynamo_python: Path, piped: bool
) -> None:
    term = Terminal(piped)
    try:
        demo = await up(term, dynamo_python)
        term.ctrl_c()
        code, text = await exited(term)
        assert code == 0, text[-3000:]
        assert "Traceback" not in text and "Interrupt" not in text, text[-3000:]
        done = re.search(r"dynamo-demo: stopped; (\d+) chat requests sent, (\d+) completed", text)
        assert done and int(done.group(2)) > 0, text[-3000:]
        all_stopped(demo)
        assert not Path(demo.root).exists()
    finally:
        term.close()


async def test_a_worker_that_dies_stops_the_demo_with_one_line(dynamo_python: Path) -> None:
    """SIGKILL of the single-rank mocker, as a crash: the demo stops everything, says which
    process exited in one line, keeps its logs, and make fails."""
    term = Terminal(piped=True)
    demo: Up | None = None
    try:
        demo = await up(term, dynamo_python)
        (mocker,) = [  # the leader of its process group: the process the demo started
            pid
            for pid, _ in demo.started
            if b"dynamo.mocker" in _cmdline(pid)
            and b"--data-parallel-size" not in _cmdline(pid)
            and os.getpgid(pid) == pid
        ]
        os.kill(mocker, signal.SIGKILL)
        code, text = await exited(term)
        assert code == 2, text[-3000:]  # make's status for a recipe that failed
        said = [line for line in text.splitlines() if line.startswith("dynamo-demo: mocker-a")]
        assert len(said) == 1, text[-3000:]
        assert said[0].startswith("dynamo-demo: mocker-a exited with -9: "), said
        assert said[0].endswith(f"(logs kept in {demo.root}/logs)"), said
        assert "Traceback" not in text, text[-3000:]
        all_stopped(demo)
        assert (Path(demo.root) / "logs" / "mocker-a.log").exists()
    finally:
        term.close()
        if demo is not None:
            shutil.rmtree(demo.root, ignore_errors=True)


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""
