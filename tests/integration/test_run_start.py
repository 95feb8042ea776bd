"""``seqstate run``'s start, as a user types it: its port, and a signal while it catches up.

A port taken used to be one warning and a random port: the tour's ``NATS_URL`` then reached the
other server (Dynamo's listens on 4222 too), a publish there "succeeded" and ``loads`` stayed
empty. A Ctrl-C while ``run`` folded a backlog took tens of seconds and printed a hundred lines
of tracebacks.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from log_text import plain_lines

REPO = Path(__file__).resolve().parents[2]
DEFAULT_PORT = 4222


def env() -> dict[str, str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("NATS_URL", "SEQSTATE_"))}
    return {**clean, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{clean.get('PATH', '')}"}


def seqstate(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "projector", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env(),
        cwd=REPO,
    )


@contextlib.contextmanager
def taken(port: int) -> Iterator[None]:
    """``port`` on 127.0.0.1 taken for the block: by this test if it is free, else it already
    is (another server listens there)."""
    with socket.socket() as squatter:
        try:
            squatter.bind(("127.0.0.1", port))
            squatter.listen()
        except OSError:
            pass
        yield


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_run_refuses_a_taken_port_in_one_line_and_port_0_takes_any(tmp_path: Path) -> None:
    store = tmp_path / "store"
    with taken(DEFAULT_PORT):
        refused = seqstate("run", "--store-dir", str(store), "--duration", "5")
        assert (refused.returncode, refused.stdout) == (1, ""), refused.stderr
        url = f"nats://127.0.0.1:{DEFAULT_PORT}"
        assert plain_lines(refused.stderr) == [
            f"seqstate: error: port {DEFAULT_PORT} on 127.0.0.1 is taken: another server listens "
            f"there (NATS_URL={url} would reach it, not this run); --port N (SEQSTATE_PORT=N) "
            "picks another port, --port 0 any free one"
        ]
        # Nothing was left running: the same store starts at once on any free port.
        anywhere = seqstate(
            "run", "--store-dir", str(store), "--port", "0", "--duration", "0.5",
            "--log-level", "info",
        )  # fmt: skip
    assert anywhere.returncode == 0, anywhere.stderr
    said = [line for line in plain_lines(anywhere.stderr) if "embedded nats-server at" in line]
    assert len(said) == 1, anywhere.stderr
    port = int(said[0].split("embedded nats-server at nats://127.0.0.1:", 1)[1].split()[0])
    assert port not in (0, DEFAULT_PORT)
    assert not any(line.startswith("WARNING") for line in plain_lines(anywhere.stderr))


def test_run_refuses_a_port_it_was_given_when_taken(tmp_path: Path) -> None:
    port = free_port()
    with taken(port):
        store = str(tmp_path / "store")
        refused = seqstate("run", "--store-dir", store, "--port", str(port), "--duration", "5")
    assert (refused.returncode, refused.stdout) == (1, ""), refused.stderr
    (line,) = plain_lines(refused.stderr)
    assert line.startswith(f"seqstate: error: port {port} on 127.0.0.1 is taken: "), line
    assert "Traceback" not in refused.stderr
