"""deploy/k8s rendered as ``kubectl kustomize`` renders it, and its pods' parts as the kubelet
reads them: the unit test checks the wiring, the integration test runs the pods' commands."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "deploy" / "k8s"


def render() -> list[dict[str, Any]]:
    """The base's objects, as ``kubectl kustomize deploy/k8s`` renders them."""
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl is needed to render deploy/k8s (.ci/run installs it when missing)"
    out = subprocess.run(
        [kubectl, "kustomize", str(BASE)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def by_kind(objects: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def container_of(deployment: dict[str, Any]) -> dict[str, Any]:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def environment(objects: list[dict[str, Any]], container: dict[str, Any]) -> dict[str, str]:
    """What the container's process finds in its environment; a Secret's value is a stand-in."""
    maps = by_kind(objects, "ConfigMap")
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        assert set(source) == {"configMapRef"}, source
        env.update(maps[source["configMapRef"]["name"]]["data"])
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        else:
            ref = var["valueFrom"]["secretKeyRef"]
            env[var["name"]] = f"stand-in-for-{ref['name']}-{ref['key']}"
    return env


def with_mounted_secrets(deployment: dict[str, Any], root: Path) -> dict[str, Any]:
    """The container with each Secret volume's mount path moved under ``root``, each key the
    command's file flags name written there, so the settings' file checks see real files."""
    spec = deployment["spec"]["template"]["spec"]
    container = container_of(deployment)
    command = list(container["command"])
    secret_volumes = {v["name"] for v in spec.get("volumes", []) if "secret" in v}
    for mount in container.get("volumeMounts", []):
        if mount["name"] not in secret_volumes:
            continue
        assert mount.get("readOnly") is True, mount
        local = root / mount["name"]
        for i, token in enumerate(command):
            if token.startswith(mount["mountPath"] + "/"):
                path = local / token.removeprefix(mount["mountPath"] + "/")
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text("stand-in-token\n")
                command[i] = str(path)
    return {**container, "command": command}
