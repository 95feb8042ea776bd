"""The live Dynamo suite's fixtures: one real fleet per test module (``make test-dynamo``).

A module's tests share its fleet (a fleet takes ~20 s to start on 2 cores), so every test uses
request ids and prompt tags of its own and leaves every gauge at zero, as it found them. The
fleet is module-scoped and async, so the module's tests and fixtures share one event loop
(``loop_scope="module"``, set by ``pytestmark`` in each module).

A fleet runs on file discovery unless its module says otherwise: ``DISCOVERIES = ("file",
"etcd")`` runs the module's tests once per discovery, each on a fleet of its own (ids
``[file]``, ``[etcd]``). ``FRONTEND_ARGS`` and ``FRONTEND_ENV`` add to every frontend's command
line and environment.

On a failure, the tail of every Dynamo process's log is attached to the report (section
"dynamo logs"); the whole logs stay under pytest's temporary directory (the path is printed
with them) until pytest prunes it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Generator, Iterator
from pathlib import Path

import nats
import pytest
import pytest_asyncio
from dynamo_kit import Capture
from fleet import Fleet, default_venv, free_ports
from live import LiveFleet
from seqstate_kit import Seqstate, lacks, running_seqstate

from projector.nats.server import NatsServer


@pytest.fixture(scope="session")
def dynamo_python() -> Path:
    """The Dynamo venv's Python; a run that asked for the live suite without one fails."""
    venv = default_venv()
    python = venv / "bin" / "python"
    if not python.exists():
        pytest.fail(
            f"no Dynamo venv at {venv}: run `make test-dynamo` (it builds one with "
            "deploy/dynamo/install_dynamo.sh), or set DYNAMO_VENV to one",
            pytrace=False,
        )
    return python


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A module's ``DISCOVERIES`` parametrize its fleet (module scope: one fleet each)."""
    discoveries = getattr(metafunc.module, "DISCOVERIES", None)
    if discoveries and "discovery" in metafunc.fixturenames:
        metafunc.parametrize("discovery", discoveries, scope="module", indirect=True)


@pytest.fixture(scope="module")
def discovery(request: pytest.FixtureRequest) -> str:
    """The fleet's discovery backend: ``file`` unless the module's ``DISCOVERIES`` say more."""
    return str(getattr(request, "param", "file"))


@pytest.fixture(scope="module")
def nats_monitor_port() -> int:
    return free_ports(1)[0]


@pytest.fixture(scope="module")
def nats_server(
    tmp_path_factory: pytest.TempPathFactory, nats_monitor_port: int
) -> Iterator[NatsServer]:
    """tests/conftest.py's server, with nats-server's HTTP monitoring on a free port as well:
    the fleet reads who subscribes to Dynamo's subjects there (``/connz``)."""
    monitor = ("-m", str(nats_monitor_port))  # on the server's host: loopback
    with NatsServer(tmp_path_factory.mktemp("jetstream"), extra_args=monitor) as server:
        yield server


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def live(
    request: pytest.FixtureRequest,
    discovery: str,
    dynamo_python: Path,
    nats_server: NatsServer,
    nats_monitor_port: int,
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[LiveFleet]:
    """nats-server (JetStream, temp store, free port), a raw capture of the endpoint's
    ``active_sequences_events``, the fleet's etcd on etcd discovery, two mockers (one dp 2),
    two frontends with replica sync (and the module's ``FRONTEND_ARGS`` and ``FRONTEND_ENV``,
    if it has any)."""
    extra: tuple[str, ...] = getattr(request.module, "FRONTEND_ARGS", ())
    env: dict[str, str] = getattr(request.module, "FRONTEND_ENV", {})
    fleet = Fleet(
        dynamo_python,
        tmp_path_factory.mktemp(f"dynamo-{discovery}"),
        nats_server.url,
        discovery,
        nats_monitor=f"http://127.0.0.1:{nats_monitor_port}",
    )
    fleet.write_model()
    nc = await nats.connect(nats_server.url, max_reconnect_attempts=0)
    capture = await Capture(nc).start()
    live = LiveFleet(fleet, capture)
    try:
        await live.start_discovery()
        await live.start_workers()
        await live.start_frontend("frontend-1", *extra, env=env)
        await live.start_frontend("frontend-2", *extra, env=env)
        yield live
    finally:
        live.stop()
        await capture.stop()
        await nc.drain()


@pytest_asyncio.fixture(loop_scope="module")
async def seqstate(
    request: pytest.FixtureRequest, live: LiveFleet, nats_server: NatsServer
) -> AsyncIterator[Seqstate]:
    """``seqstate run --dynamo-endpoint`` folding the fleet into the namespace ``dyn`` (with the
    module's ``SEQSTATE_ARGS``), started for the test and stopped after it (its JetStream state
    stays for the module's next one)."""
    args: tuple[str, ...] = getattr(request.module, "SEQSTATE_ARGS", ())
    async with running_seqstate(live, nats_server.url, args) as runner:
        yield runner


@pytest_asyncio.fixture(loop_scope="module")
async def seqstate_if_any(
    live: LiveFleet, nats_server: NatsServer
) -> AsyncIterator[Seqstate | None]:
    """The same, or None where ``seqstate run`` has no ``--dynamo-endpoint`` yet: for tests of
    Dynamo's own behaviour that also compare seqstate when they can."""
    if lacks("--dynamo-endpoint", "run"):
        yield None
        return
    async with running_seqstate(live, nats_server.url) as runner:
        yield runner


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A failed test's report carries the tail of each Dynamo process's log."""
    report = yield
    funcargs = getattr(item, "funcargs", {})
    fleet = funcargs.get("live")
    if report.failed and isinstance(fleet, LiveFleet):
        report.sections.append(("dynamo logs", fleet.fleet.tails()))
    return report
