"""deploy/k8s renders, validates against Kubernetes' schema, and is wired to what seqstate reads.

The base is rendered the way a user applies it (``kubectl kustomize deploy/k8s``) and every
object is validated strictly (unknown fields refused) against the newest Kubernetes schema
``kubernetes-validate`` ships. Then the wiring: each container's command is parsed by the
CLI's own parser, its environment (ConfigMaps, literals, Secrets) is read by the CLI's own
settings path (so a variable the code does not read, or a value it refuses, fails here), the
probes and scrape annotations name the metrics port the command listens on, the budget selects
serve-http's pods and no others, and every Secret a pod needs is documented as the user's.
"""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import fields
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from k8s_kit import BASE, by_kind, container_of, environment, render, with_mounted_secrets
from packaging.version import Version
from test_compose import _role_users

from projector.ops.cli import build_parser
from projector.ops.flags import config_from
from projector.settings import logs
from projector.settings.config import Config, env_name

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "kubernetes.md"
SINGLETONS = ("seqstate-writer", "seqstate-projector")  # one fold per namespace
SCALED = "seqstate-serve-http"


@pytest.fixture(scope="module")
def objects() -> list[dict[str, Any]]:
    return render()


@pytest.fixture(scope="module")
def deployments(objects) -> dict[str, dict[str, Any]]:
    return by_kind(objects, "Deployment")


def _parsed(container: dict[str, Any]) -> argparse.Namespace:
    """The container's command as the CLI parses it (argparse exits on an unknown flag)."""
    argv = container.get("command", []) + container.get("args", [])
    assert argv[0] == "seqstate", argv
    try:
        return build_parser().parse_args(argv[1:])
    except SystemExit:
        pytest.fail(f"`{' '.join(argv)}` is refused by the CLI's parser")


def test_the_base_renders_what_it_should(objects):
    kinds = sorted((o["kind"], o["metadata"]["name"]) for o in objects)
    assert kinds == [
        ("ConfigMap", "seqstate-nats"),
        ("ConfigMap", "seqstate-pipeline"),
        ("Deployment", "seqstate-projector"),
        ("Deployment", "seqstate-serve-http"),
        ("Deployment", "seqstate-writer"),
        ("PodDisruptionBudget", "seqstate-serve-http"),
        ("Service", "seqstate-serve-http"),
    ]


def test_every_object_validates_strictly_against_a_current_kubernetes(objects):
    version = kubernetes_validate.latest_version()
    assert Version(version) >= Version("1.33"), version
    refused = []
    for obj in objects:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            refused.append(f"{obj['kind']} {obj['metadata']['name']}: {exc}")
    assert not refused, refused


def test_the_image_is_the_one_kustomize_images_sets(deployments):
    kustomization = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    (image,) = kustomization["images"]
    for name, deployment in deployments.items():
        assert container_of(deployment)["image"] == f"{image['newName']}:{image['newTag']}", name
    for path in BASE.glob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "Deployment":
                assert container_of(doc)["image"] == image["name"], path


@pytest.mark.parametrize("name", ["seqstate-writer", "seqstate-projector", SCALED])
def test_every_argument_is_a_flag_the_command_accepts(deployments, name):
    container = container_of(deployments[name])
    args = _parsed(container)
    assert args.command == name.removeprefix("seqstate-"), args.command
    # Every --flag is one of that command's own (argparse would accept an unambiguous prefix).
    sub = build_parser()._subparsers._group_actions[0].choices[args.command]  # type: ignore[union-attr]
    known = {s for action in sub._actions for s in action.option_strings}
    for token in container["command"][2:]:
        if token.startswith("--"):
            assert token in known, f"{name}: `seqstate {args.command}` has no {token}"


@pytest.mark.parametrize("name", ["seqstate-writer", "seqstate-projector", SCALED])
def test_every_variable_is_a_setting_the_command_reads(
    objects, deployments, name, monkeypatch, tmp_path
):
    container = container_of(deployments[name])
    env = environment(objects, container)
    readable = {env_name(f.name) for f in fields(Config)} | {logs.ENV, logs.LEVEL_ENV}
    assert set(env) <= readable, f"{name} sets variables no setting reads: {set(env) - readable}"
    # The settings path of the command itself: each value parses and passes its checks.
    for key in list(os.environ):
        if key.startswith("SEQSTATE_") or key in ("NATS_URL",) or key.startswith("DYN_"):
            monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    args = _parsed(with_mounted_secrets(deployments[name], tmp_path))
    config = config_from(args)
    if logs.ENV in env:
        assert env[logs.ENV] in ("auto", "json", "console"), env[logs.ENV]
    assert config.nats_url == env["NATS_URL"]
    assert config.nats_user is not None and config.nats_password is not None
    if name in SINGLETONS:
        assert config.dynamo_endpoints, f"{name} captures no Dynamo endpoint"
    else:  # serve-http's trackers are namespaces of their own: none may capture Dynamo
        assert config.dynamo_endpoint is None and "SEQSTATE_NAMESPACE" not in env


@pytest.mark.parametrize("name", ["seqstate-writer", "seqstate-projector", SCALED])
def test_probes_and_scrapes_ask_the_metrics_port_the_command_listens_on(deployments, name):
    template = deployments[name]["spec"]["template"]
    container = container_of(deployments[name])
    args = _parsed(container)
    port = int(args.cfg_metrics_port)
    assert args.cfg_metrics_host == "0.0.0.0", "the kubelet probes the pod's address"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["metrics"] == port
    paths = {}
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        get = container[probe]["httpGet"]
        assert ports.get(get["port"], get["port"]) == port, (probe, get)
        paths[probe] = get["path"]
    # Alive while the loop answers; ready only once caught up (a replay is never killed).
    assert paths == {
        "startupProbe": "/healthz",
        "livenessProbe": "/healthz",
        "readinessProbe": "/readyz",
    }
    annotations = template["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(port)
    assert annotations["prometheus.io/path"] == "/metrics"


def test_the_service_reaches_the_port_serve_http_listens_on(objects, deployments):
    container = container_of(deployments[SCALED])
    args = _parsed(container)
    assert args.cfg_http_host == "0.0.0.0"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["http"] == int(args.cfg_http_port)
    service = by_kind(objects, "Service")[SCALED]
    labels = deployments[SCALED]["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    (port,) = service["spec"]["ports"]
    assert port["targetPort"] == "http"


def test_every_container_requests_resources(deployments):
    for name, deployment in deployments.items():
        requests = container_of(deployment)["resources"]["requests"]
        assert {"cpu", "memory"} <= set(requests), name


def test_the_writer_and_the_projector_are_single_and_recreated(deployments):
    for name in SINGLETONS:
        spec = deployments[name]["spec"]
        assert spec["replicas"] == 1, name
        assert spec["strategy"]["type"] == "Recreate", name


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert set(selector) == {"matchLabels"}, selector
    return selector["matchLabels"].items() <= labels.items()


def test_the_budget_protects_serve_http_and_only_it(objects, deployments):
    (budget,) = by_kind(objects, "PodDisruptionBudget").values()
    selected = [
        name
        for name, d in deployments.items()
        if _selects(budget["spec"]["selector"], d["spec"]["template"]["metadata"]["labels"])
    ]
    assert selected == [SCALED]
    spec = deployments[SCALED]["spec"]
    assert spec["replicas"] >= 2 and spec["replicas"] > budget["spec"]["maxUnavailable"] >= 1
    assert spec["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    # Each Deployment's selector picks its own pods and no other Deployment's.
    for name, d in deployments.items():
        mine = [
            other
            for other, o in deployments.items()
            if _selects(d["spec"]["selector"], o["spec"]["template"]["metadata"]["labels"])
        ]
        assert mine == [name], (name, mine)


def _secret_refs(deployment: dict[str, Any]) -> set[tuple[str, str, str]]:
    """Every (Secret, key, how) a pod reads: ``env`` for an env reference's key, ``file`` for
    a file of a Secret volume that the command names (a volume's file is named by its key)."""
    spec = deployment["spec"]["template"]["spec"]
    container = container_of(deployment)
    refs = {
        (v["valueFrom"]["secretKeyRef"]["name"], v["valueFrom"]["secretKeyRef"]["key"], "env")
        for v in container.get("env", [])
        if "secretKeyRef" in v.get("valueFrom", {})
    }
    secrets = {
        v["name"]: v["secret"]["secretName"] for v in spec.get("volumes", []) if "secret" in v
    }
    for mount in container.get("volumeMounts", []):
        if mount["name"] in secrets:
            files = [t for t in container["command"] if t.startswith(mount["mountPath"] + "/")]
            assert files, f"{mount['name']} is mounted but the command reads no file of it"
            refs |= {(secrets[mount["name"]], Path(f).name, "file") for f in files}
    return refs


def test_every_secret_is_the_users_and_documented(objects, deployments):
    assert not by_kind(objects, "Secret"), "no placeholder secret may be applied over a real one"
    guide = GUIDE.read_text()
    refs = set().union(*(_secret_refs(d) for d in deployments.values()))
    assert refs
    for secret, key, how in sorted(refs):
        assert f"create secret generic {secret}" in guide, f"{secret} is not documented"
        made = f"--from-literal={key}=" if how == "file" else key
        assert made in guide, f"{secret}'s key {key} is not documented"


@pytest.mark.parametrize("name", ["seqstate-writer", "seqstate-projector", SCALED])
def test_each_process_signs_in_as_its_role_with_its_roles_password(deployments, name):
    env = {v["name"]: v for v in container_of(deployments[name])["env"]}
    user = env["SEQSTATE_NATS_USER"]["value"]
    assert user == {"seqstate-serve-http": "admin"}.get(name, name.removeprefix("seqstate-"))
    assert user in _role_users()
    key = env["SEQSTATE_NATS_PASSWORD"]["valueFrom"]["secretKeyRef"]["key"]
    # The key the NATS server's environment gives deploy/nats-roles.conf for that role.
    assert key == f"SEQSTATE_{user.upper()}_PASSWORD"
    assert re.search(
        rf"user: {user}, password: \${key}\b", (ROOT / "deploy" / "nats-roles.conf").read_text()
    )
