"""Configuration from the environment: every name is settable, bad values are named."""

from __future__ import annotations

import pytest

from projector.settings.config import Config, ConfigError
from seqstate import SequenceState
from seqstate.state import MAX_ENDED, MAX_TOMBSTONES

pytestmark = pytest.mark.core  # exercises the core: the pure pass runs it too


def test_defaults_follow_the_conventions() -> None:
    config = Config.from_env({})
    assert config.events_stream == "SEQSTATE_EVENTS"
    assert config.registry_bucket == "seqstate-registry"
    assert config.events_subjects == "seqstate.events.default.>"
    assert config.event_subject(7, 2) == "seqstate.events.default.7.2"
    assert config.nats_url is None


def test_environment_then_overrides() -> None:
    env = {
        "SEQSTATE_NAMESPACE": "prod",
        "SEQSTATE_EXPIRY_S": "off",
        "NATS_URL": "nats://n:4222",
        "SEQSTATE_REPLICAS": "3",
    }
    config = Config.from_env(env, namespace="canary")
    assert (config.namespace, config.expiry_s, config.nats_url, config.replicas) == (
        "canary",
        None,
        "nats://n:4222",
        3,
    )


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"SEQSTATE_NAMESPACE": "a.b"}, "SEQSTATE_NAMESPACE"),
        ({"SEQSTATE_DUPLICATE_WINDOW_S": "abc"}, "SEQSTATE_DUPLICATE_WINDOW_S"),
        ({"SEQSTATE_DUPLICATE_WINDOW_S": "30"}, "SEQSTATE_DUPLICATE_WINDOW_S='30'"),
        ({"SEQSTATE_REPLICAS": "2"}, "SEQSTATE_REPLICAS='2': use 1, 3 or 5"),
        ({"NATS_URL": "garbage"}, "NATS_URL='garbage': 'garbage' is not a NATS URL"),
        ({"NATS_URL": "nats://a:4222,http://b"}, "'http://b' is not a NATS URL"),
        ({"NATS_URL": "nats://a:port"}, "'nats://a:port' is not a NATS URL"),
        ({"SEQSTATE_IDLE_TICK_S": "off"}, "SEQSTATE_IDLE_TICK_S"),
    ],
)
def test_bad_settings_are_named(env: dict[str, str], named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        Config.from_env(env)


def test_a_flag_is_named_as_the_user_typed_it_and_wins_over_the_environment() -> None:
    env = {"SEQSTATE_EXPIRY_S": "banana", "SEQSTATE_FLUSH_INTERVAL_S": "0.5"}
    with pytest.raises(ConfigError) as caught:
        Config.from_env(env, flags={"flush_interval_s": ("--flush-interval-s", "-1")})
    # The environment's bad expiry is reported first only if it is read first: it is.
    assert str(caught.value) == "SEQSTATE_EXPIRY_S='banana': not a number (seconds, or 'off')"
    with pytest.raises(ConfigError) as caught:
        Config.from_env({}, flags={"flush_interval_s": ("--flush-interval-s", "-1")})
    assert str(caught.value) == "--flush-interval-s '-1': must be positive"
    with pytest.raises(ConfigError) as caught:
        Config.from_env({}, flags={"expiry_s": ("--expiry-s", "banana")})
    assert str(caught.value) == "--expiry-s 'banana': not a number (seconds, or 'off')"
    flags = {"flush_interval_s": ("--flush-interval-s", "0.25")}
    config = Config.from_env(env | {"SEQSTATE_EXPIRY_S": "off"}, flags=flags)
    assert (config.expiry_s, config.flush_interval_s) == (None, 0.25)


def test_the_id_memories_are_sized_by_settings_in_every_fold() -> None:
    """New settings max_tombstones and max_ended: each fold (the writer, a replay) starts from
    a state with their capacities, and its snapshots carry them; a negative one is named."""
    assert (Config().max_tombstones, Config().max_ended) == (MAX_TOMBSTONES, MAX_ENDED)
    config = Config.from_env({"SEQSTATE_MAX_TOMBSTONES": "5", "SEQSTATE_MAX_ENDED": "0"})
    state = config.new_state()
    assert (state.tombstones.capacity, state.ended.capacity) == (5, 0)
    restored = SequenceState.restore(state.snapshot())
    assert (restored.tombstones.capacity, restored.ended.capacity) == (5, 0)
    with pytest.raises(ConfigError) as caught:
        Config.from_env({}, flags={"max_ended": ("--max-ended", "-1")})
    assert str(caught.value) == "--max-ended '-1': must not be negative"


def test_python_callers_see_field_names() -> None:
    with pytest.raises(ConfigError, match=r"^flush_interval_s=-1: must be positive$"):
        Config(flush_interval_s=-1)


@pytest.mark.parametrize(
    "url",
    [
        "nats://127.0.0.1:4222",
        "tls://u:p@h:1",
        "127.0.0.1:4222",
        "nats://a:1, nats://b:2",
        "ws://h",
    ],
)
def test_nats_urls_that_clients_accept_are_accepted(url: str) -> None:
    assert Config(nats_url=url).nats_url == url


def test_with_namespace() -> None:
    base = Config(flush_interval_s=0.5)
    assert base.with_namespace(None) is base and base.with_namespace("default") is base
    other = base.with_namespace("prod")
    assert (other.namespace, other.flush_interval_s) == ("prod", 0.5)


def test_a_namespace_is_a_token_of_at_most_2048_characters() -> None:
    """It is a token of every subject of its pipeline: a longer one would make protocol lines
    over NATS's default 4 KiB control line, which ends the connection."""
    assert len(Config(namespace="n" * 2048).namespace) == 2048
    with pytest.raises(ConfigError) as caught:
        Config(namespace="n" * 2049)
    assert caught.value.problem == "at most 2048 characters (a token of NATS subjects)"


def test_a_bad_url_is_named_without_its_secret() -> None:
    with pytest.raises(ConfigError) as caught:
        Config.from_env({"NATS_URL": "nats://alice:S3cret@host:port"})
    assert "S3cret" not in str(caught.value)
    assert str(caught.value).startswith("NATS_URL='nats://alice:***@host:port': ")
    with pytest.raises(ConfigError) as caught:
        Config(nats_url="tls://tok3n@host:x")
    assert "tok3n" not in str(caught.value)


def test_the_rules_setting_chooses_the_folds_rules_and_refuses_a_grace_with_them() -> None:
    assert Config().new_state().slot_tracker is False
    config = Config.from_env({"SEQSTATE_RULES": "slot-tracker"})
    state = config.new_state()
    assert (state.slot_tracker, state.lazy_workers) == (True, False)
    assert config.rules_differing(Config().new_state()) == [
        "rules: snapshot router, configured slot-tracker"
    ]
    with pytest.raises(ConfigError) as caught:
        Config.from_env({}, flags={"rules": ("--rules", "dynamo")})
    assert str(caught.value) == "--rules 'dynamo': use 'router' or 'slot-tracker'"
    with pytest.raises(ConfigError, match="worker grace has no place under the 'slot-tracker'"):
        Config.from_env({"SEQSTATE_RULES": "slot-tracker", "SEQSTATE_WORKER_GRACE_S": "5"})


def test_a_dynamo_namespace_folds_by_the_lease_and_a_changed_scan_is_named() -> None:
    """--dynamo-endpoint: the fold expires by Dynamo's lease, every --expiry-scan-s (300 s by
    default; 'off': the age limit); elsewhere by the age limit. A snapshot folded by other
    rules keeps them, and the difference is named for the writer to say."""
    assert Config().new_state().lease_scan_s is None
    dynamo = {"SEQSTATE_DYNAMO_ENDPOINT": "dynamo.backend.generate"}
    assert Config.from_env(dynamo).new_state().lease_scan_s == 300.0
    state = Config.from_env(dynamo | {"SEQSTATE_EXPIRY_SCAN_S": "30"}).new_state()
    assert (state.lease_scan_s, state.age_expiry_ns) == (30.0, None)
    assert (
        Config.from_env(dynamo | {"SEQSTATE_EXPIRY_SCAN_S": "off"}).new_state().lease_scan_s is None
    )
    assert Config.from_env(dynamo).rules_differing(Config().new_state()) == [
        "expiry_scan_s: snapshot off, configured 300"
    ]
    for raw in ("0", "-5", "inf", "nan"):
        with pytest.raises(ConfigError) as caught:
            Config.from_env({}, flags={"expiry_scan_s": ("--expiry-scan-s", raw)})
        assert str(caught.value) == (
            f"--expiry-scan-s {raw!r}: must be positive (at most a year), or 'off'"
        )


def test_the_scan_follows_dynamos_own_variable_unless_seqstate_is_told() -> None:
    """Started with the fleet's environment, seqstate scans as its frontends do: Dynamo's
    DYN_ROUTER_ACTIVE_REQUEST_EXPIRY_SECS, unless the flag or SEQSTATE_EXPIRY_SCAN_S says
    otherwise; a bad value is named by the variable it came from."""
    fleet = {"SEQSTATE_DYNAMO_ENDPOINT": "dynamo.backend.generate"}
    fleet["DYN_ROUTER_ACTIVE_REQUEST_EXPIRY_SECS"] = "60"
    assert Config.from_env(fleet).new_state().lease_scan_s == 60.0
    told = Config.from_env(fleet | {"SEQSTATE_EXPIRY_SCAN_S": "30"})
    assert told.new_state().lease_scan_s == 30.0
    flagged = Config.from_env(fleet, flags={"expiry_scan_s": ("--expiry-scan-s", "off")})
    assert flagged.new_state().lease_scan_s is None
    with pytest.raises(ConfigError) as caught:
        Config.from_env(fleet | {"DYN_ROUTER_ACTIVE_REQUEST_EXPIRY_SECS": "0"})
    assert str(caught.value) == (
        "DYN_ROUTER_ACTIVE_REQUEST_EXPIRY_SECS='0': must be positive (at most a year), or 'off'"
    )


def test_the_metrics_settings_parse_and_a_bad_port_is_one_clear_error() -> None:
    assert (Config().metrics_port, Config().metrics_host, Config().ready_lag_events) == (
        None,
        "127.0.0.1",  # loopback unless asked: 0.0.0.0 on request
        1000,
    )
    assert Config.from_env({"SEQSTATE_METRICS_HOST": "0.0.0.0"}).metrics_host == "0.0.0.0"
    env = {"SEQSTATE_METRICS_PORT": "9464", "SEQSTATE_READY_LAG_EVENTS": "50"}
    config = Config.from_env(env)
    assert (config.metrics_port, config.ready_lag_events) == (9464, 50)
    assert Config.from_env({"SEQSTATE_METRICS_PORT": "off"}).metrics_port is None
    assert Config.from_env({}, flags={"metrics_port": ("--metrics-port", "0")}).metrics_port == 0
    with pytest.raises(ConfigError) as caught:
        Config.from_env({}, flags={"metrics_port": ("--metrics-port", "70000")})
    assert str(caught.value) == (
        "--metrics-port '70000': not a port: use 0-65535 (0: any free port), or 'off'"
    )
    with pytest.raises(ConfigError) as caught:
        Config.from_env({"SEQSTATE_METRICS_PORT": "http"})
    assert str(caught.value) == (
        "SEQSTATE_METRICS_PORT='http': not a number (a whole number, or 'off')"
    )
    with pytest.raises(ConfigError, match="SEQSTATE_READY_LAG_EVENTS='-1': must not be negative"):
        Config.from_env({"SEQSTATE_READY_LAG_EVENTS": "-1"})
    with pytest.raises(ConfigError, match="--metrics-host ' ': not an address"):
        Config.from_env({}, flags={"metrics_host": ("--metrics-host", " ")})


def test_the_metrics_flags_belong_to_the_four_long_running_commands() -> None:
    from projector.ops.commands import COMMANDS

    settings = {command.name: command.settings for command in COMMANDS}
    having = {command for command, names in settings.items() if "metrics_port" in names}
    assert having == {"writer", "projector", "run", "serve-http"}
    for command in having:
        assert {"metrics_host", "ready_lag_events"} <= set(settings[command])


def test_serve_http_listens_on_loopback_unless_asked_and_its_token_is_a_secret() -> None:
    """serve-http bound 0.0.0.0 and took no token. Its address, port and token are
    settings like the others (variable and flag); the token is never shown."""
    config = Config()
    assert (config.http_host, config.http_port, config.http_token, config.http_token_file) == (
        "127.0.0.1",
        8091,
        None,
        None,
    )
    env = {
        "SEQSTATE_HTTP_HOST": "0.0.0.0",
        "SEQSTATE_HTTP_PORT": "9000",
        "SEQSTATE_HTTP_TOKEN": "s3cret-Token",
    }
    config = Config.from_env(env)
    assert (config.http_host, config.http_port, config.http_token) == (
        "0.0.0.0",
        9000,
        "s3cret-Token",
    )
    assert "s3cret" not in repr(config)
    with pytest.raises(ConfigError) as caught:
        Config.from_env({}, flags={"http_token": ("--http-token", "two words")})
    assert str(caught.value) == (
        "--http-token '***': use visible ASCII only, no spaces (it travels in an HTTP header)"
    )
    with pytest.raises(ConfigError) as caught:
        Config.from_env({"SEQSTATE_HTTP_PORT": "http"})
    assert str(caught.value) == "SEQSTATE_HTTP_PORT='http': not a number (a whole number)"
    with pytest.raises(ConfigError, match="--http-host ' ': not an address"):
        Config.from_env({}, flags={"http_host": ("--http-host", " ")})
    with pytest.raises(ConfigError, match="SEQSTATE_HTTP_TOKEN_FILE='/nonexistent': no such file"):
        Config.from_env({"SEQSTATE_HTTP_TOKEN_FILE": "/nonexistent"})
    with pytest.raises(ConfigError, match="set the token one way, not both"):
        Config.from_env({"SEQSTATE_HTTP_TOKEN": "a", "SEQSTATE_HTTP_TOKEN_FILE": __file__})


def test_the_http_flags_belong_to_serve_http_alone() -> None:
    from projector.ops.cli import build_parser
    from projector.ops.commands import COMMANDS

    having = {c.name for c in COMMANDS if "http_token" in c.settings}
    assert having == {"serve-http"}
    args = build_parser().parse_args(["serve-http", "--host", "0.0.0.0", "--port", "1"])
    assert (args.cfg_http_host, args.cfg_http_port) == ("0.0.0.0", "1")
    args = build_parser().parse_args(["serve-http", "--http-host", "::1", "--http-token", "t"])
    assert (args.cfg_http_host, args.cfg_http_token) == ("::1", "t")


def test_the_inbox_prefix_is_the_users_own_and_never_nats_default() -> None:
    from projector.nats.security import inbox_prefix

    assert inbox_prefix(Config()) == "_SEQSTATE_INBOX"
    assert inbox_prefix(Config(nats_user="router", nats_password="pw")) == (
        "_SEQSTATE_INBOX.router"
    )
    assert inbox_prefix(Config(), "nats://replay:pw@h:4222,nats://replay:pw@h2:4222") == (
        "_SEQSTATE_INBOX.replay"
    )
    assert inbox_prefix(Config(), "nats://s3cr3t-token@h:4222") == "_SEQSTATE_INBOX"
    assert inbox_prefix(Config(nats_user="a b", nats_password="pw")) == "_SEQSTATE_INBOX"
    chosen = Config.from_env({"SEQSTATE_NATS_INBOX_PREFIX": "_SEQSTATE_INBOX.router"})
    assert inbox_prefix(chosen, "nats://admin:pw@h") == "_SEQSTATE_INBOX.router"
    for bad in ("_X.>", "a..b", "a b"):
        with pytest.raises(ConfigError, match="SEQSTATE_NATS_INBOX_PREFIX"):
            Config.from_env({"SEQSTATE_NATS_INBOX_PREFIX": bad})


def test_serve_http_bounds_its_connections_and_trackers_with_settings_of_its_own() -> None:
    """serve-http held any number of connections and served any number of trackers. Each
    bound is a setting (variable and flag) of serve-http alone, with a default that fits a
    default `ulimit -n` of 1,024, and at least 1."""
    from projector.ops.cli import build_parser
    from projector.ops.commands import COMMANDS

    config = Config()
    assert (config.http_max_connections, config.max_trackers) == (512, 128)
    env = {"SEQSTATE_HTTP_MAX_CONNECTIONS": "2000", "SEQSTATE_MAX_TRACKERS": "4"}
    config = Config.from_env(env)
    assert (config.http_max_connections, config.max_trackers) == (2000, 4)
    with pytest.raises(ConfigError) as caught:
        Config.from_env({"SEQSTATE_MAX_TRACKERS": "0"})
    assert str(caught.value) == "SEQSTATE_MAX_TRACKERS='0': must be 1 to 1000000"
    with pytest.raises(ConfigError) as caught:
        Config.from_env({}, flags={"http_max_connections": ("--http-max-connections", "-1")})
    assert str(caught.value) == "--http-max-connections '-1': must be 1 to 1000000"
    having = {
        c.name for c in COMMANDS if {"http_max_connections", "max_trackers"} & set(c.settings)
    }
    assert having == {"serve-http"}
    args = build_parser().parse_args(
        ["serve-http", "--http-max-connections", "8", "--max-trackers", "3"]
    )
    assert (args.cfg_http_max_connections, args.cfg_max_trackers) == ("8", "3")
