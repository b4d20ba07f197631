"""The node agent's typed config, with the Docker backend's nested in it, from flat
``TANGRAM_CPU_*`` variables (env vars are read only in config.py)."""

from __future__ import annotations

import pytest

from services.cpu_manager.config import load_own
from services.cpu_manager.docker.config import DockerConfig
from tangram.errors import InvalidRequest

DOCKER_SETTINGS = {
    "TANGRAM_CPU_EXEC_MODE": "docker_exec",
    "TANGRAM_CPU_CPUSET_VIA": "docker",
    "TANGRAM_CPU_PIDS_LIMIT": "64",
    "TANGRAM_CPU_NETWORK_MODE": "host",
    "TANGRAM_CPU_WARM_POOL": "3",
    "TANGRAM_CPU_POOL_IMAGES": "img-a:1, img-b:2,",
    "TANGRAM_CPU_MAX_ENVS": "9",
    "TANGRAM_CPU_MOUNTS": "/usr:/usr:ro,/etc:/etc",
    "TANGRAM_CPU_IMAGE": "img-a:1",
    "TANGRAM_CPU_EXEC_GRACE_S": "2.5",
}


def test_docker_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in DOCKER_SETTINGS.items():
        monkeypatch.setenv(name, value)
    cfg = load_own({"node_id": "n1", "state_dir": "/tmp/s"})
    dcfg = cfg.docker_for("inc")
    assert (dcfg.exec_mode, dcfg.cpuset_via) == ("docker_exec", "docker")
    assert (dcfg.pids_limit, dcfg.network_mode, dcfg.max_envs) == (64, "host", 9)
    assert (dcfg.warm_pool, dcfg.pool_images) == (3, ("img-a:1", "img-b:2"))
    assert dcfg.images_to_pool() == ("img-a:1", "img-b:2")
    assert dcfg.mounts == ("/usr:/usr:ro", "/etc:/etc")
    assert (dcfg.image, dcfg.exec_grace_s) == ("img-a:1", 2.5)
    assert (dcfg.node_id, dcfg.incarnation) == ("n1", "inc")
    assert dcfg.root == str(cfg.env_root())


def test_overrides_win_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANGRAM_CPU_EXEC_MODE", "docker_exec")
    monkeypatch.setenv("TANGRAM_CPU_HEARTBEAT_S", "7")
    cfg = load_own({"exec_mode": "executor", "heartbeat_s": 0.5, "nats_url": "ignored"})
    assert (cfg.docker.exec_mode, cfg.heartbeat_s) == ("executor", 0.5)


def test_the_node_fields_are_the_agents_not_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANGRAM_CPU_ROOT", "/elsewhere")
    monkeypatch.setenv("TANGRAM_CPU_INCARNATION", "forged")
    dcfg = load_own({"node_id": "n1", "state_dir": "/tmp/s"}).docker_for("inc")
    assert (dcfg.root, dcfg.incarnation) == ("/tmp/s/envs/n1", "inc")


def test_defaults_are_the_fast_path(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in DOCKER_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    dcfg = load_own({"node_id": "n1"}).docker_for("inc")
    assert (dcfg.exec_mode, dcfg.cpuset_via, dcfg.pool_images) == ("executor", "auto", ())
    assert dcfg == DockerConfig(root=dcfg.root, node_id="n1", incarnation="inc")


@pytest.mark.parametrize(
    ("name", "value", "field"),
    [
        ("TANGRAM_CPU_EXEC_MODE", "fast", "$.docker.exec_mode"),
        ("TANGRAM_CPU_CPUSET_VIA", "magic", "$.docker.cpuset_via"),
        ("TANGRAM_CPU_PIDS_LIMIT", "0", "$.docker.pids_limit"),
        ("TANGRAM_CPU_BACKEND", "podman", "$.backend"),
        ("TANGRAM_CPU_HEARTBEAT_S", "often", "$.heartbeat_s"),
        ("TANGRAM_CPU_WARM_POOL", "-1", "$.docker.warm_pool"),
        ("TANGRAM_CPU_NETWORK_MODE", "bridge; rm -rf /", "$.docker.network_mode"),
        ("TANGRAM_CPU_NETWORK_MODE", "", "$.docker.network_mode"),
        ("TANGRAM_CPU_MOUNTS", "relative:/x", "$.docker.mounts[0]"),
        ("TANGRAM_CPU_MOUNTS", "/a:/b:rx", "$.docker.mounts[0]"),
        ("TANGRAM_CPU_MOUNTS", "/a:/b,/only-one", "$.docker.mounts[1]"),
    ],
)
def test_bad_values_fail_loudly_naming_the_field(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str, field: str
) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(InvalidRequest, match="CpuManagerConfig") as err:
        load_own()
    assert f"at `{field}`" in str(err.value)
