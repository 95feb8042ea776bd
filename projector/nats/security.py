"""Secrets in NATS URLs and settings, and the TLS settings: what may be shown, whom we trust.

A NATS URL may carry a password (``nats://user:password@host``) or a token
(``nats://token@host``), and ``NATS_URL`` may list several servers separated by commas. The
``nats_*`` settings carry the same (a password, a token) or name a file holding one (an NKEY
seed, a credentials file with a JWT and a seed). What is shown of them to a person goes
through :mod:`projector.settings.redaction`, given the secrets of the settings
(:func:`config_secrets`) as well as the URL's.

:func:`auth_options` turns the settings into nats-py's options, checking the files first: an
unreadable or malformed file is one :class:`ConfigError` naming the setting, never the
content (nats-py would otherwise fail mid-dial, or loop forever on a creds file with no JWT).

nats-py and the replay reader build their TLS context here from the same ``tls_*`` settings,
so the two connections trust the same CA and present the same client certificate.
"""

from __future__ import annotations

import importlib
import os
import re
import ssl
from collections.abc import Mapping
from contextlib import suppress
from typing import Any
from urllib.parse import unquote, urlsplit

from projector.settings.checks import is_literal_subject
from projector.settings.config import Config, ConfigError
from projector.settings.redaction import JWT, server_urls

# ---- credentials from settings ---------------------------------------------------------------

_CREDS_BLOCK = re.compile(r"-----BEGIN ([A-Z ]+)-----\s*\n\s*(\S+)\s*\n\s*------END \1------")


def _read(path: str, setting: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else "not text"
        raise ConfigError(f"{setting}={path}: cannot read it ({why})") from None


def _valid_seed(seed: str) -> bool:
    # nats-py[nkeys], untyped; imported only when a seed is used.
    nkeys = importlib.import_module("nkeys")

    try:
        nkeys.from_seed(bytearray(seed.encode())).wipe()
    except Exception:  # nkeys raises several kinds (ErrInvalidSeed, binascii, ValueError)
        return False
    return True


def _nkey_seed(path: str) -> str:
    seed = _read(path, "SEQSTATE_NATS_NKEY_SEED").strip()
    if not seed.startswith("SU") or "\n" in seed or not _valid_seed(seed):
        raise ConfigError(
            f"SEQSTATE_NATS_NKEY_SEED={path}: not an NKEY user seed file (one line starting SU)"
        )
    return seed


def _creds(path: str) -> tuple[str, str]:
    """The user JWT and seed of a credentials file, checked as nats-py will read them."""
    blocks = dict(_CREDS_BLOCK.findall(_read(path, "SEQSTATE_NATS_CREDS")))
    jwt, seed = blocks.get("NATS USER JWT"), blocks.get("USER NKEY SEED")
    if jwt is None or seed is None or not JWT.fullmatch(jwt) or not _valid_seed(seed):
        raise ConfigError(
            f"SEQSTATE_NATS_CREDS={path}: not a NATS credentials file (a "
            "'NATS USER JWT' block and a 'USER NKEY SEED' block)"
        )
    return jwt, seed


def config_secrets(config: Config) -> set[str]:
    """Every secret the settings hold or name: a password, a token, a seed, a JWT."""
    found = {s for s in (config.nats_password, config.nats_token, config.http_token) if s}
    with suppress(ConfigError):
        if config.nats_nkey_seed is not None:
            found.add(_nkey_seed(config.nats_nkey_seed))
    with suppress(ConfigError):
        if config.nats_creds is not None:
            found.update(_creds(config.nats_creds))
    return found


def auth_options(config: Config) -> dict[str, Any]:
    """nats-py's sign-in options from the settings (none: the URL's credentials, if any)."""
    if config.nats_user is not None and config.nats_password is not None:
        return {"user": config.nats_user, "password": config.nats_password}
    if config.nats_token is not None:
        return {"token": config.nats_token}
    if config.nats_nkey_seed is not None:
        _nkey_seed(config.nats_nkey_seed)
        return {"nkeys_seed": config.nats_nkey_seed}
    if config.nats_creds is not None:
        _creds(config.nats_creds)
        return {"user_credentials": config.nats_creds}
    return {}


# ---- the inbox prefix ------------------------------------------------------------------------

# Outside ``_INBOX.>``: Dynamo's processes, which cannot be told otherwise, reply there, so a
# deployment grants them ``_INBOX.>``; a seqstate client's replies must not land where they read.
INBOX_PREFIX = "_SEQSTATE_INBOX"


def inbox_prefix(config: Config, url: str | None = None) -> str:
    """The prefix of the client's reply inboxes: ``nats_inbox_prefix`` if set, else
    ``_SEQSTATE_INBOX.<user>`` for a client signing in with a user name (the setting's, else
    the URL's), so that each user of deploy/nats-roles.conf (named after its role) reads only
    its own replies; else ``_SEQSTATE_INBOX``."""
    if config.nats_inbox_prefix:
        return config.nats_inbox_prefix
    user = config.nats_user
    if user is None and config.nats_token is None and url:
        parts = urlsplit(server_urls(url)[0] if server_urls(url) else url)
        if parts.password is not None and parts.username:
            user = unquote(parts.username)
    prefix = f"{INBOX_PREFIX}.{user}" if user else INBOX_PREFIX
    return prefix if is_literal_subject(prefix) else INBOX_PREFIX


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


_CONNECT_PREFIXES = ("SEQSTATE_TLS_", "SEQSTATE_NATS_")  # Config reads only its own settings


def connect_settings_from_env(env: Mapping[str, str] | None = None) -> Config:
    """A config holding only the TLS and sign-in settings, for a caller that has no config."""
    env = os.environ if env is None else env
    return Config.from_env({k: v for k, v in env.items() if k.startswith(_CONNECT_PREFIXES)})


tls_settings_from_env = connect_settings_from_env  # its name before it read credentials too
