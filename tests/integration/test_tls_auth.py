"""A server that requires TLS and credentials: nothing shows a secret, everything speaks TLS.

The CA and the certificates are made here, once per module; the servers are real nats-servers
started from a config file. The password server also asks for a client certificate, so the replay
reader must present the same one nats-py does.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import ipaddress
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from log_text import plain_lines
from nats.aio.client import Client
from pipeline_kit import fill, fresh_config

from projector.nats.connection import connect
from projector.nats.server import NatsServer
from projector.nats.stream_reader import ReaderParams
from projector.settings.config import Config, ConfigError
from projector.settings.redaction import redact, scrub
from projector.write.log_fold import fold_stream

REPO = Path(__file__).resolve().parents[2]
USER, PASSWORD, TOKEN = "alice", "pw-9f3Kq27xWv", "tok-Zx81mQp4Lr"
HOLD = 30  # a generous bound on any one command: a hang fails the test instead of the run


# ---- certificates and servers ------------------------------------------------------------------


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _certificate(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: tuple[x509.Name, Any],
    *,
    ca: bool = False,
    hosts: bool = False,
    client: bool = False,
) -> x509.Certificate:
    now = dt.datetime.now(dt.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer[0])
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(hours=1))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if hosts:
        names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    if client:
        usage = x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH])
        builder = builder.add_extension(usage, critical=False)
    return builder.sign(issuer[1], hashes.SHA256())


def _write(path: Path, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> None:
    path.with_suffix(".pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    path.with_suffix(".key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ca.pem; server.pem/.key for 127.0.0.1 and localhost; client.pem/.key."""
    out = tmp_path_factory.mktemp("pki")
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _certificate("seqstate test CA", ca_key, (_name("seqstate test CA"), ca_key), ca=True)
    _write(out / "ca", ca, ca_key)
    for name, kind in (("server", {"hosts": True}), ("client", {"client": True})):
        key = ec.generate_private_key(ec.SECP256R1())
        _write(out / name, _certificate(name, key, (ca.subject, ca_key), **kind), key)
    return out


def _server(tmp: Path, pki: Path, authorization: dict[str, str], *, verify: bool) -> NatsServer:
    tls = {"cert_file": str(pki / "server.pem"), "key_file": str(pki / "server.key"), "timeout": 5}
    if verify:  # a client certificate signed by the CA is required
        tls.update(ca_file=str(pki / "ca.pem"), verify=True)
    conf = tmp / "server.conf"
    conf.write_text(f"tls {json.dumps(tls)}\nauthorization {json.dumps(authorization)}\n")
    return NatsServer(tmp / "jetstream", extra_args=("-c", str(conf)))


@pytest.fixture(scope="module")
def password_server(tmp_path_factory: pytest.TempPathFactory, pki: Path) -> Iterator[NatsServer]:
    """TLS with a client certificate, and a user with a password."""
    tmp = tmp_path_factory.mktemp("password-server")
    with _server(tmp, pki, {"user": USER, "password": PASSWORD}, verify=True) as server:
        yield server


@pytest.fixture(scope="module")
def token_server(tmp_path_factory: pytest.TempPathFactory, pki: Path) -> Iterator[NatsServer]:
    """TLS, and a token."""
    tmp = tmp_path_factory.mktemp("token-server")
    with _server(tmp, pki, {"token": TOKEN}, verify=False) as server:
        yield server


def password_url(server: NatsServer, password: str = PASSWORD) -> str:
    return f"nats://{USER}:{password}@127.0.0.1:{server.port}"


def token_url(server: NatsServer, scheme: str = "nats", host: str = "127.0.0.1") -> str:
    return f"{scheme}://{TOKEN}@{host}:{server.port}"


def tls_env(pki: Path, *, ca: bool = True) -> dict[str, str]:
    env = {
        "SEQSTATE_TLS_CERT": str(pki / "client.pem"),
        "SEQSTATE_TLS_KEY": str(pki / "client.key"),
    }
    return {**env, "SEQSTATE_TLS_CA": str(pki / "ca.pem")} if ca else env


def tls_config(pki: Path) -> Config:
    return fresh_config(
        "tls",
        tls_ca=str(pki / "ca.pem"),
        tls_cert=str(pki / "client.pem"),
        tls_key=str(pki / "client.key"),
    )


@pytest.fixture
async def tnc(password_server: NatsServer, pki: Path) -> AsyncIterator[Client]:
    """A client of the password server, connected as the CLI connects."""
    async with connect(
        password_url(password_server), service=False, config=Config.from_env(tls_env(pki))
    ) as nc:
        yield nc


# ---- the command line --------------------------------------------------------------------------


def seqstate(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {
        k: v for k, v in os.environ.items() if k != "NATS_URL" and not k.startswith("SEQSTATE_")
    }
    clean["COLUMNS"] = "400"  # one log record, one line
    return subprocess.run(
        [sys.executable, "-m", "projector", *args],
        capture_output=True,
        text=True,
        timeout=HOLD,
        env={**clean, **env},
        cwd=REPO,
    )


def one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode != 0
    lines = plain_lines(result.stderr)
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("seqstate: error: ")
    assert result.stdout == ""
    return lines[0]


def test_status_over_tls_shows_the_server_without_the_password(
    password_server: NatsServer, pki: Path
) -> None:
    for extra in ((), ("--json",)):
        result = seqstate("status", *extra, NATS_URL=password_url(password_server), **tls_env(pki))
        assert result.returncode == 0, result.stderr
        assert f"{USER}:***@127.0.0.1:{password_server.port}" in result.stdout
        assert PASSWORD not in result.stdout + result.stderr


def test_status_with_a_token_hides_the_token(token_server: NatsServer, pki: Path) -> None:
    result = seqstate(
        "status", NATS_URL=token_url(token_server), SEQSTATE_TLS_CA=str(pki / "ca.pem")
    )
    assert result.returncode == 0, result.stderr
    assert f"on ***@127.0.0.1:{token_server.port}" in result.stdout
    assert TOKEN not in result.stdout + result.stderr


def test_run_logs_the_server_without_the_password(
    password_server: NatsServer, pki: Path, tmp_path: Path
) -> None:
    config = fresh_config("run")
    result = seqstate(
        "run",
        "--duration",
        "3",
        "--store-dir",
        str(tmp_path),
        "--namespace",
        config.namespace,
        "--events-stream",
        config.events_stream,
        "--deltas-stream",
        config.deltas_stream,
        "--registry-bucket",
        config.registry_bucket,
        NATS_URL=password_url(password_server),
        **tls_env(pki),
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout + result.stderr
    assert f"running for namespace {config.namespace!r} at nats://{USER}:***@127.0.0.1" in out
    assert PASSWORD not in out


def test_a_wrong_password_fails_in_one_line_saying_so(
    password_server: NatsServer, pki: Path
) -> None:
    wrong = "not-the-pw-4471"
    result = seqstate("status", NATS_URL=password_url(password_server, wrong), **tls_env(pki))
    line = one_line_error(result)
    assert "authorization violation" in line
    assert f"{USER}:***@127.0.0.1" in line
    assert wrong not in result.stderr


def test_an_untrusted_certificate_fails_in_one_line(password_server: NatsServer, pki: Path) -> None:
    # Before the fix this hung for as long as anyone waited (HOLD ends the test instead).
    result = seqstate("status", NATS_URL=password_url(password_server), **tls_env(pki, ca=False))
    line = one_line_error(result)
    assert "certificate" in line and "not trusted" in line and "SEQSTATE_TLS_CA" in line
    assert PASSWORD not in result.stderr


def test_tls_settings_are_checked_and_named(pki: Path) -> None:
    with pytest.raises(
        ConfigError,
        match=r"^SEQSTATE_TLS_CERT='.*client\.pem': a client "
        r"certificate needs both: set --tls-key or SEQSTATE_TLS_KEY too$",
    ):
        Config.from_env({"SEQSTATE_TLS_CERT": str(pki / "client.pem")})
    with pytest.raises(ConfigError, match=r"SEQSTATE_TLS_CA='/nonexistent/ca\.pem': no such file"):
        Config.from_env({"SEQSTATE_TLS_CA": "/nonexistent/ca.pem"})
    line = one_line_error(
        seqstate("status", NATS_URL="nats://127.0.0.1:1", SEQSTATE_TLS_KEY=str(pki / "client.key"))
    )
    assert "SEQSTATE_TLS_CERT" in line


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("nats://alice:S3cret@host:4222", "nats://alice:***@host:4222"),
        ("nats://s3cr3t-token@host", "nats://***@host"),
        ("alice:S3cret@host:4222", "alice:***@host:4222"),
        (
            "tls://a:S3cret@h1:4222,tls://a:S3cret@h2:4222",
            "tls://a:***@h1:4222,tls://a:***@h2:4222",
        ),
        ("nats://a:p@ss@host", "nats://a:***@host"),
        ("nats://host:4222", "nats://host:4222"),
    ],
)
def test_redact_hides_passwords_and_tokens(url: str, shown: str) -> None:
    assert redact(url) == shown
    assert scrub(f"failed on {url}", url) == f"failed on {shown}"


# ---- the replay reader -------------------------------------------------------------------------


def record_fast_fold(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, str | None]]:
    """What each fast_fold of fold_stream returned: (last sequence fed, why it gave up)."""
    from projector.write import log_fold as replay

    returned: list[tuple[int, str | None]] = []
    real = replay.fast_fold

    async def spy(*args: Any, **kwargs: Any) -> tuple[int, str | None]:
        result = await real(*args, **kwargs)
        returned.append(result)
        return result

    monkeypatch.setattr(replay, "fast_fold", spy)
    return returned


def record_reader_argv(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """The command line of each process the reader's parent starts, as ``ps`` shows it."""
    seen: list[bytes] = []
    real = asyncio.create_subprocess_exec

    async def spy(*args: Any, **kwargs: Any) -> asyncio.subprocess.Process:
        proc = await real(*args, **kwargs)
        # It waits for its settings on stdin, so it is alive and exec'd here.
        seen.append(Path(f"/proc/{proc.pid}/cmdline").read_bytes())
        return proc

    monkeypatch.setattr(asyncio, "create_subprocess_exec", spy)
    return seen


async def both_paths(nc: Client, config: Config, last: int) -> tuple[bytes, bytes]:
    """The state folded through the fast reader, and through nats-py."""
    snapshots = []
    for fast in (True, False):
        state = config.new_state()
        counts = await fold_stream(nc, config, state, start_seq=1, end_seq=last, fast=fast)
        assert counts == (1, last, last, 1)
        snapshots.append(state.snapshot())
    return snapshots[0], snapshots[1]


async def test_a_replay_over_tls_with_a_password_uses_the_fast_reader(
    tnc: Client, pki: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tls_config(pki)
    last = await fill(tnc, config, 6000)
    returned = record_fast_fold(monkeypatch)
    argv = record_reader_argv(monkeypatch)
    fast, client = await both_paths(tnc, config, last)
    assert returned == [(last, None)]  # the reader did it all, over TLS with a client cert
    assert fast == client
    assert len(argv) == 1 and b"projector.nats.stream_reader" in argv[0]
    for secret in (PASSWORD, USER, "127.0.0.1", "nats://", "@"):
        assert secret.encode() not in argv[0]


async def test_a_replay_with_a_token_uses_the_fast_reader(
    token_server: NatsServer, pki: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tls = Config(tls_ca=str(pki / "ca.pem"))
    # tls:// and a host name this time: the reader checks the name the certificate carries.
    async with connect(
        token_url(token_server, "tls", "localhost"), service=False, config=tls
    ) as nc:
        config = fresh_config("tok", tls_ca=tls.tls_ca)
        last = await fill(nc, config, 500)
        returned = record_fast_fold(monkeypatch)
        argv = record_reader_argv(monkeypatch)
        fast, client = await both_paths(nc, config, last)
    assert returned == [(last, None)]
    assert fast == client
    assert TOKEN.encode() not in argv[0]


async def test_a_reader_refused_by_the_server_falls_back(
    tnc: Client, pki: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tls_config(pki)
    last = await fill(tnc, config, 300)
    returned = record_fast_fold(monkeypatch)
    # nats-py's options win over the URL, for the client as for the reader: this one is wrong.
    monkeypatch.setitem(tnc.options, "user", USER)
    monkeypatch.setitem(tnc.options, "password", "not-the-pw-4471")
    fast, client = await both_paths(tnc, config, last)
    assert fast == client  # nats-py did the work
    [(fed, why)] = returned
    assert fed == 0 and why is not None and "Authorization Violation" in why
    assert "not-the-pw-4471" not in why


def run_reader(params: ReaderParams) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "projector.nats.stream_reader"],
        input=msgspec.json.encode(params) + b"\n",
        capture_output=True,
        timeout=HOLD,
        cwd=REPO,
    )


@pytest.mark.parametrize(
    ("case", "why"),
    [
        ("wrong password", b"-ERR 'Authorization Violation'"),
        ("no CA", b"certificate verify failed"),
        ("no client certificate", b"stream reader: "),
        # Told the client is plain, it still upgrades as the server's INFO asks (or the server
        # would close on it); the -ERR is for the subject, after a sound handshake.
        ("plain, bad subject", b"-ERR 'Invalid Subject'"),
    ],
)
def test_the_reader_ends_with_a_reason_whatever_goes_wrong(
    password_server: NatsServer, pki: Path, case: str, why: bytes
) -> None:
    fields: dict[str, Any] = {
        "host": "127.0.0.1",
        "port": password_server.port,
        "inbox": "_INBOX.x",
        "end_seq": 9,
        "tls": True,
        "user": USER,
        "password": PASSWORD,
        "ca": str(pki / "ca.pem"),
        "cert": str(pki / "client.pem"),
        "key": str(pki / "client.key"),
    }
    fields.update(
        {
            "wrong password": {"password": "not-the-pw-4471"},
            "no CA": {"ca": None},
            "no client certificate": {"cert": None, "key": None},
            "plain, bad subject": {"tls": False, "inbox": "a..b"},
        }[case]
    )
    result = run_reader(ReaderParams(**fields))
    assert result.returncode == 3 and result.stdout == b"", result.stderr
    assert result.stderr.startswith(b"stream reader: ") and result.stderr.count(b"\n") == 1
    assert why in result.stderr, result.stderr
    assert PASSWORD.encode() not in result.stderr


# ---- credentials from settings (--nats-user/--nats-password, --nats-token, nkeys, creds) ------


def plain_url(server: NatsServer) -> str:
    return f"nats://127.0.0.1:{server.port}"


def nkey_pair() -> tuple[str, str]:
    """A fresh NKEY user: (seed, public key)."""
    import nkeys  # type: ignore[import-untyped]

    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER).decode()
    kp = nkeys.from_seed(bytearray(seed.encode()))
    return seed, kp.public_key.decode()


@pytest.fixture(scope="module")
def nkey_user(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[NatsServer, Path, str]]:
    """A plain server with one nkey user: (server, its seed file, the seed)."""
    tmp = tmp_path_factory.mktemp("nkey-server")
    seed, public = nkey_pair()
    (tmp / "user.nk").write_text(seed + "\n")
    conf = tmp / "server.conf"
    conf.write_text(f"authorization {{ users = [ {{ nkey: {public} }} ] }}\n")
    with NatsServer(tmp / "jetstream", extra_args=("-c", str(conf))) as server:
        yield server, tmp / "user.nk", seed


def test_status_signs_in_with_the_settings_and_shows_no_secret(
    password_server: NatsServer, token_server: NatsServer, pki: Path
) -> None:
    result = seqstate(
        "status",
        NATS_URL=plain_url(password_server),
        SEQSTATE_NATS_USER=USER,
        SEQSTATE_NATS_PASSWORD=PASSWORD,
        **tls_env(pki),
    )
    assert result.returncode == 0, result.stderr
    assert PASSWORD not in result.stdout + result.stderr
    result = seqstate(
        "status",
        "--json",
        NATS_URL=plain_url(token_server),
        SEQSTATE_NATS_TOKEN=TOKEN,
        SEQSTATE_TLS_CA=str(pki / "ca.pem"),
    )
    assert result.returncode == 0, result.stderr
    assert TOKEN not in result.stdout + result.stderr


def test_a_wrong_password_in_the_settings_fails_in_one_line(
    password_server: NatsServer, pki: Path
) -> None:
    wrong = "not-the-pw-8812"
    result = seqstate(
        "status",
        "--nats-user",
        USER,
        NATS_URL=plain_url(password_server),
        SEQSTATE_NATS_PASSWORD=wrong,
        **tls_env(pki),
    )
    line = one_line_error(result)
    assert "refused the credentials" in line
    assert wrong not in result.stderr


def test_no_credentials_names_the_settings_that_give_them(
    password_server: NatsServer, pki: Path
) -> None:
    line = one_line_error(seqstate("status", NATS_URL=plain_url(password_server), **tls_env(pki)))
    assert "requires credentials" in line
    assert "SEQSTATE_NATS_USER" in line and "SEQSTATE_NATS_CREDS" in line


def test_help_and_config_errors_show_no_secret() -> None:
    env = {"SEQSTATE_NATS_PASSWORD": PASSWORD, "SEQSTATE_NATS_TOKEN": TOKEN}
    for command in ("run", "writer", "projector", "status", "replay"):
        result = seqstate(command, "--help", **env)
        assert result.returncode == 0
        assert "--nats-password SECRET" in result.stdout and "--nats-creds PATH" in result.stdout
        assert PASSWORD not in result.stdout and TOKEN not in result.stdout
    # A password without a user, two ways to sign in: named, never shown.
    for bad in (
        {"SEQSTATE_NATS_PASSWORD": PASSWORD},
        {
            "SEQSTATE_NATS_USER": USER,
            "SEQSTATE_NATS_PASSWORD": PASSWORD,
            "SEQSTATE_NATS_TOKEN": TOKEN,
        },
    ):
        line = one_line_error(seqstate("status", NATS_URL="nats://127.0.0.1:1", **bad))
        assert "SEQSTATE_NATS_" in line and PASSWORD not in line and TOKEN not in line
    config = Config(nats_user=USER, nats_password=PASSWORD)
    assert PASSWORD not in repr(config) and TOKEN not in repr(Config(nats_token=TOKEN))


def test_bad_credential_files_fail_in_one_line_without_their_content(tmp_path: Path) -> None:
    seed, _ = nkey_pair()
    cases = {
        "SEQSTATE_NATS_NKEY_SEED": ("not a seed\n", "not an NKEY user seed file"),
        "SEQSTATE_NATS_CREDS": (
            f"-----BEGIN USER NKEY SEED-----\n{seed}\n------END USER NKEY SEED------\n",
            "not a NATS credentials file",
        ),
    }
    for variable, (content, problem) in cases.items():
        path = tmp_path / variable
        path.write_text(content)
        line = one_line_error(
            seqstate("status", NATS_URL="nats://127.0.0.1:1", **{variable: str(path)})
        )
        assert f"{variable}={path}: {problem}" in line
        assert seed not in line
        missing = one_line_error(
            seqstate(
                "status", NATS_URL="nats://127.0.0.1:1", **{variable: str(tmp_path / "absent")}
            )
        )
        assert "no such file" in missing


def test_a_well_formed_creds_file_becomes_nats_py_user_credentials(tmp_path: Path) -> None:
    from projector.nats.security import auth_options, config_secrets

    seed, _ = nkey_pair()
    jwt = "eyJ0eXAiOiJKV1QifQ.eyJzdWIiOiJVQUJDIn0.c2lnbmF0dXJl"
    creds = tmp_path / "user.creds"
    creds.write_text(
        f"-----BEGIN NATS USER JWT-----\n{jwt}\n------END NATS USER JWT------\n\n"
        "************************* IMPORTANT *************************\n\n"
        f"-----BEGIN USER NKEY SEED-----\n{seed}\n"
        "------END USER NKEY SEED------\n"
    )
    config = Config(nats_creds=str(creds))
    assert auth_options(config) == {"user_credentials": str(creds)}
    assert config_secrets(config) == {jwt, seed}


@pytest.mark.parametrize(
    "text",
    [
        "failed: nats://alice:{pw}@h:4222 and {pw}",
        "jwt eyJ0eXAiOiJKV1QifQ.eyJzdWIiOiJVIn0.c2ln in a message",
        "seed {seed} in a message",
    ],
)
def test_scrub_hides_setting_secrets_seeds_and_jwts(text: str) -> None:
    seed, _ = nkey_pair()
    text = text.format(pw=PASSWORD, seed=seed)
    shown = scrub(text, "nats://127.0.0.1:4222", {PASSWORD})
    assert PASSWORD not in shown and seed not in shown and "eyJ0eXAi" not in shown
    assert "***" in shown


async def test_a_replay_signed_in_by_the_settings_uses_the_fast_reader(
    password_server: NatsServer, pki: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = fresh_config(
        "cfgauth",
        nats_user=USER,
        nats_password=PASSWORD,
        tls_ca=str(pki / "ca.pem"),
        tls_cert=str(pki / "client.pem"),
        tls_key=str(pki / "client.key"),
    )
    async with connect(plain_url(password_server), service=False, config=config) as nc:
        last = await fill(nc, config, 500)
        returned = record_fast_fold(monkeypatch)
        argv = record_reader_argv(monkeypatch)
        fast, client = await both_paths(nc, config, last)
    assert returned == [(last, None)]
    assert fast == client
    assert PASSWORD.encode() not in argv[0]


async def test_an_nkey_seed_signs_in_and_the_replay_falls_back_to_nats_py(
    nkey_user: tuple[NatsServer, Path, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    server, seed_file, seed = nkey_user
    result = seqstate("status", NATS_URL=server.url, SEQSTATE_NATS_NKEY_SEED=str(seed_file))
    assert result.returncode == 0, result.stderr
    assert seed not in result.stdout + result.stderr
    line = one_line_error(seqstate("status", NATS_URL=server.url))
    assert "requires credentials" in line
    config = fresh_config("nk", nats_nkey_seed=str(seed_file))
    async with connect(server.url, service=False, config=config) as nc:
        last = await fill(nc, config, 300)
        returned = record_fast_fold(monkeypatch)
        fast, client = await both_paths(nc, config, last)
    assert fast == client  # nats-py did the work: the reader cannot sign a nonce
    [(fed, why)] = returned
    assert fed == 0 and why is not None and "nkeys" in why


# ---- a list of servers (the NATS convention for a cluster) -------------------------------------


def test_a_comma_separated_server_list_connects_and_is_redacted(
    password_server: NatsServer, pki: Path
) -> None:
    dead = f"nats://{USER}:{PASSWORD}@127.0.0.1:1"  # nothing listens: nats-py tries the next
    for url in (
        f"{dead},{password_url(password_server)}",
        f"{password_url(password_server)} , {dead}",
    ):
        result = seqstate("status", NATS_URL=url, **tls_env(pki))
        assert result.returncode == 0, result.stderr
        assert f"{USER}:***@127.0.0.1:{password_server.port}" in result.stdout
        assert PASSWORD not in result.stdout + result.stderr
    settings = {"SEQSTATE_NATS_USER": USER, "SEQSTATE_NATS_PASSWORD": PASSWORD}
    plain = f"nats://127.0.0.1:1,{plain_url(password_server)}"
    result = seqstate("status", NATS_URL=plain, **settings, **tls_env(pki))
    assert result.returncode == 0, result.stderr


def test_every_server_of_a_list_is_validated_without_showing_secrets() -> None:
    for flag in (False, True):
        url = f"nats://{USER}:{PASSWORD}@h1:4222,nats://{USER}:{PASSWORD}@bad host:4222"
        result = seqstate("status", "--nats-url", url) if flag else seqstate("status", NATS_URL=url)
        line = one_line_error(result)
        assert "is not a NATS URL" in line and f"{USER}:***@bad host" in line
        assert PASSWORD not in line


# ---- TLS means TLS: never a fallback to cleartext ----------------------------------------------


@contextlib.asynccontextmanager
async def plain_impostor() -> AsyncIterator[tuple[int, bytearray]]:
    """A listener that answers as a plain nats-server does (an INFO offering no TLS, asking
    for credentials) and keeps every byte a client sends it: (its port, what it heard)."""
    heard = bytearray()
    port = 0

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        info = {
            "server_id": "IMPOSTOR",
            "version": "2.15.1",
            "proto": 1,
            "host": "127.0.0.1",
            "port": port,
            "headers": True,
            "max_payload": 1048576,
            "auth_required": True,
        }
        writer.write(b"INFO " + json.dumps(info).encode() + b"\r\n")
        try:
            await writer.drain()
            while data := await reader.read(65536):
                heard.extend(data)
                if b"PING\r\n" in data:  # as a server would: a client that signed in goes on
                    writer.write(b"PONG\r\n")
                    await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        yield port, heard


def tls_cases(pki: Path, port: int) -> list[tuple[str, str, dict[str, str]]]:
    """(command, NATS_URL, settings): each asks for TLS its own way, each with a password."""
    signed_in = {"SEQSTATE_NATS_USER": USER, "SEQSTATE_NATS_PASSWORD": PASSWORD}
    ca = {"SEQSTATE_TLS_CA": str(pki / "ca.pem")}
    return [
        ("status", f"tls://{USER}:{PASSWORD}@127.0.0.1:{port}", ca),  # a tls:// URL with a password
        ("status", f"tls://{USER}:{PASSWORD}@127.0.0.1:{port}", {}),  # the system's CAs
        ("status", f"nats://{USER}:{PASSWORD}@127.0.0.1:{port}", ca),  # a TLS setting
        ("status", f"nats://127.0.0.1:{port}", {**signed_in, **tls_env(pki)}),  # a client cert
        ("writer", f"tls://127.0.0.1:{port}", {**signed_in, **ca}),  # a service: not retried
    ]


async def test_tls_asked_for_never_falls_back_to_cleartext(pki: Path) -> None:
    # Before the fix nats-py took the server's word (its INFO had no tls_required) and sent
    # CONNECT, the password in it, in cleartext.
    async with plain_impostor() as (port, heard):
        for command, url, settings in tls_cases(pki, port):
            result = await asyncio.to_thread(seqstate, command, NATS_URL=url, **settings)
            line = one_line_error(result)
            assert f"127.0.0.1:{port} offers no TLS" in line, line
            assert "not connecting in cleartext" in line, line
            assert PASSWORD not in result.stderr
            assert PASSWORD.encode() not in heard, (command, url, bytes(heard))
            assert b"CONNECT" not in heard, (command, url, bytes(heard))


def test_tls_against_a_real_plain_server_is_one_line(nats_server: NatsServer, pki: Path) -> None:
    for url, settings in [
        (f"tls://127.0.0.1:{nats_server.port}", {"SEQSTATE_TLS_CA": str(pki / "ca.pem")}),
        (f"nats://127.0.0.1:{nats_server.port}", tls_env(pki)),
    ]:
        line = one_line_error(seqstate("status", NATS_URL=url, **settings))
        assert f"NATS at {url} offers no TLS" in line, line
    # Without any TLS asked for, the same server serves as it always did.
    result = seqstate("status", NATS_URL=f"nats://127.0.0.1:{nats_server.port}")
    assert result.returncode == 0, result.stderr
