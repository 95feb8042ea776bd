"""``projector.nats.fast_publish`` against a real nats-server: what it must keep of ``nc.publish``.

Why: ``fast_publish.publish`` writes the ``HPUB`` command itself into nats-py's private
pending buffer, so nothing in nats-py checks it for us. It claims the same guarantees as
``nc.publish`` on the same connection: the message is stored by JetStream with its
``Nats-Msg-Id`` and exact bytes, deduplicated by that id, acked on the reply subject, in order
with the connection's other publishes; TLS and credentials; the reconnect buffer (and its
limit); the max-payload and closed-connection errors. Each test here checks one of those on a
real server (nothing mocked), waits for conditions with deadlines (``eventually``), and
fails if the claim does not hold.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import ipaddress
import json
import ssl
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import nats
import nats.errors
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from eventually import eventually
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import RawStreamMsg, StorageType, StreamConfig

from projector.nats import fast_publish
from projector.nats.server import NatsServer

MSG_ID = "Nats-Msg-Id"
USER, PASSWORD = "fast", "pw-fast-7Qz3"


# ---- helpers -----------------------------------------------------------------------------------


class Scope:
    """One test's names: a stream capturing ``<tag>.events.>``, replies under ``<tag>.ack.>``."""

    def __init__(self) -> None:
        self.tag = f"fp{uuid.uuid4().hex[:12]}"
        self.stream = f"FP_{self.tag.upper()}"
        self.subject = f"{self.tag}.events.x"
        self.acks: dict[str, dict[str, Any]] = {}  # reply subject -> parsed ack

    def reply(self, i: int) -> str:
        return f"{self.tag}.ack.{i}"

    def publish(self, nc: Client, i: int) -> None:
        """Fast publish ``payload(i)``, msg-id ``<tag>-i``, replying to ``reply(i)``."""
        fast_publish.publish(nc, self.subject, payload(i), self.reply(i), f"{self.tag}-{i}")

    async def create(
        self, js: JetStreamContext, *, storage: StorageType = StorageType.MEMORY
    ) -> None:
        await js.add_stream(
            StreamConfig(name=self.stream, subjects=[f"{self.tag}.events.>"], storage=storage)
        )

    @classmethod
    async def opened(
        cls, js: JetStreamContext, nc: Client, *, storage: StorageType = StorageType.MEMORY
    ) -> Scope:
        """A scope whose stream exists and whose acks are listened to on ``nc``."""
        scope = cls()
        await scope.create(js, storage=storage)
        await scope.listen(nc)
        return scope

    async def listen(self, nc: Client) -> None:
        async def on_ack(msg: Msg) -> None:
            self.acks[msg.subject] = json.loads(msg.data)

        await nc.subscribe(f"{self.tag}.ack.>", cb=on_ack)
        await nc.flush()  # the subscription is known to the server before anything is acked

    async def all_acked(self, replies: list[str]) -> dict[str, dict[str, Any]]:
        await eventually(
            lambda: len(self.acks),
            lambda n: all(r in self.acks for r in replies),
            what=f"acks for {len(replies)} publishes",
        )
        return {r: self.acks[r] for r in replies}

    async def stored(self, js: JetStreamContext) -> list[RawStreamMsg]:
        info = await js.stream_info(self.stream)
        return [await js.get_msg(self.stream, seq) for seq in range(1, info.state.messages + 1)]


def payload(i: int) -> bytes:
    return b'{"event":%d,"pad":"%b"}' % (i, b"x" * (i % 37)) + bytes([i % 256])  # not only text


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def make_pki(out: Path) -> None:
    """ca.pem, and server.pem/server.key for 127.0.0.1 signed by it."""
    now = dt.datetime.now(dt.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(_name("fast-publish test CA"))
        .issuer_name(_name("fast-publish test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(hours=1))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name("server"))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(hours=1))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    (out / "ca.pem").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (out / "server.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (out / "server.key").write_bytes(_pem_key(key))


@pytest.fixture
def js(nc: Client) -> JetStreamContext:
    return nc.jetstream()


# ---- the tests ---------------------------------------------------------------------------------


def test_usable_with_the_installed_nats_py(nc: Client) -> None:
    assert fast_publish.usable(nc)


async def test_every_publish_is_acked_and_stored_in_order_with_its_msg_id(
    nc: Client, js: JetStreamContext
) -> None:
    scope = await Scope.opened(js, nc)
    n = 300
    ids = [f"{scope.tag}-{i}" for i in range(n)]
    out_msgs = nc.stats["out_msgs"]
    for i in range(n):
        fast_publish.publish(nc, scope.subject, payload(i), scope.reply(i), ids[i])
        if i % 64 == 63:
            await asyncio.sleep(0)
    assert nc.stats["out_msgs"] == out_msgs + n

    acks = await scope.all_acked([scope.reply(i) for i in range(n)])
    assert [acks[scope.reply(i)].get("seq") for i in range(n)] == list(range(1, n + 1))
    assert all(ack["stream"] == scope.stream and not ack.get("duplicate") for ack in acks.values())
    stored = await scope.stored(js)
    assert len(stored) == n
    assert [m.data for m in stored] == [payload(i) for i in range(n)]
    assert [(m.headers or {}).get(MSG_ID) for m in stored] == ids
    assert {m.subject for m in stored} == {scope.subject}


async def test_the_same_msg_id_twice_is_stored_once(nc: Client, js: JetStreamContext) -> None:
    scope = await Scope.opened(js, nc)
    msg_id = f"{scope.tag}-once"
    fast_publish.publish(nc, scope.subject, b"first", scope.reply(0), msg_id)
    first = (await scope.all_acked([scope.reply(0)]))[scope.reply(0)]
    fast_publish.publish(nc, scope.subject, b"second", scope.reply(1), msg_id)
    second = (await scope.all_acked([scope.reply(1)]))[scope.reply(1)]

    assert first["seq"] == 1 and not first.get("duplicate")
    assert second["seq"] == 1 and second.get("duplicate") is True
    stored = await scope.stored(js)
    assert [m.data for m in stored] == [b"first"]


async def test_a_payload_over_max_payload_raises_and_sends_nothing(
    nc: Client, js: JetStreamContext
) -> None:
    scope = await Scope.opened(js, nc)
    out_msgs, pending = nc.stats["out_msgs"], nc.pending_data_size
    with pytest.raises(nats.errors.MaxPayloadError):
        fast_publish.publish(
            nc, scope.subject, b"x" * (nc.max_payload + 1), scope.reply(0), f"{scope.tag}-big"
        )
    assert nc.stats["out_msgs"] == out_msgs and nc.pending_data_size == pending

    # Had anything reached the server, the stream would hold it (or the server would have cut
    # the connection): a small publish after it is the stream's first and only message.
    fast_publish.publish(nc, scope.subject, b"small", scope.reply(1), f"{scope.tag}-small")
    ack = (await scope.all_acked([scope.reply(1)]))[scope.reply(1)]
    assert ack["seq"] == 1
    assert nc.is_connected
    assert [m.data for m in await scope.stored(js)] == [b"small"]
    assert scope.reply(0) not in scope.acks


async def test_a_closed_connection_raises(nats_server: NatsServer) -> None:
    client = await nats.connect(nats_server.url, max_reconnect_attempts=0)
    await client.close()
    with pytest.raises(nats.errors.ConnectionClosedError):
        fast_publish.publish(client, "fp.closed", b"x", "fp.closed.ack", "closed-1")


async def test_interleaved_with_nc_and_js_publish_keeps_publish_order(
    nc: Client, js: JetStreamContext
) -> None:
    scope = await Scope.opened(js, nc)
    n = 240
    fast_replies = []
    for i in range(n):
        msg_id = f"{scope.tag}-{i}"
        kind = i % 4
        if kind in (0, 1):  # two fast publishes in a row, then one of each of nats-py's
            fast_publish.publish(nc, scope.subject, payload(i), scope.reply(i), msg_id)
            fast_replies.append(scope.reply(i))
        elif kind == 2:
            await nc.publish(
                scope.subject, payload(i), reply=scope.reply(i), headers={MSG_ID: msg_id}
            )
        else:
            ack = await js.publish(scope.subject, payload(i), headers={MSG_ID: msg_id})
            assert ack.seq == i + 1, f"js.publish #{i} stored at {ack.seq}: order lost"

    await scope.all_acked(fast_replies)
    stored = await scope.stored(js)
    assert [m.data for m in stored] == [payload(i) for i in range(n)]
    assert [(m.headers or {}).get(MSG_ID) for m in stored] == [f"{scope.tag}-{i}" for i in range(n)]


# ---- TLS and credentials -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[NatsServer, Path]]:
    """A server that requires TLS and a user with a password; and the directory with ca.pem."""
    pki = tmp_path_factory.mktemp("fast-publish-pki")
    make_pki(pki)
    tls = {"cert_file": str(pki / "server.pem"), "key_file": str(pki / "server.key")}
    conf = pki / "server.conf"
    conf.write_text(
        f"tls {json.dumps(tls)}\nauthorization {json.dumps({'user': USER, 'password': PASSWORD})}\n"
    )
    store = tmp_path_factory.mktemp("fast-publish-tls-js")
    with NatsServer(store, extra_args=("-c", str(conf))) as server:
        yield server, pki


@pytest.fixture
async def tls_nc(tls_server: tuple[NatsServer, Path]) -> AsyncIterator[Client]:
    server, pki = tls_server
    context = ssl.create_default_context(cafile=str(pki / "ca.pem"))
    client = await nats.connect(
        f"tls://127.0.0.1:{server.port}",
        tls=context,
        user=USER,
        password=PASSWORD,
        max_reconnect_attempts=0,
    )
    try:
        yield client
    finally:
        await client.drain()


async def test_the_server_refuses_a_client_without_tls_or_password(
    tls_server: tuple[NatsServer, Path],
) -> None:
    """The fixture really demands both; else the test below would prove nothing about them."""
    server, pki = tls_server
    context = ssl.create_default_context(cafile=str(pki / "ca.pem"))
    attempts: list[dict[str, Any]] = [
        {"servers": f"nats://{USER}:{PASSWORD}@127.0.0.1:{server.port}"},  # no TLS
        {"servers": f"tls://127.0.0.1:{server.port}", "tls": context},  # no password
    ]
    for options in attempts:
        with pytest.raises(Exception):  # noqa: B017 - nats-py raises several kinds
            client = await nats.connect(
                **options, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=3
            )
            await client.close()


async def test_over_tls_with_a_password_publishes_are_stored_and_acked(
    tls_nc: Client,
) -> None:
    assert fast_publish.usable(tls_nc)
    assert tls_nc.ssl_context is not None and tls_nc.connected_url is not None
    assert tls_nc.connected_url.scheme == "tls"
    js = tls_nc.jetstream()
    scope = await Scope.opened(js, tls_nc)
    n = 100
    for i in range(n):
        scope.publish(tls_nc, i)
    acks = await scope.all_acked([scope.reply(i) for i in range(n)])
    assert sorted(ack["seq"] for ack in acks.values()) == list(range(1, n + 1))
    stored = await scope.stored(js)
    assert [m.data for m in stored] == [payload(i) for i in range(n)]


# ---- reconnect ---------------------------------------------------------------------------------


@pytest.fixture
async def restartable(tmp_path: Path) -> AsyncIterator[NatsServer]:
    """A server of this test's own, on a file store, so the test may stop and restart it."""
    server = NatsServer(tmp_path / "js")
    await asyncio.to_thread(server.start)
    try:
        yield server
    finally:
        await asyncio.to_thread(server.stop)


async def _restart(server: NatsServer) -> NatsServer:
    """The same port and store, a new process: what a client sees as a server restart."""
    again = NatsServer(server.store_dir, port=server.port)
    await asyncio.to_thread(again.start)
    return again


async def _stop_and_wait_reconnecting(server: NatsServer, client: Client) -> None:
    await asyncio.to_thread(server.stop)
    await eventually(lambda: client.is_reconnecting, what="the client noticed the server left")


async def test_publishes_while_reconnecting_are_stored_after_the_restart(
    restartable: NatsServer,
) -> None:
    client = await nats.connect(
        restartable.url, reconnect_time_wait=0.05, max_reconnect_attempts=-1
    )
    again: NatsServer | None = None
    try:
        js = client.jetstream()
        scope = await Scope.opened(js, client, storage=StorageType.FILE)
        before, during = 20, 50
        for i in range(before):
            scope.publish(client, i)
        await scope.all_acked([scope.reply(i) for i in range(before)])

        await _stop_and_wait_reconnecting(restartable, client)
        for i in range(before, before + during):
            scope.publish(client, i)
        assert client.pending_data_size > 0  # held by the client, the server being away
        again = await _restart(restartable)

        await _all_stored_in_order(scope, js, before + during)
        assert client.stats["reconnects"] >= 1
    finally:
        await client.close()
        if again is not None:
            await asyncio.to_thread(again.stop)


async def _all_stored_in_order(scope: Scope, js: JetStreamContext, count: int) -> None:
    """The first ``count`` publishes of ``scope`` acked at sequences 1..count and stored so."""
    acks = await scope.all_acked([scope.reply(i) for i in range(count)])
    assert [acks[scope.reply(i)]["seq"] for i in range(count)] == list(range(1, count + 1))
    stored = await scope.stored(js)
    assert [m.data for m in stored] == [payload(i) for i in range(count)]


async def test_a_full_reconnect_buffer_raises_and_keeps_what_it_held(
    restartable: NatsServer,
) -> None:
    limit = 4096
    client = await nats.connect(
        restartable.url, reconnect_time_wait=0.05, max_reconnect_attempts=-1, pending_size=limit
    )
    again: NatsServer | None = None
    try:
        js = client.jetstream()
        scope = await Scope.opened(js, client, storage=StorageType.FILE)
        await _stop_and_wait_reconnecting(restartable, client)

        held = 0
        with pytest.raises(nats.errors.OutboundBufferLimitError):
            for i in range(10_000):
                scope.publish(client, i)
                held += 1
        assert 0 < held < 10_000
        assert client.pending_data_size <= limit
        again = await _restart(restartable)

        await _all_stored_in_order(scope, js, held)
    finally:
        await client.close()
        if again is not None:
            await asyncio.to_thread(again.stop)


async def test_with_buffering_disabled_a_publish_while_reconnecting_raises(
    restartable: NatsServer,
) -> None:
    client = await nats.connect(
        restartable.url, reconnect_time_wait=0.05, max_reconnect_attempts=-1, pending_size=0
    )
    try:
        await _stop_and_wait_reconnecting(restartable, client)
        with pytest.raises(nats.errors.OutboundBufferLimitError):
            await client.publish("fp.off", b"x", reply="fp.off.ack", headers={MSG_ID: "off-0"})
        with pytest.raises(nats.errors.OutboundBufferLimitError):
            fast_publish.publish(client, "fp.off", b"x", "fp.off.ack", "off-1")
    finally:
        # What fast_publish buffered is written to the dead socket on close: not this test's.
        with contextlib.suppress(ConnectionError):
            await client.close()


# ---- where it falls short of the server's own limits -------------------------------------------


async def test_a_payload_that_fits_only_without_its_header_raises(
    nats_server: NatsServer,
) -> None:
    client = await nats.connect(nats_server.url, max_reconnect_attempts=0)
    try:
        msg_id = "fits-without-header"
        with pytest.raises(nats.errors.MaxPayloadError):
            fast_publish.publish(
                client, "fp.limit", b"x" * client.max_payload, "fp.limit.ack", msg_id
            )
    finally:
        with contextlib.suppress(ConnectionError):
            await client.close()


async def test_a_msg_id_cannot_add_a_header(nc: Client, js: JetStreamContext) -> None:
    scope = Scope()
    await scope.create(js)
    with pytest.raises(ValueError, match="line break"):
        fast_publish.publish(nc, scope.subject, b"x", scope.reply(0), "id\r\nX-Injected: 1")
    for bad in ("", "a b", "a\tb"):
        with pytest.raises(nats.errors.BadSubjectError):
            fast_publish.publish(nc, bad or "", b"x", scope.reply(0), "id")
    with pytest.raises(nats.errors.BadSubjectError):
        fast_publish.publish(nc, scope.subject, b"x", "re ply", "id")
    await scope.listen(nc)
    fast_publish.publish(nc, scope.subject, b"x", scope.reply(1), "id-1")
    await scope.all_acked([scope.reply(1)])
    (stored,) = await scope.stored(js)  # only the good one was sent
    assert set((stored.headers or {}).keys()) == {MSG_ID}
