"""The demo shows where a trace replay is: requests routed of the total, the trace's own time
and an ETA; run as the README runs it, in a terminal and piped."""

from __future__ import annotations

import fcntl
import os
import re
import struct
import subprocess
import sys
import termios
import threading
from pathlib import Path

from pipeline_kit import REPO

from projector.ops.demo import ReplayProgress

TRACE = Path(__file__).resolve().parents[2] / "data" / "mooncake_sample.jsonl"
LINES = 60  # 15 s of the trace: 3 s of arrivals at 5x


def trace_slice(tmp_path: Path) -> Path:
    path = tmp_path / "slice.jsonl"
    with TRACE.open() as f:
        path.write_text("".join(next(f) for _ in range(LINES)))
    return path


def demo_args(tmp_path: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "projector",
        "run",
        "--demo",
        "--trace",
        str(trace_slice(tmp_path)),
        "--speedup",
        "5",
        "--workers",
        "2",
        "--store-dir",
        str(tmp_path / "store"),
        "--port",
        "0",
        "--log-level",
        "warning",
    ]


def env() -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if k != "NATS_URL" and not k.startswith("SEQSTATE_")}
    out["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{out.get('PATH', '')}"
    return out


def test_demo_piped_prints_position_trace_time_and_eta(tmp_path: Path) -> None:
    result = subprocess.run(
        demo_args(tmp_path), capture_output=True, text=True, timeout=120, env=env(), cwd=REPO
    )
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stdout.splitlines() if "progress=" in line]
    assert lines, result.stdout
    # Before the first arrival: nothing routed, 15 s of trace ahead, 3 s of it at 5x.
    assert f"progress=0/{LINES} (0%)" in lines[0] and "/0:15" in lines[0]
    assert re.search(r"eta=0:0[0-3]\b", lines[0]), lines[0]
    assert any(f"progress={LINES}/{LINES} (100%)" in line for line in lines), lines
    assert f"demo: routed {LINES} requests ({LINES} completed" in result.stdout


def test_demo_in_a_terminal_shows_a_progress_bar_with_eta(tmp_path: Path) -> None:
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
    e = {**env(), "TERM": "xterm-256color", "COLUMNS": "160"}
    e.pop("NO_COLOR", None)
    proc = subprocess.Popen(
        demo_args(tmp_path), env=e, cwd=REPO, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave
    )
    os.close(slave)
    screen: list[bytes] = []

    def read_terminal() -> None:
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the child closed its end
                return
            if not chunk:
                return
            screen.append(chunk)

    reader = threading.Thread(target=read_terminal)
    reader.start()
    try:
        assert proc.wait(timeout=120) == 0
    finally:
        proc.kill()
        reader.join(10)
        os.close(master)
    text = b"".join(screen).decode(errors="replace")
    plain = "".join(ch for ch in text.replace("\x1b[", "\x00") if ch.isprintable())
    assert "Traceback" not in text
    assert "━" in text  # the bar
    for said in ("progress", f"{LINES}/{LINES} (100%)", "trace time", "0:15", "eta"):
        assert said in plain, said
    assert f"demo: routed {LINES} requests" in plain


def test_replay_progress_fields() -> None:
    p = ReplayProgress(speedup=10.0, total=200, span_s=600.0)
    assert p.fields(50, 15.0) == {
        "progress": "50/200 (25%)",
        "trace time": "2:30/10:00",
        "eta": "0:45",
    }
    assert p.fields(200, 70.0)["eta"] == "draining"
    assert p.fields(199, 70.0)["trace time"] == "10:00/10:00"
    synthetic = ReplayProgress(speedup=1.0, duration_s=30.0)
    assert synthetic.fields(10, 12.0) == {"trace time": "0:12", "eta": "0:18"}
    assert ReplayProgress(speedup=1.0).fields(3, 4000.0) == {
        "trace time": "1:06:40",
        "eta": "until stopped",
    }
