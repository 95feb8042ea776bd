"""Slot-tracker names map to namespaces one-to-one, and every namespace is a valid token."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from projector.http.tracker_names import (
    NotATrackerNamespace,
    TrackerNameTooLong,
    namespace_for,
    tracker_of,
)
from projector.settings.config import Config


@pytest.mark.parametrize(
    ("model", "group", "namespace"),
    [
        ("meta-llama/Llama-3.1-8B", "default", "st-meta_2Dllama_2FLlama_2D3_2E1_2D8B-default"),
        ("Qwen", "a-b", "st-Qwen-a_2Db"),
        ("m_1", "", "st-m_5F1-"),
        ("é", "g h", "st-_C3_A9-g_20h"),
    ],
)
def test_names_read_as_their_model(model: str, group: str, namespace: str) -> None:
    assert namespace_for(model, group) == namespace
    assert tracker_of(namespace) == (model, group)


def size(name: str) -> int:
    """What a name takes in a namespace: a letter or digit 1 byte, any other UTF-8 byte 3."""
    return sum(1 if chr(b).isascii() and chr(b).isalnum() else 3 for b in name.encode())


@given(st.text(), st.text())
def test_every_pair_round_trips_through_a_valid_namespace(model: str, group: str) -> None:
    if len("st--") + size(model) + size(group) > 2048:
        with pytest.raises(TrackerNameTooLong):
            namespace_for(model, group)
        return
    namespace = namespace_for(model, group)
    assert Config(namespace=namespace).namespace == namespace  # letters, digits, '-', '_'
    assert tracker_of(namespace) == (model, group)


def test_a_namespace_is_at_most_2048_bytes_named_in_the_refusal() -> None:
    assert len(namespace_for("m" * 2037, "default")) == 2048
    assert len(namespace_for("é" * 339, "default")) == 2045  # 6 bytes each
    with pytest.raises(TrackerNameTooLong) as refused:
        namespace_for("m" * 2038, "default")
    assert str(refused.value) == (
        "model_name and routing_group too long: their tracker's namespace, a token of NATS "
        "subjects and KV keys, would take 2,049 bytes, over the limit of 2,048 (an ASCII "
        "letter or digit takes 1 byte, any other byte of the UTF-8 names 3)"
    )
    with pytest.raises(TrackerNameTooLong):
        namespace_for("m", "g" * 2000, "d" * 100)  # the deployment's name counts too


@given(st.text(), st.text(), st.text())
def test_a_deployment_keeps_its_own_trackers(model: str, group: str, deployment: str) -> None:
    own = 0 if deployment == "default" else 1 + size(deployment)
    if len("st--") + size(model) + size(group) + own > 2048:
        with pytest.raises(TrackerNameTooLong):
            namespace_for(model, group, deployment)
        return
    namespace = namespace_for(model, group, deployment)
    assert Config(namespace=namespace).namespace == namespace
    assert tracker_of(namespace, deployment) == (model, group)
    if deployment != "default":
        assert namespace != namespace_for(model, group)
        with pytest.raises(NotATrackerNamespace):
            tracker_of(namespace)


def test_a_deployment_is_a_third_token() -> None:
    assert namespace_for("Qwen", "default", "staging") == "st-Qwen-default-staging"
    assert namespace_for("Qwen", "default", "default") == "st-Qwen-default"
    with pytest.raises(NotATrackerNamespace):
        tracker_of("st-Qwen-default", "staging")


@pytest.mark.parametrize(
    "namespace", ["default", "st-a-b-c-d", "st-a_2", "st-_ZZ-x", "st-_FF-x", "st-a-b-_FF"]
)
def test_other_namespaces_are_refused(namespace: str) -> None:
    with pytest.raises(NotATrackerNamespace):
        tracker_of(namespace, "c")
