"""What of a NATS URL or an error text may be shown to a person: secrets masked.

A NATS URL may carry a password (``nats://user:password@host``) or a token
(``nats://token@host``), and ``NATS_URL`` may list several servers separated by commas.
Whatever is shown (logs, ``seqstate status``, errors) goes through :func:`redact`; free text
that might quote a secret (an error from the client) goes through :func:`scrub`, given the
secrets of the settings (:func:`projector.nats.security.config_secrets`) as well as the URL's.
Plain text rules, so that settings can mask what they show without knowing how to connect.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from urllib.parse import unquote

# An NKEY seed: 'S', the key type (U user, A account, O operator...), base32 (58 chars in all).
SEED = re.compile(r"\bS[UAONCPX][A-Z2-7]{40,}\b")
JWT = re.compile(r"\beyJ[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+")

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


def scrub(text: str, url: str, secrets: Iterable[str] = ()) -> str:
    """``text`` with every secret of ``url`` (and ``secrets``) replaced, any URL's userinfo
    masked, and anything shaped like an NKEY seed or a JWT hidden."""
    for secret in sorted(secrets_in(url) | {s for s in secrets if s}, key=len, reverse=True):
        text = text.replace(secret, MASK)
    text = SEED.sub(MASK, JWT.sub(MASK, text))
    return _URL_USERINFO.sub(lambda m: f"{m['scheme']}{_masked(m['userinfo'])}@", text)
