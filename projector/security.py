"""Secrets in NATS URLs and the TLS settings: what may be shown, and whom a connection trusts.

A NATS URL may carry a password (``nats://user:password@host``) or a token
(``nats://token@host``), and ``NATS_URL`` may list several servers separated by commas. Whatever
is shown to a person (logs, ``seqstate status``, errors) goes through :func:`redact`; free text
that might quote a secret (an error from the client) goes through :func:`scrub`.

nats-py and the replay reader build their TLS context here from the same ``tls_*`` settings,
so the two connections trust the same CA and present the same client certificate.
"""

from __future__ import annotations

import os
import re
import ssl
from collections.abc import Mapping
from urllib.parse import unquote

from projector.config import Config, ConfigError

MASK = "***"
_URL_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<userinfo>[^\s/@,]+)@")


def server_urls(url: str) -> list[str]:
    """The servers a URL lists: comma-separated, as the other NATS clients accept."""
    return [part.strip() for part in url.split(",") if part.strip()]


def _userinfo(server: str) -> tuple[str, str, str]:
    """``(scheme://, userinfo, @host:port)``; userinfo is empty when the URL has none."""
    start = server.find("://") + 3 if "://" in server else 0
    at = server.rfind("@")
    if at < start:
        return server, "", ""
    return server[:start], server[start:at], server[at:]


def _masked(userinfo: str) -> str:
    """Keep a user name (it helps tell accounts apart); hide a password or a token."""
    user, colon, _ = userinfo.partition(":")
    return f"{user}:{MASK}" if colon else MASK


def redact(url: str) -> str:
    """``url`` (a server list, one URL, or a bare ``user:pass@host:port``) without secrets."""
    shown = []
    for server in url.split(","):
        head, userinfo, tail = _userinfo(server)
        shown.append(f"{head}{_masked(userinfo)}{tail}" if userinfo else server)
    return ",".join(shown)


def secrets_in(url: str) -> set[str]:
    """The passwords and tokens in ``url``, as written and percent-decoded."""
    found: set[str] = set()
    for server in server_urls(url):
        _, userinfo, _ = _userinfo(server)
        if not userinfo:
            continue
        user, colon, password = userinfo.partition(":")
        secret = password if colon else user
        if secret:
            found.update((secret, unquote(secret)))
    return found


def scrub(text: str, url: str) -> str:
    """``text`` with every secret of ``url`` replaced and any URL's userinfo masked."""
    for secret in sorted(secrets_in(url), key=len, reverse=True):
        text = text.replace(secret, MASK)
    return _URL_USERINFO.sub(lambda m: f"{m['scheme']}{_masked(m['userinfo'])}@", text)


# ---- TLS -------------------------------------------------------------------------------------


def tls_context(ca: str | None, cert: str | None, key: str | None) -> ssl.SSLContext:
    """A client context verifying the server (against ``ca``, else the system's CAs).

    Unreadable files fail here, naming the setting, rather than as a handshake error later.
    """
    try:
        context = ssl.create_default_context(cafile=ca)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"SEQSTATE_TLS_CA={ca}: not a PEM CA certificate ({exc})") from None
    if cert is not None:
        try:
            context.load_cert_chain(cert, key)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(
                f"SEQSTATE_TLS_CERT={cert}, SEQSTATE_TLS_KEY={key}: not a PEM certificate "
                f"and its key ({exc})"
            ) from None
    return context


def client_tls(config: Config) -> ssl.SSLContext | None:
    """The context for nats-py; None when nothing is set, so nats-py uses its default."""
    if config.tls_ca is None and config.tls_cert is None:
        return None
    return tls_context(config.tls_ca, config.tls_cert, config.tls_key)


def tls_settings_from_env(env: Mapping[str, str] | None = None) -> Config:
    """A config holding only the ``SEQSTATE_TLS_*`` settings, for a caller that has no config."""
    env = os.environ if env is None else env
    return Config.from_env({k: v for k, v in env.items() if k.startswith("SEQSTATE_TLS_")})
