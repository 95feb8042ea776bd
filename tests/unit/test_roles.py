"""deploy/nats-roles.conf is what deploy/nats_roles.py writes for the default names, and a
nats-server accepts it (the permissions themselves: tests/integration/test_permissions_*.py)."""

from __future__ import annotations

import os
import runpy
import subprocess
from pathlib import Path

from projector.nats.server import find_binary
from projector.settings.config import Config

ROOT = Path(__file__).resolve().parents[1].parent
CONF = ROOT / "deploy" / "nats-roles.conf"


def test_the_shipped_role_config_is_the_generators_output() -> None:
    render = runpy.run_path(str(ROOT / "deploy" / "nats_roles.py"))["render"]
    assert CONF.read_text() == render(Config()), "rerun: python deploy/nats_roles.py > " + str(CONF)


def test_another_namespace_gets_its_own_subjects() -> None:
    render = runpy.run_path(str(ROOT / "deploy" / "nats_roles.py"))["render"]
    text = render(Config(namespace="prod", registry_bucket="prod-reg"))
    assert '"seqstate.events.prod.*.*"' in text and '"$KV.prod-reg.>"' in text
    assert '"seqstate.events.prod.control"' in text
    assert "seqstate.events.default" not in text


def test_the_control_subject_is_the_operators_and_the_writers_never_a_routers() -> None:
    """Who may publish where on the events subjects (the servers' enforcement of it:
    tests/integration/test_permissions_refusals.py)."""
    generator = runpy.run_path(str(ROOT / "deploy" / "nats_roles.py"))
    config = Config()
    allowed = {role: publish for role, (_, publish) in generator["permissions"](config).items()}
    control, routers = config.control_subject, config.router_subject
    events_wide = [s for p in allowed.values() for s in p if s.startswith("seqstate.events.")]
    # No role gets a wildcard that would take the control subject unseen (`<ns>.>`, `<ns>.*`).
    assert all(not s.endswith((".>", f"{config.namespace}.*")) for s in events_wide)
    assert allowed["router"] == [
        "seqstate.events.default.*.*",
        routers,
        "$JS.API.STREAM.INFO.SEQSTATE_EVENTS",
    ]
    assert control in generator["denied"](config, "router")
    assert control in generator["denied"](config, "chooser")  # a Scheduler is a router
    assert [r for r, publish in allowed.items() if control in publish] == [
        "control",
        "writer",
        "demo",
    ]
    assert [r for r, publish in allowed.items() if routers in publish] == [
        "router",
        "chooser",
        "demo",
    ]
    for role in set(allowed) - {"admin"}:  # beyond its namespace's subjects: the admin alone
        assert all(not s.startswith("seqstate.events.*") for s in allowed[role]), role


def test_the_admin_may_do_what_its_commands_roles_may_in_every_namespace_and_no_more() -> None:
    """``run``, ``rebuild``, ``snapshot save`` and ``serve-http`` do the writer's, the
    projector's and a router's (the demo's) work, and serve-http follows the dead letters:
    the admin gets exactly that, each namespace's subject widened to every namespace (a
    serve-http tracker is a namespace of its own); nothing that no role has, no other role's
    read-only extras (``$SRV.>`` requests), and a worker subject's sub-tokens stay denied."""
    generator = runpy.run_path(str(ROOT / "deploy" / "nats_roles.py"))
    config = Config()
    allowed = {role: publish for role, (_, publish) in generator["permissions"](config).items()}
    admin = allowed.pop("admin")
    assert len(admin) == len(set(admin))

    def narrowed(subject: str) -> str:
        tokens = subject.split(".")
        if tokens[0] == "seqstate":
            assert tokens[2] == "*", subject  # every namespace, never one
            tokens[2] = config.namespace
        return ".".join(tokens)

    # `dynamo resync` republishes on Dynamo's replica-sync subjects: a part of the dynamo
    # role's namespace.> (Dynamo's processes'), the one grant no seqstate role has as such.
    resync = "namespace.*.component.*.endpoint.*.active_sequences_events"
    # `dynamo uncapture` deletes the namespace's capture stream: no other role deletes one.
    uncapture = "$JS.API.STREAM.DELETE.SEQSTATE_EVENTS_DYNAMO_default"
    assert allowed["dynamo"] == ["namespace.>"]
    granted = {s for publish in allowed.values() for s in publish} | {resync, uncapture}
    assert [s for s in admin if narrowed(s) not in granted] == []
    dead = generator["read_stream"]("SEQSTATE_EVENTS_DEAD")
    union = {*allowed["writer"], *allowed["projector"], *allowed["demo"], *dead, resync}
    union.add(uncapture)
    assert {narrowed(s) for s in admin} == union
    assert "seqstate.events.*.control" in admin and "$SRV.>" not in admin
    assert generator["denied"](config, "admin") == [
        "seqstate.events.*.control.>",
        "seqstate.events.*.routers.>",
    ]
    assert generator["subscriptions"](config, "admin") == [
        "_SEQSTATE_INBOX.admin.>",
        "$SRV.>",
        "seqstate.svc.*.writer.>",
        "seqstate.svc.*.projector.>",
        "namespace.*.component.*.endpoint.*.active_sequences_events",
    ]


def test_nats_server_accepts_the_role_config() -> None:
    generator = runpy.run_path(str(ROOT / "deploy" / "nats_roles.py"))
    roles = [role.upper() for role in generator["ROLES"]]
    env = {**os.environ, **{f"SEQSTATE_{role}_PASSWORD": "x" for role in roles}}
    result = subprocess.run(
        [find_binary(), "-c", str(CONF), "-t"], capture_output=True, text=True, timeout=30, env=env
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_permissions_violation_is_one_line_naming_the_subject_as_sent() -> None:
    """nats-py hands the server's -ERR over lower-cased; the line shows the subject as the
    client spelled it (API tokens and the configured names restored)."""
    from projector.nats.connection import describe_violation
    from projector.nats.resources import resource_names

    names = resource_names(Config())
    said = 'nats: permissions violation for publish to "$js.api.stream.info.kv_seqstate-registry"'
    assert describe_violation(said, user="router", doing="reading", names=names) == (
        'NATS refused a publish to "$JS.API.STREAM.INFO.KV_seqstate-registry" (permissions '
        "violation for user 'router') while reading"
    )
    events = 'nats: permissions violation for publish to "seqstate.events.default.control"'
    assert describe_violation(events, names=names) == (
        'NATS refused a publish to "seqstate.events.default.control" (permissions violation)'
    )
