"""deploy/k8s's pods, run as the kubelet would run them, on the NATS that docs/kubernetes.md says.

The server: deploy/nats-roles.conf with ``no_auth_user: dynamo`` beside it (how
docs/kubernetes.md lets Dynamo's pods, which connect without credentials, in unchanged), its
passwords from its environment. Each Deployment of the rendered base runs as its container
says: its command, its environment from the ConfigMaps it names and its Secret's key (the
role's password), its token file from its Secret volume. Only what a pod's network gives
(``NATS_URL``: this server; the ports, on loopback and free) differs. A client without
credentials publishes the shared capture of a real fleet on Dynamo's subject, as Dynamo's
frontends do: the writer and the projector fold it, every probe the manifests ask answers
200, and serve-http answers a call with the Secret's token and refuses one without. No
process is refused anything by the server.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats
from dynamo_capture import CAPTURE, SUBJECT
from eventually import eventually
from http_kit import exchange, free_port, http_get
from k8s_kit import by_kind, environment, render, with_mounted_secrets
from prometheus_client.parser import text_string_to_metric_families

from projector.nats.server import NatsServer

REPO = Path(__file__).resolve().parents[2]
ROLES_CONF = REPO / "deploy" / "nats-roles.conf"


def on_loopback(command: list[str], ports: dict[str, int]) -> list[str]:
    """The command with its addresses on loopback and its ports moved to free ones."""
    out = list(command)
    for i, token in enumerate(out[:-1]):
        if token in ("--host", "--metrics-host"):
            assert out[i + 1] == "0.0.0.0", out
            out[i + 1] = "127.0.0.1"
        elif token in ("--port", "--metrics-port"):
            out[i + 1] = str(ports[token])
    return out


@dataclass
class Pod:
    ports: dict[str, int]  # --port and --metrics-port, as moved
    env: dict[str, str]  # the container's environment

    async def exec(self, *argv: str) -> tuple[int, str]:
        """``kubectl exec`` of a command in the pod: its environment; exit status and output."""
        proc = await asyncio.create_subprocess_exec(
            *argv, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        out, _ = await asyncio.wait_for(proc.communicate(), 60)
        return proc.returncode or 0, out.decode()


@asynccontextmanager
async def pod(
    objects: list[dict[str, Any]],
    name: str,
    url: str,
    passwords: dict[str, str],
    tmp: Path,
) -> AsyncIterator[Pod]:
    """The Deployment's container as a process; SIGTERM at the end, which must stop it
    cleanly."""
    deployment = by_kind(objects, "Deployment")[name]
    container = with_mounted_secrets(deployment, tmp / name)
    ports = {"--port": free_port(), "--metrics-port": free_port()}
    env = {k: v for k, v in os.environ.items() if k != "NATS_URL" and not k.startswith("SEQSTATE_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    for key, value in environment(objects, container).items():
        env[key] = value
    for var in container["env"]:
        if "valueFrom" in var:
            env[var["name"]] = passwords[var["valueFrom"]["secretKeyRef"]["key"]]
    env["NATS_URL"] = url
    log = tmp / f"{name}.log"
    with log.open("wb") as out:
        proc = await asyncio.create_subprocess_exec(
            *on_loopback(container["command"], ports),
            env=env,
            cwd=tmp,
            stdout=subprocess.DEVNULL,
            stderr=out,
        )
    try:
        yield Pod(ports, env)
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        rc = await asyncio.wait_for(proc.wait(), 30)
    text = log.read_text()
    assert rc == 0, text
    assert "Traceback" not in text and "permissions violation" not in text, text


def applied(text: str) -> dict[str, float]:
    return {
        s.labels["role"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "seqstate_applied_seq"
    }


def messages_folded(text: str) -> float:
    """Dynamo messages the writer decided, each its own count though a record batch holds
    many: every outcome of an event (expiry and orphaning count requests, not messages), and
    every dead letter."""
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if (
            s.name == "seqstate_events_total" and s.labels["outcome"] not in ("expired", "orphaned")
        )
        or (s.name == "seqstate_dead_letters_total" and s.labels.get("role") == "writer")
    )


async def probe(port: int, path: str) -> int:
    status, _, _ = await http_get(port, path)
    return status


async def test_the_base_runs_beside_dynamo_on_the_roles_config(tmp_path: Path) -> None:
    objects = render()
    roles = ("router", "scheduler", "chooser", "control", "writer", "projector")
    roles += ("replay", "demo", "admin", "dynamo")
    passwords = {f"SEQSTATE_{role.upper()}_PASSWORD": f"pw-{role}-k8s" for role in roles}
    # nats-server includes relative to the including file: the role config beside it.
    (tmp_path / ROLES_CONF.name).write_text(ROLES_CONF.read_text())
    conf = tmp_path / "nats.conf"
    conf.write_text(f'include "{ROLES_CONF.name}"\nno_auth_user: dynamo\n')
    saved = dict(os.environ)
    os.environ.update(passwords)  # the role config reads them from the server's environment
    try:
        server = NatsServer(tmp_path / "js", extra_args=("-c", str(conf)))
        server.start()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    try:
        async with AsyncExitStack() as stack:
            running = {
                name: await stack.enter_async_context(
                    pod(objects, name, server.url, passwords, tmp_path)
                )
                for name in sorted(by_kind(objects, "Deployment"))
            }
            for name, ports in running.items():
                for path in ("/healthz", "/readyz"):
                    await eventually(
                        lambda p=ports.ports["--metrics-port"], path=path: probe(p, path),
                        lambda status: status == 200,
                        what=f"{name}: {path} answers 200",
                        interval=0.1,
                        retry_on=(OSError,),
                    )

            # Dynamo's frontends, connecting without credentials, as the dynamo user.
            dynamo = await nats.connect(server.url)
            try:
                for message in CAPTURE:
                    await dynamo.publish(SUBJECT, message.data)
                await dynamo.flush()
            finally:
                await dynamo.close()
            writer = running["seqstate-writer"].ports["--metrics-port"]
            projector = running["seqstate-projector"].ports["--metrics-port"]
            folded = await eventually(
                lambda: http_get(writer, "/metrics"),
                lambda got: messages_folded(got[2]) >= len(CAPTURE),
                what="the writer folded the capture",
                interval=0.1,
            )
            last = applied(folded[2])["writer"]
            await eventually(
                lambda: http_get(projector, "/metrics"),
                lambda got: applied(got[2]).get("projector") == last,
                what="the projector's bucket at the writer's position",
                interval=0.1,
            )
            for port in (writer, projector):
                assert await probe(port, "/readyz") == 200

            http = running["seqstate-serve-http"].ports["--port"]
            token = (tmp_path / "seqstate-serve-http" / "http-token" / "token").read_text()
            call = [("GET", "/loads", None)]
            (refused,) = await exchange(http, call)
            (answered,) = await exchange(http, call, token=token.strip())
            assert (refused[0], answered[0]) == (401, 200), (refused, answered)

            # What docs/kubernetes.md runs in a serve-http pod (the admin role), and the
            # status it reads through a port-forward as the replay role.
            admin = running["seqstate-serve-http"]
            endpoint = by_kind(objects, "ConfigMap")["seqstate-pipeline"]["data"]
            dynamo_flag = ("--dynamo-endpoint", endpoint["SEQSTATE_DYNAMO_ENDPOINT"])
            for argv in (("snapshot", "save", *dynamo_flag), ("dynamo", "resync", *dynamo_flag)):
                rc, out = await admin.exec("seqstate", *argv)
                assert rc == 0 and "permission" not in out, (argv, out)
            replay = Pod(
                {},
                {
                    **admin.env,
                    "SEQSTATE_NATS_USER": "replay",
                    "SEQSTATE_NATS_PASSWORD": passwords["SEQSTATE_REPLAY_PASSWORD"],
                },
            )
            rc, out = await replay.exec("seqstate", "status")
            assert rc == 0 and "permission" not in out, out
    finally:
        server.stop()
