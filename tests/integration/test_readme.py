"""The README's tour runs as written: its Python blocks against a real pipeline, its shell reads.

A README that drifts from the API is the first thing a new user meets, so the tour's code is
executed, not copied: the publish block, then the read block, with ``NATS_URL`` set, against a
server of this module with the default names the tour uses.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import nats
import pytest

from projector.nats.server import NatsServer
from projector.run.pipeline import Pipeline
from projector.settings.config import Config

README = Path(__file__).resolve().parents[2] / "README.md"


def python_block(after: str) -> str:
    """The first ```python block following the paragraph that starts with ``after``."""
    text = README.read_text()
    start = text.index(after)
    match = re.search(r"```python\n(.*?)```", text[start:], re.S)
    assert match, f"no python block after {after!r}"
    return match.group(1)


async def run_python(code: str, url: str, *args: str) -> str:
    env = {**os.environ, "NATS_URL": url}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        code,
        *args,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    return out.decode()


@pytest.fixture
async def default_pipeline(nats_server: NatsServer) -> AsyncIterator[str]:
    nc = await nats.connect(nats_server.url)
    try:
        async with Pipeline(nc, Config()):
            yield nats_server.url
    finally:
        await nc.drain()


async def test_the_tour_publishes_then_reads(default_pipeline: str) -> None:
    url = default_pipeline
    out = await run_python(python_block("**Publish from Python**"), url)
    assert out.strip() == "last event 3"
    out = await run_python(python_block("**Read from Python**"), url, out.split()[-1])
    rows = [line for line in out.splitlines() if line.startswith("PotentialLoadRow(")]
    assert rows == [
        "PotentialLoadRow(worker_id=3, dp_rank=0, potential_prefill_tokens=1500, "
        "potential_decode_blocks=4, active_requests=1)",
        "PotentialLoadRow(worker_id=4, dp_rank=0, potential_prefill_tokens=1800, "
        "potential_decode_blocks=3, active_requests=1)",
    ]
    assert "Staleness(applied_seq=3" in out
    loads = subprocess.run(
        [sys.executable, "-m", "projector", "loads"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "NATS_URL": url},
    )
    assert loads.returncode == 0, loads.stderr
    lines = loads.stdout.splitlines()
    assert lines[0].split() == [
        "worker",
        "rank",
        "requests",
        "active_blocks",
        "prefill_tokens",
        "remaining_prefill_ms",
    ]
    assert [line.split()[:5] for line in lines[1:3]] == [
        ["3", "0", "1", "3", "0"],
        ["4", "0", "1", "2", "300"],
    ]
