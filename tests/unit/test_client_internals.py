"""nats-py's private API is used in one module only, and is still shaped as that module knows.

A nats-py release may rename, retype or drop any underscored name without notice: the writer
would then fail in production, or worse, go on doing something else. These tests fail loudly
instead, at the first test run against the new release: the installed nats-py is the minor
pyproject.toml pins and :data:`~projector.nats.client_internals.TESTED_ON` names; each private
name :mod:`projector.nats.client_internals` relies on exists with the kind and signature it
expects; and no other module of ``projector/`` names one of nats-py's private attributes.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import re
import subprocess
import sys
import tomllib
from importlib.metadata import version
from pathlib import Path

import nats
from nats.aio.client import Client
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from projector.nats import client_internals
from projector.nats.client_internals import (
    BUILD_MESSAGE_PARAMETERS,
    CLIENT_METHODS,
    CLIENT_STATE,
    JETSTREAM_STATE,
    KEY_WATCHER_STATE,
    PENDING_BUFFER,
    PUSH_SUBSCRIPTION_STATE,
    SIGNING,
    SUBSCRIPTION_STATE,
    TESTED_ON,
)

ROOT = Path(__file__).resolve().parents[2]
FENCE = ROOT / "projector" / "nats" / "client_internals.py"


def nats_pin() -> str:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (pin,) = [d for d in deps if re.match(r"nats-py\b", d)]
    return pin


def test_nats_py_is_pinned_to_the_minor_it_was_tested_on() -> None:
    major, minor = TESTED_ON
    assert nats_pin() == f"nats-py[nkeys]>={major}.{minor},<{major}.{minor + 1}"
    installed = tuple(int(part) for part in version("nats-py").split(".")[:2])
    assert installed == TESTED_ON, f"nats-py {version('nats-py')} installed, tested on {TESTED_ON}"


def parameters(function: object) -> list[str]:
    return list(inspect.signature(function).parameters)  # type: ignore[arg-type]


def test_the_client_methods_mended_are_nats_pys_as_known() -> None:
    expected = {
        "_build_message": BUILD_MESSAGE_PARAMETERS,
        "_process_info": ["self", "info", "initial_connection"],
        "_process_err": ["self", "err_msg"],
        "_process_pong": ["self"],
        "_process_op_err": ["self", "e"],
    }
    assert set(expected) == set(CLIENT_METHODS)
    for name, params in expected.items():
        method = inspect.getattr_static(Client, name)
        assert inspect.isfunction(method), name
        assert parameters(method) == params, name
        assert inspect.iscoroutinefunction(method) == (name != "_build_message"), name
    info = inspect.signature(Client._process_info).parameters["initial_connection"]
    assert info.default is False


def test_the_client_state_used_is_nats_pys_as_known() -> None:
    nc = Client()
    kinds = {
        "_server_info": dict,
        "_pongs": list,
        "_pongs_received": int,
        "_pings_outstanding": int,
        "_pending": list,
        "_pending_data_size": int,
        "_max_pending_size": int,
    }
    for name in (*CLIENT_STATE, *PENDING_BUFFER, *SIGNING):
        assert hasattr(nc, name), name
        if name in kinds:
            assert isinstance(getattr(nc, name), kinds[name]), name
    assert callable(nc._error_cb)
    assert nc._flush_queue is None  # made at connect, an asyncio.Queue of futures
    flusher = inspect.getsource(Client._flusher)
    assert "self._flush_queue.get()" in flusher and "self._pending" in flusher
    assert client_internals.queues_commands(nc)


def test_the_jetstream_state_used_is_nats_pys_as_known() -> None:
    nc = Client()
    js = JetStreamContext(nc)
    assert client_internals.client_of(js) is nc
    assert client_internals.api_prefix(js) == "$JS.API"
    assert client_internals.api_prefix(JetStreamContext(nc, domain="hub")) == "$JS.hub.API"
    init = inspect.getsource(JetStreamContext._init_async_reply)
    for name in JETSTREAM_STATE[2:]:
        assert f"self.{name} =" in init, name
    reply = inspect.getattr_static(JetStreamContext, "_handle_async_reply")
    assert inspect.iscoroutinefunction(reply) and parameters(reply) == ["self", "msg"]
    # The bug the mend is for: an error ack is raised, not set on the future.
    assert "raise" in inspect.getsource(nats.js.errors.APIError.from_error)


def test_the_subscription_state_used_is_nats_pys_as_known() -> None:
    async def check() -> None:
        sub = Subscription(Client(), 1, "a.b")
        assert client_internals.keeps_queue(sub)
        assert sub._pending_size == 0
        push = JetStreamContext.PushSubscription(
            JetStreamContext(Client()), sub, stream="S", consumer="C"
        )
        assert client_internals.consumer_of(push) == ("S", "C")
        watcher = KeyValue.KeyWatcher(None)
        assert client_internals.subscription_of(watcher) is None
        for name in KEY_WATCHER_STATE:
            assert hasattr(watcher, name), name

    asyncio.run(check())
    assert SUBSCRIPTION_STATE == ("_pending_queue", "_pending_size")
    assert PUSH_SUBSCRIPTION_STATE == ("_stream", "_consumer")


def test_the_patch_is_installed_at_start_up_not_at_import() -> None:
    """Importing the product changes nothing in nats-py; :func:`install` does, once, and a
    subject that is not UTF-8 then makes a message instead of an exception in the read loop."""
    script = """
import projector, projector.ops.cli, projector.nats.stream, projector.nats.connection
import projector.run.assemble, projector.run.pipeline
from nats.aio.client import Client
from projector.nats import client_internals
before = client_internals.installed()
client_internals.install()
client_internals.install()
msg = Client()._build_message(1, b"seqstate.events.ns.\\xff.0", b"", b"x", None)
print(before, client_internals.installed(), msg.subject)
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, check=True
    )
    assert done.stdout.split() == ["False", "True", "seqstate.events.ns.\ufffd.0"]


# ---- nothing outside the fence names a private attribute of nats-py --------------------------


def nats_private_names() -> set[str]:
    """Every underscored name nats-py's source defines: its methods and its attributes."""
    names: set[str] = set()
    for path in Path(nats.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                name = node.name
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                name = node.attr if node.value.id == "self" else ""
            else:
                continue
            if name.startswith("_") and not name.startswith("__"):
                names.add(name)
    return names


def nats_bases(tree: ast.Module) -> set[str]:
    """The names a module imports from nats-py (its classes, as a subclass would name them)."""
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "nats":
            imported.update(alias.asname or alias.name for alias in node.names)
    return imported


def touches(tree: ast.Module, private: set[str]) -> list[tuple[int, str]]:
    """Where ``tree`` names one of nats-py's private names on an object not its own: an
    attribute of another object (``js._nc``), of ``super()`` or of a nats-py subclass's
    ``self``, or a string handed to ``getattr`` and its kin (``"_server_info"``)."""
    found: list[tuple[int, str]] = []
    imported = nats_bases(tree)
    subclass_lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and any(
            (isinstance(b, ast.Name) and b.id in imported)
            or (isinstance(b, ast.Attribute) and ast.unparse(b).startswith("nats."))
            for b in node.bases
        ):
            subclass_lines.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in private:
            own = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
            if not own or node.lineno in subclass_lines:
                found.append((node.lineno, ast.unparse(node)))
        elif (
            isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in private
        ):
            found.append((node.lineno, repr(node.value)))
    return found


def test_no_module_outside_the_fence_touches_nats_py_private_names() -> None:
    private = nats_private_names()
    assert {"_nc", "_pending_queue", "_build_message", "_process_info"} <= private
    outside = {}
    for path in sorted((ROOT / "projector").rglob("*.py")):
        if path == FENCE:
            continue
        hits = touches(ast.parse(path.read_text()), private)
        if hits:
            outside[str(path.relative_to(ROOT))] = hits
    assert outside == {}


def test_the_scan_finds_each_kind_of_touch() -> None:
    """The scan is no check if it cannot fail: each way of touching is found."""
    private = nats_private_names()
    source = """
from nats.aio.client import Client
class Mine(Client):
    async def _process_info(self, info):
        self._server_info["x"] = 1
        await super()._process_info(info)
def f(js, sub, nc):
    js._nc.publish
    getattr(nc, "_server_info", None)
    sub._pending_size -= 1
class Own:
    def g(self):
        return self._nc
"""
    lines = [line for line, _ in touches(ast.parse(source), private)]
    assert sorted(set(lines)) == [5, 6, 8, 9, 10]  # not line 13: an object's own name
