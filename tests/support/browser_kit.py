"""Debian's headless Chromium, driven over its DevTools protocol, for the pictures' tests.

Each browser is started fresh (an empty profile of its own), with the flags a closed machine
needs (no background networking), and on a DevTools port the system picks. Every console error,
uncaught exception and network request of the page is recorded, so a test can say that the
page drew without an error and asked nothing of another machine. A missing chromium fails the
test with the command that installs it (``.ci/run`` runs it).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import shutil
import subprocess
import tempfile
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from eventually import eventually
from websockets.asyncio.client import ClientConnection, connect

INSTALL = "apt-get install -y chromium"
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-quic",
    "--no-first-run",
    "--remote-debugging-port=0",
    "--window-size=1100,900",
)
# Each chart's coloured pixels: its axes and grid are grey, so colour on its canvas is a line of
# its series drawn.
INK = """
(() => {
  const out = {};
  for (const box of document.querySelectorAll('.chart')) {
    let ink = 0;
    for (const canvas of box.querySelectorAll('canvas')) {
      const px = canvas.getContext('2d').getImageData(0, 0, canvas.width, canvas.height).data;
      for (let i = 0; i < px.length; i += 4) {
        const hi = Math.max(px[i], px[i + 1], px[i + 2]);
        const lo = Math.min(px[i], px[i + 1], px[i + 2]);
        if (px[i + 3] > 128 && hi - lo > 60) ink += 1;
      }
    }
    out[box.id] = {points: box.dataset.points || '', ink: ink};
  }
  return out;
})()
"""


def chromium() -> str:
    found = shutil.which("chromium")
    if found is None:
        pytest.fail(f"chromium is not installed: {INSTALL} (as root; .ci/run does it)")
    return found


class Page:
    """One tab: commands, and what the page logged and asked for."""

    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws
        self.ids = itertools.count(1)
        self.waiting: dict[int, asyncio.Future[Any]] = {}
        self.errors: list[str] = []
        self.requests: list[str] = []
        self.reader = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        async for raw in self.ws:
            message = json.loads(raw)
            if "id" in message:
                future = self.waiting.pop(message["id"])
                if "error" in message:
                    future.set_exception(AssertionError(f"DevTools: {message['error']}"))
                else:
                    future.set_result(message.get("result", {}))
                continue
            method, params = message.get("method"), message.get("params", {})
            if method == "Network.requestWillBeSent":
                self.requests.append(params["request"]["url"])
            elif method == "Runtime.consoleAPICalled" and params["type"] in ("error", "assert"):
                self.errors.append(json.dumps(params["args"]))
            elif method == "Runtime.exceptionThrown":
                self.errors.append(json.dumps(params["exceptionDetails"]))
            elif method == "Log.entryAdded" and params["entry"]["level"] == "error":
                self.errors.append(params["entry"]["text"])

    async def send(self, method: str, **params: Any) -> Any:
        n = next(self.ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.waiting[n] = future
        await self.ws.send(json.dumps({"id": n, "method": method, "params": params}))
        return await asyncio.wait_for(future, 30)

    async def evaluate(self, expression: str) -> Any:
        result = await self.send(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in result:
            raise AssertionError(f"{expression[:60]}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def open(self, url: str) -> None:
        for domain in ("Runtime", "Log", "Network", "Page"):
            await self.send(f"{domain}.enable")
        await self.send("Page.navigate", url=url)

    async def charts(self) -> dict[str, dict[str, Any]]:
        """Each chart's ``data-points`` and its coloured pixels (its lines drawn)."""
        return dict(await self.evaluate(INK))

    def off_machine(self) -> list[str]:
        """The requests made to anything but this machine (loopback, data: and file:)."""
        local = ("http://127.0.0.1:", "http://localhost:", "data:", "file://")
        return [url for url in self.requests if not url.startswith(local)]


@contextlib.asynccontextmanager
async def browser() -> AsyncIterator[Page]:
    """A fresh headless Chromium with one tab, stopped (its profile removed) on the way out."""
    binary = chromium()
    profile = Path(tempfile.mkdtemp(prefix="seqstate-chromium-"))
    proc = subprocess.Popen(
        [binary, *FLAGS, f"--user-data-dir={profile}", "about:blank"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        port_file = profile / "DevToolsActivePort"

        async def port() -> int | None:
            assert proc.poll() is None, f"chromium exited with {proc.returncode}"
            lines = port_file.read_text().split() if port_file.exists() else []
            return int(lines[0]) if len(lines) == 2 else None

        devtools = await eventually(port, what="chromium's DevTools port")

        async def tab() -> str | None:
            listing = await asyncio.to_thread(
                lambda: urllib.request.urlopen(f"http://127.0.0.1:{devtools}/json/list").read()
            )
            pages = [t for t in json.loads(listing) if t["type"] == "page"]
            return pages[0]["webSocketDebuggerUrl"] if pages else None

        url = await eventually(tab, what="a tab in chromium", retry_on=(OSError,))
        async with connect(url, max_size=None) as ws:
            page = Page(ws)
            try:
                yield page
            finally:
                page.reader.cancel()
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(profile, ignore_errors=True)
