"""Configuration from the environment: every name is settable, bad values are named."""

from __future__ import annotations

import pytest

from projector.config import Config, ConfigError


def test_defaults_follow_the_conventions() -> None:
    config = Config.from_env({})
    assert config.events_stream == "SEQSTATE_EVENTS"
    assert config.registry_bucket == "seqstate-registry"
    assert config.events_subjects == "seqstate.events.default.>"
    assert config.event_subject(7, 2) == "seqstate.events.default.7.2"
    assert config.nats_url is None


def test_environment_then_overrides() -> None:
    env = {"SEQSTATE_NAMESPACE": "prod", "SEQSTATE_EXPIRY_S": "off", "NATS_URL": "nats://n:4222",
           "SEQSTATE_REPLICAS": "3"}  # fmt: skip
    config = Config.from_env(env, namespace="canary")
    assert (config.namespace, config.expiry_s, config.nats_url, config.replicas) == (
        "canary", None, "nats://n:4222", 3)  # fmt: skip


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"SEQSTATE_NAMESPACE": "a.b"}, "SEQSTATE_NAMESPACE"),
        ({"SEQSTATE_DUPLICATE_WINDOW_S": "abc"}, "SEQSTATE_DUPLICATE_WINDOW_S"),
        ({"SEQSTATE_DUPLICATE_WINDOW_S": "30"}, "duplicate_window_s"),
        ({"SEQSTATE_REPLICAS": "2"}, "replicas"),
        ({"SEQSTATE_IDLE_TICK_S": "off"}, "SEQSTATE_IDLE_TICK_S"),
    ],
)
def test_bad_settings_are_named(env: dict[str, str], named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        Config.from_env(env)
