"""deploy/nats-roles.conf is what deploy/nats_roles.py writes for the default names, and a
nats-server accepts it (the permissions themselves: tests/integration/test_permissions.py)."""

from __future__ import annotations

import os
import runpy
import subprocess
from pathlib import Path

from projector.nats.server import find_binary
from projector.wire.config import Config

ROOT = Path(__file__).resolve().parents[1].parent
CONF = ROOT / "deploy" / "nats-roles.conf"


def test_the_shipped_role_config_is_the_generators_output() -> None:
    render = runpy.run_path(str(ROOT / "deploy" / "nats_roles.py"))["render"]
    assert CONF.read_text() == render(Config()), "rerun: python deploy/nats_roles.py > " + str(CONF)


def test_another_namespace_gets_its_own_subjects() -> None:
    render = runpy.run_path(str(ROOT / "deploy" / "nats_roles.py"))["render"]
    text = render(Config(namespace="prod", registry_bucket="prod-reg"))
    assert '"seqstate.events.prod.>"' in text and '"$KV.prod-reg.>"' in text
    assert "seqstate.events.default" not in text


def test_nats_server_accepts_the_role_config() -> None:
    generator = runpy.run_path(str(ROOT / "deploy" / "nats_roles.py"))
    roles = [role.upper() for role in generator["ROLES"]]
    env = {**os.environ, **{f"SEQSTATE_{role}_PASSWORD": "x" for role in roles}}
    result = subprocess.run(
        [find_binary(), "-c", str(CONF), "-t"], capture_output=True, text=True, timeout=30, env=env
    )
    assert result.returncode == 0, result.stdout + result.stderr
