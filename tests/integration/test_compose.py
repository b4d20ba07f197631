"""compose/docker-compose.yml validates with a real compose tool and wires the mesh as meant.

The tool is ``docker compose`` (v2 plugin) or Debian's ``docker-compose``; ``make docker-engine``
(scripts/compose-tool.sh) installs one. ``config`` needs no Docker engine.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tangram import auth

COMPOSE = Path(__file__).parents[2] / "compose" / "docker-compose.yml"
TANGRAM_SERVICES = ("gateway", "scheduler", "cpu_manager", "quota_manager", "gpu_manager")
TANGRAM_SERVICES += ("dashboard",)
MINIMAL = """\
services:
  nats:
    image: nats:2.10-alpine
  gateway:
    image: {image}
    depends_on: {{nats: {{condition: {condition}}}}}
"""


def _works(argv: list[str]) -> bool:
    if shutil.which(argv[0]) is None:
        return False
    probe = subprocess.run([*argv, "version"], capture_output=True, timeout=30, check=False)
    return probe.returncode == 0


@functools.cache
def _find_tool() -> tuple[str, ...] | None:
    for argv in (["docker", "compose"], ["docker-compose"]):
        if _works(argv):
            return tuple(argv)
    return None


def compose_tool() -> list[str]:
    """The compose command line; skips without one (fails when CI=true)."""
    if (found := _find_tool()) is not None:
        return list(found)
    reason = "no compose tool (docker compose / docker-compose); run scripts/compose-tool.sh"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(reason)
    pytest.skip(reason)


def config(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*compose_tool(), "-f", str(path), "config"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.fixture(scope="module")
def services() -> dict[str, Any]:
    out = config(COMPOSE)
    assert out.returncode == 0, out.stderr
    spec = yaml.safe_load(out.stdout)
    return spec["services"]


def test_every_service_is_defined(services: dict[str, Any]):
    assert {"nats", "postgres", "jaeger", *TANGRAM_SERVICES} <= set(services)


def test_infrastructure(services: dict[str, Any]):
    nats = services["nats"]
    assert "-js" in nats["command"]
    assert "-m" in nats["command"]
    assert any("8222/healthz" in part for part in nats["healthcheck"]["test"])
    assert "pg_isready" in str(services["postgres"]["healthcheck"]["test"])
    jaeger = services["jaeger"]
    assert any(str(p.get("published")) == "16686" for p in jaeger["ports"])
    assert jaeger["environment"]["COLLECTOR_OTLP_ENABLED"] == "true"


@pytest.mark.parametrize("name", TANGRAM_SERVICES)
def test_tangram_service_wiring(services: dict[str, Any], name: str):
    svc = services[name]
    assert svc["build"]["dockerfile"] == "compose/Dockerfile"
    assert svc["command"][-1] == f"services.{name}"
    assert svc["healthcheck"]["test"]
    assert svc["restart"]
    for dep in ("nats", "postgres"):
        assert svc["depends_on"][dep]["condition"] == "service_healthy"
    assert svc["depends_on"]["auth-postgres"]["condition"] == "service_completed_successfully"
    env = svc["environment"]
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4318"
    assert env["TANGRAM_NATS_URL"] == "nats://nats:4222"
    assert env["TANGRAM_CREDS"].startswith("/var/lib/tangram-keys/auth/")
    assert "TANGRAM_POSTGRES_DSN" in env  # its own role's (test_compose_auth.py), or none


def test_cpu_manager_runs_docker_with_the_sandbox_image_built_first(services: dict[str, Any]):
    """Never the unisolated process backend inside its container: docker, with the sandbox
    image the one-shot sandbox-image target builds before it starts."""
    cpu = services["cpu_manager"]
    assert cpu["environment"]["TANGRAM_CPU_BACKEND"] == "docker"
    assert any("/var/run/docker.sock:/var/run/docker.sock" in str(v) for v in cpu["volumes"])
    built = services["sandbox-image"]
    assert built["command"] == ["tangram", "sandbox-image"]
    assert any("/var/run/docker.sock:/var/run/docker.sock" in str(v) for v in built["volumes"])
    assert cpu["depends_on"]["sandbox-image"]["condition"] == "service_completed_successfully"
    dockerfile = (COMPOSE.parent / "Dockerfile").read_text()
    assert "ENV TANGRAM_IN_CONTAINER=1" in dockerfile  # choice.py: no fallback in a container


def test_the_scheduler_runs_the_elastic_policy_the_readme_describes(services: dict[str, Any]):
    assert services["scheduler"]["environment"]["TANGRAM_SCHEDULER_POLICY"] == "elastic"


def test_a_standby_scheduler_and_every_long_running_service_restarts(services: dict[str, Any]):
    """Docker brings back what dies (the one-shot sandbox-image build aside); a second
    scheduler stands by for the lead (services/scheduler/leadership.py)."""
    standby, scheduler = services["scheduler-standby"], services["scheduler"]
    assert standby["command"] == scheduler["command"]
    assert standby["environment"] == scheduler["environment"]
    one_shot = {"sandbox-image", "auth-nats", "auth-postgres"}
    for name, svc in services.items():
        assert svc["restart"] == ("no" if name in one_shot else "unless-stopped"), name


@pytest.mark.parametrize("name", TANGRAM_SERVICES)
def test_each_service_is_probed_itself_not_just_nats(services: dict[str, Any], name: str):
    """Its own /readyz (bus connected, Postgres usable): a probe that needs no credential."""
    test = services[name]["healthcheck"]["test"]
    assert test[:3] == ["CMD", "python", "-c"]
    assert "http://127.0.0.1:9464/readyz" in test[3]
    assert services[name]["environment"]["TANGRAM_OPS_PORT"] == "9464"


def test_the_build_context_leaves_out_the_venv():
    ignore = (COMPOSE.parents[1] / ".dockerignore").read_text().splitlines()
    assert ignore[ignore.index("*") :][:1] == ["*"]  # everything out by default ...
    assert {"!libs/", "!services/", "!pyproject.toml", "!README.md"} <= set(ignore)
    assert not any(line.startswith("!.venv") for line in ignore)  # ... the venv above all


@pytest.mark.parametrize(
    ("image", "condition", "valid"),
    [
        ("tangram:dev", "service_started", True),  # control: the same file, correct
        ("42", "maybe", False),  # image not a string; no such condition
    ],
)
def test_the_tool_rejects_a_broken_file(tmp_path: Path, image: str, condition: str, valid: bool):
    path = tmp_path / "docker-compose.yml"
    path.write_text(MINIMAL.format(image=image, condition=condition))
    out = config(path)
    if valid:
        assert out.returncode == 0, out.stderr
    else:
        assert out.returncode != 0, out.stdout
        assert "gateway" in out.stderr + out.stdout


def test_the_dashboard_asks_for_its_token_and_listens_on_loopback(services: dict[str, Any]):
    """Its pages show every client's commands and outputs: published on the host's loopback
    alone, its token the one auth-nats made in the keys volume (or TANGRAM_DASHBOARD_TOKEN)."""
    dash = services["dashboard"]
    env = dash["environment"]
    keys = Path("/var/lib/tangram-keys") / auth.AUTH_DIR
    assert env["TANGRAM_DASHBOARD_TOKEN_FILE"] == str(keys / auth.DASHBOARD_TOKEN)
    assert env["TANGRAM_DASHBOARD_TOKEN"] == ""  # unless given when compose runs
    ports = [  # (host ip, published): the short syntax (docker-compose 1) or the long one
        tuple(p.split(":")[:2]) if isinstance(p, str) else (p.get("host_ip"), str(p["published"]))
        for p in dash["ports"]
    ]
    assert ports == [("127.0.0.1", "8265")]
