"""Slot-tracker names map to namespaces one-to-one, and every namespace is a valid token."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from projector.http.tracker_names import NotATrackerNamespace, namespace_for, tracker_of
from projector.wire.config import Config


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


@given(st.text(), st.text())
def test_every_pair_round_trips_through_a_valid_namespace(model: str, group: str) -> None:
    namespace = namespace_for(model, group)
    assert Config(namespace=namespace).namespace == namespace  # letters, digits, '-', '_'
    assert tracker_of(namespace) == (model, group)


@given(st.text(), st.text(), st.text())
def test_a_deployment_keeps_its_own_trackers(model: str, group: str, deployment: str) -> None:
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
