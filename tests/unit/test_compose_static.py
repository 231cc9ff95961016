"""Static checks of the deployable stack (compose.yaml, compose.hostnet.yaml, docker/): what would otherwise
only fail on `docker-compose up`. The stack itself is run by tests/docker/."""

from __future__ import annotations

import argparse
import importlib
import re
import subprocess
from pathlib import Path
from unittest import mock

import pytest
import yaml
from kvmesh import settings
from kvmesh.bus.nats_server import find_nats_server

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILES = ("compose.yaml", "compose.hostnet.yaml")
KVMESH_MODULES = {"services.router": "router", "services.prefill": "prefill", "services.decode": "decode",
                  "services.cachesvc": "cachesvc"}
OTEL_ENV = {"OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_PROTOCOL",
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"}
SECRET_VARS = {"KVMESH_ROUTER_API_KEY"}  # NATS takes none: each service's certificate is its user
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}")


def load(name: str) -> dict:
    return yaml.safe_load((ROOT / name).read_text())


def interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's ``${VAR}``, ``${VAR:-default}``, ``${VAR:?error}``; required variables come from ``env``."""
    def one(m: re.Match) -> str:
        name, op, arg = m.group(1), m.group(2), m.group(3)
        if name in env:
            return env[name]
        if op in (":-", "-"):
            return arg
        if op in (":?", "?"):
            raise KeyError(name)
        return ""
    return _VAR.sub(one, value)


def merged_services() -> dict[str, dict]:
    """compose.yaml with compose.hostnet.yaml applied, as docker-compose merges them (maps by key, lists
    appended, scalars replaced)."""
    base, over = load("compose.yaml")["services"], load("compose.hostnet.yaml")["services"]
    out = {}
    for name in {**base, **over}:
        merged = dict(base.get(name, {}))
        for key, value in over.get(name, {}).items():
            old = merged.get(key)
            merged[key] = ({**old, **value} if isinstance(value, dict) and isinstance(old, dict)
                           else old + value if isinstance(value, list) and key == "ports" else value)
        out[name] = merged
    return out


def variants() -> list[tuple[str, dict[str, dict]]]:
    return [("compose.yaml", load("compose.yaml")["services"]), ("+ compose.hostnet.yaml", merged_services())]


def kvmesh_services(services: dict[str, dict]) -> dict[str, dict]:
    """The services built from docker/Dockerfile that `up` starts and keeps running (none parked in a profile, no
    init step)."""
    steps = init_steps(services)
    return {n: s for n, s in services.items() if "build" in s and not s.get("profiles") and n not in steps}


def init_steps(services: dict[str, dict]) -> set[str]:
    """Services that run once before the others and exit (``restart: "no"``): the mesh certificates."""
    return {n for n, s in services.items() if isinstance(s, dict) and s.get("restart") == "no"}


def dockerfile_stages(path: Path) -> dict[str, str]:
    """stage name -> its text (from its FROM line to the next)."""
    stages, name, lines = {}, None, []
    for line in path.read_text().splitlines():
        m = re.match(r"FROM\s+\S+\s+AS\s+(\S+)", line, re.IGNORECASE)
        if m:
            if name:
                stages[name] = "\n".join(lines)
            name, lines = m.group(1), []
        lines.append(line)
    if name:
        stages[name] = "\n".join(lines)
    return stages


class _Parsed(Exception):
    pass


def parse_service_command(module: str, args: list[str]) -> argparse.Namespace:
    """Run the service's own argument parser on ``args`` (and nothing after it): SystemExit on a bad flag."""
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, argv=None, namespace=None):
        raise _Parsed(original(self, argv, namespace))

    main = importlib.import_module(f"{module}.__main__").main
    with mock.patch.object(argparse.ArgumentParser, "parse_args", parse_then_stop):
        try:
            main(args)
        except _Parsed as parsed:
            return parsed.args[0]
    raise AssertionError(f"{module} did not parse its arguments")


def test_every_built_service_has_its_dockerfile_context_and_target():
    for name, svc in kvmesh_services(load("compose.yaml")["services"]).items():
        build = svc["build"]
        context = ROOT / build["context"]
        dockerfile = context / build["dockerfile"]
        assert context.is_dir() and dockerfile.is_file(), f"{name}: {dockerfile} missing"
        assert build["target"] in dockerfile_stages(dockerfile), f"{name}: no stage {build['target']}"
        assert svc["image"].startswith("kvmesh/"), f"{name}: tag its image kvmesh/<service>"


def test_every_file_the_dockerfile_copies_exists_and_is_in_the_context():
    text = (ROOT / "docker/Dockerfile").read_text()
    ignore = (ROOT / ".dockerignore").read_text().splitlines()
    included = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    for m in re.finditer(r"^COPY\s+(?!--from)(?:--\S+\s+)*(.+?)\s+\S+$", text, re.MULTILINE):
        for src in m.group(1).split():
            assert (ROOT / src).exists(), f"COPY {src}: not in the repository"
            assert src.split("/")[0].rstrip("/") in included, f"COPY {src}: excluded by .dockerignore"


def stage_chain(stages: dict[str, str], target: str) -> str:
    """The text of ``target`` and of every stage it is built FROM, the target's last (as Docker applies them)."""
    chain = []
    while target in stages:
        chain.insert(0, stages[target])
        target = stages[target].splitlines()[0].split()[1]
    return "\n".join(chain)


def test_images_run_as_a_non_root_user_with_a_healthcheck():
    stages = dockerfile_stages(ROOT / "docker/Dockerfile")
    for svc in kvmesh_services(load("compose.yaml")["services"]).values():
        target = svc["build"]["target"]
        assert stages[target].splitlines()[0].split()[1] in ("runtime", "runtime-light"), \
            f"{target} must build on a runtime stage"
        text = stage_chain(stages, target)
        users = re.findall(r"^USER\s+(\S+)", text, re.MULTILINE)
        assert users and users[-1] not in ("root", "0"), target
        assert re.search(r"^HEALTHCHECK .*\n?.*healthcheck\.py", text, re.MULTILINE), target


def test_router_cachesvc_and_nats_build_on_the_runtime_without_torch():
    stages = dockerfile_stages(ROOT / "docker/Dockerfile")
    for target in ("router", "cachesvc", "nats"):
        assert stages[target].splitlines()[0].split()[1] == "runtime-light", target
    light = stage_chain(stages, "runtime-light")
    assert "--from=build " not in light and "/reqs/torch.txt" not in light  # not the engines' venv
    assert "light.txt" in stages["build-light"]


@pytest.mark.parametrize("variant,services", variants(), ids=[v for v, _ in variants()])
def test_each_container_command_is_a_real_kvmesh_command_line(variant, services):
    stages = dockerfile_stages(ROOT / "docker/Dockerfile")
    for name, svc in kvmesh_services(services).items():
        cmd = svc["command"]
        stage_cmd = re.search(r"^CMD\s+(\[.*\])", stages[svc["build"]["target"]], re.MULTILINE)
        assert stage_cmd, f"{name}: its Dockerfile target has no CMD"
        for argv in (cmd, yaml.safe_load(stage_cmd.group(1))):
            if argv[0] == "nats-server":
                continue  # checked against the real binary below
            assert argv[:2] == ["python", "-m"] and argv[2] in KVMESH_MODULES, f"{name}: {argv}"
            parse_service_command(argv[2], [interpolate(a, {}) for a in argv[3:]])


def test_the_nats_command_and_config_are_accepted_by_nats_server(certs):
    """nats-server runs the nats.conf the mesh-certs step writes (docker/nats.conf, then TLS and the users)."""
    try:
        binary = find_nats_server()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    for _, services in variants():
        argv = [interpolate(a, {}) for a in services["nats"]["command"]]
        assert argv[:3] == ["nats-server", "-c", "/certs/nats.conf"]
        out = subprocess.run([str(binary), "-c", str(certs / "nats.conf"), *argv[3:], "-t"], env={},
                             capture_output=True, text=True, timeout=30, check=False)
        text = out.stdout + out.stderr
        assert out.returncode == 0 and "is valid" in text and "not defined" not in text, text
    assert "COPY docker/nats.conf /etc/kvmesh/nats.conf" in (ROOT / "docker/Dockerfile").read_text()
    conf = (certs / "nats.conf").read_text()
    assert '"verify_and_map": true' in conf and "password" not in conf


def init_step_holders(services: dict[str, dict]) -> list[str]:
    """The ``ROLE/INSTANCE`` arguments of the mesh-certs step's ``python -m kvmesh.mesh_ca /certs ...``."""
    (step,) = init_steps(services)
    script = " ".join(services[step]["command"])
    args = script.split("python -m kvmesh.mesh_ca /certs ", 1)[1].split("&&")[0].split()
    return args


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    """What compose's mesh-certs step writes into the /certs volume (certificates, nats.conf), written here by the
    same commands."""
    from tests.docker.test_nats_permissions import mesh_certs_step

    out = tmp_path_factory.mktemp("certs")
    mesh_certs_step(out, ROOT / "docker" / "nats.conf")
    return out


@pytest.mark.parametrize("variant,services", variants(), ids=[v for v, _ in variants()])
def test_every_environment_key_is_a_known_setting_and_its_value_is_valid(variant, services, certs):
    secrets = {v: "s3cret" for v in SECRET_VARS}
    for name, svc in kvmesh_services(services).items():
        argv = svc["command"]
        env = {k: interpolate(str(v), secrets) for k, v in svc.get("environment", {}).items()}
        env = {k: str(certs) + v.removeprefix("/certs") if v.startswith("/certs/") else v for k, v in env.items()}
        if argv[0] == "nats-server":  # its own certificate, for its healthcheck (docker/healthcheck.py)
            assert set(env) == {"KVMESH_TLS_CERT", "KVMESH_TLS_KEY", "KVMESH_TLS_CA", "KVMESH_TLS_SERVER_NAME"}
            assert all(Path(env[k]).is_file() for k in ("KVMESH_TLS_CERT", "KVMESH_TLS_KEY", "KVMESH_TLS_CA"))
            continue
        service = KVMESH_MODULES[argv[2]]
        reads = {"shared", *settings.ENTRY_POINT_SECTIONS[service]}
        known = settings.env_names()
        unknown = {k for k in env if k not in OTEL_ENV and known.get(k, ("",))[0] not in reads}
        assert not unknown, f"{variant} {name}: {sorted(unknown)} are not settings of {service}"
        host = f"KVMESH_{settings.ENTRY_POINT_SECTIONS[service][0].upper()}_HOST"
        if env.get(host) == "auto":  # the entrypoint puts the container's address there
            env[host] = "10.0.0.2"
        parse_service_command(argv[2], argv[3:])  # its own parser accepts the command line
        settings.load_entry_point(service, argv[3:], env)  # raises on a bad value or an unknown variable


def _kvmesh_names(text: str) -> set[str]:
    return set(re.findall(r"\bKVMESH_[A-Z0-9_]*[A-Z0-9]\b", text))


@pytest.mark.parametrize("file", [*COMPOSE_FILES, "deploy/example.env", "deploy/prometheus.yml",
                                  "docker/entrypoint.py", "docs/deploy.md", ".ci/run", "Makefile"])
def test_every_kvmesh_name_in_the_deploy_files_is_a_setting_or_a_documented_non_setting(file):
    """Environment keys, ${...} interpolations and comments alike: an old flat name would stop a service."""
    known = settings.env_names()
    secret_files = {n for n in _kvmesh_names((ROOT / file).read_text())
                    if n.endswith("_FILE") and n[:-len("_FILE")] in known}
    names = _kvmesh_names((ROOT / file).read_text()) - secret_files
    bad = sorted(n for n in names if n not in known and n not in settings.NOT_SETTINGS)
    assert not bad, f"{file}: {bad} are neither settings (docs/configuration.md) nor in settings.NOT_SETTINGS"
    documented = (ROOT / "docs/configuration.md").read_text()
    assert all(f"`{n}`" in documented for n in names), "every name is in the generated reference"


def test_only_the_router_publishes_ports():
    for name, svc in load("compose.yaml")["services"].items():
        if name in ("router", "router-2") or not svc.get("ports"):  # router-2: the replicas profile
            continue
        assert svc.get("profiles") == ["observability"], f"{name} publishes ports"
        for port in svc["ports"]:
            assert str(port).startswith("127.0.0.1:"), f"{name}: {port} must stay on the host's loopback"
    running = {n: s for n, s in merged_services().items() if not s.get("profiles")}
    assert "router" not in running and "router-host" in running and "mesh-certs" in init_steps(running)
    for name, svc in running.items():
        assert not svc.get("ports") and svc["network_mode"] == "host", name


def test_secrets_come_from_the_environment_never_from_the_files():
    for file in COMPOSE_FILES:
        for name, svc in load(file)["services"].items():
            for key, value in svc.get("environment", {}).items():
                value = str(value)
                assert not ("://" in value and "@" in value), f"{file} {name} {key}: credentials in a URL"
                assert "PASSWORD" not in value, f"{file} {name} {key}: NATS authenticates by certificate"
                if key in SECRET_VARS:
                    ref = _VAR.fullmatch(value)
                    assert ref and ref.group(1) == key, (file, name, key)
    assert "password" not in (ROOT / "docker/nats.conf").read_text()


def test_every_nats_url_has_no_password_and_nats_requires_tls(certs):
    """Each service authenticates to NATS by its certificate: the step's nats.conf asks every client for one
    (``verify_and_map``) and names one user per certificate of a service that connects to NATS."""
    from kvmesh.bus.bus import tls_required

    conf = (certs / "nats.conf").read_text()
    assert re.search(r'"verify_and_map": true', conf) and '"ca_file"' in conf
    users = set(re.findall(r'"user": "spiffe://kvmesh/([^"]+)"', conf))
    for variant, services in variants():
        for name, svc in kvmesh_services(services).items():
            env = {k: str(v) for k, v in svc.get("environment", {}).items()}
            if "KVMESH_NATS_URL" not in env:
                assert svc["command"][0] == "nats-server", f"{variant} {name}: no KVMESH_NATS_URL"
                continue
            url = interpolate(env["KVMESH_NATS_URL"], {})
            assert tls_required(url) and "@" not in url, f"{variant} {name}: {url}"
            holder = env["KVMESH_TLS_CERT"].removeprefix("/certs/").removesuffix(".pem").replace("-", "/", 1)
            assert holder in users, f"{variant} {name}: its certificate {holder} is no NATS user"


@pytest.mark.parametrize("variant,services", variants(), ids=[v for v, _ in variants()])
def test_services_start_in_order_of_health(variant, services):
    running = kvmesh_services(services)
    steps = init_steps(services)
    for name, svc in running.items():
        for dep, cond in svc.get("depends_on", {}).items():
            if dep in steps:  # the certificates are written before anything that presents them starts
                assert cond == {"condition": "service_completed_successfully"}, f"{name} -> {dep}"
                continue
            assert dep in running and cond == {"condition": "service_healthy"}, f"{name} -> {dep}"
    router = running.get("router") or running["router-host"]
    assert set(router["depends_on"]) - steps == {"nats", "cachesvc", "prefill", "decode"}
    assert "container_name" not in services["prefill"] and "container_name" not in services["decode"]


@pytest.mark.parametrize("variant,services", variants(), ids=[v for v, _ in variants()])
def test_engines_get_longer_than_their_drain_before_the_sigkill(variant, services):
    """compose stops a container with SIGTERM, then SIGKILL after its stop_grace_period (10 s unless set): an
    engine drains first (``[instance] drain_s``), so its grace must outlast that."""
    from kvmesh.settings import InstanceSettings

    for name, svc in kvmesh_services(services).items():
        if svc["command"][2] not in ("services.prefill", "services.decode"):
            continue
        grace = re.fullmatch(r"(\d+)s", str(svc.get("stop_grace_period", "10s")))
        drain = float(svc.get("environment", {}).get("KVMESH_INSTANCE_DRAIN_S", InstanceSettings().drain_s))
        assert grace and int(grace.group(1)) > drain, f"{name}: stop_grace_period {svc.get('stop_grace_period')}"


def test_prometheus_scrapes_every_kvmesh_service():
    scraped = {n for job in load("deploy/prometheus.yml")["scrape_configs"] for sd in job["dns_sd_configs"]
               for n in sd["names"]}
    services = load("compose.yaml")["services"]
    built = {n for n, s in services.items() if "build" in s}  # profiles' too
    assert scraped == built - {"nats"} - init_steps(services)
    for job in load("deploy/prometheus.yml")["scrape_configs"]:  # on the port each serves /metrics on
        for sd in job["dns_sd_configs"]:
            for name in sd["names"]:
                env = services[name]["environment"]
                port = next(str(v) for k, v in env.items() if k.endswith("_METRICS_PORT"))
                assert str(sd["port"]) == port, f"{name}: scraped on {sd['port']}, serves /metrics on {port}"


@pytest.mark.parametrize("variant,services", variants(), ids=[v for v, _ in variants()])
def test_every_service_that_calls_the_mesh_presents_a_certificate_of_the_init_step(variant, services):
    """mTLS is on by default: each kvmesh service mounts the certificates the mesh-certs step writes, presents its
    role's, and starts after the step; the step writes each of them (role/instance names the certificate)."""
    from kvmesh.identity import MeshRole

    (step,) = init_steps(services)
    written = {a.split("=")[0] for a in init_step_holders(services)}
    assert all(MeshRole(a.split("/")[0]) for a in written)

    def after_step(name: str) -> bool:  # started after the step, directly or through what it waits for
        deps = services[name].get("depends_on", {})
        return deps.get(step) == {"condition": "service_completed_successfully"} or any(
            after_step(d) for d in deps if d != step)

    for name, svc in kvmesh_services(services).items():
        env = svc.get("environment", {})
        cert = env.get("KVMESH_TLS_CERT", "")
        assert cert.startswith("/certs/") and env.get("KVMESH_TLS_CA") == "/certs/ca.pem", f"{variant} {name}"
        assert cert.removeprefix("/certs/").removesuffix(".pem").replace("-", "/", 1) in written, (name, cert)
        assert any(str(v).startswith("mesh-certs:/certs") for v in svc.get("volumes", [])), name
        assert after_step(name), f"{name} may start before {step} wrote the certificates"
