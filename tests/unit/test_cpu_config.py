"""The node agent's typed config reaches the Docker backend's (env vars read only in config.py)."""

from __future__ import annotations

import pytest

from services.cpu_manager.backends import docker_config
from services.cpu_manager.config import load_own
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
}


def test_docker_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in DOCKER_SETTINGS.items():
        monkeypatch.setenv(name, value)
    dcfg = docker_config(load_own({"node_id": "n1", "state_dir": "/tmp/s"}), "inc")
    assert (dcfg.exec_mode, dcfg.cpuset_via) == ("docker_exec", "docker")
    assert (dcfg.pids_limit, dcfg.network_mode, dcfg.max_envs) == (64, "host", 9)
    assert (dcfg.warm_pool, dcfg.pool_images) == (3, ("img-a:1", "img-b:2"))
    assert dcfg.images_to_pool() == ("img-a:1", "img-b:2")
    assert dcfg.mounts == ("/usr:/usr:ro", "/etc:/etc")
    assert (dcfg.node_id, dcfg.incarnation) == ("n1", "inc")


def test_defaults_are_the_fast_path(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in DOCKER_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    dcfg = docker_config(load_own({"node_id": "n1"}), "inc")
    assert (dcfg.exec_mode, dcfg.cpuset_via, dcfg.pool_images) == ("executor", "auto", ())


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("TANGRAM_CPU_EXEC_MODE", "fast"),
        ("TANGRAM_CPU_CPUSET_VIA", "magic"),
        ("TANGRAM_CPU_PIDS_LIMIT", "0"),
        ("TANGRAM_CPU_BACKEND", "podman"),
        ("TANGRAM_CPU_WARM_POOL", "-1"),
        ("TANGRAM_CPU_NETWORK_MODE", "bridge; rm -rf /"),
        ("TANGRAM_CPU_NETWORK_MODE", ""),
        ("TANGRAM_CPU_MOUNTS", "relative:/x"),
        ("TANGRAM_CPU_MOUNTS", "/a:/b:rx"),
        ("TANGRAM_CPU_MOUNTS", "/a:/b,/only-one"),
    ],
)
def test_bad_values_fail_loudly(monkeypatch: pytest.MonkeyPatch, name: str, value: str) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(InvalidRequest, match="CpuManagerConfig") as err:
        load_own()
    assert f"$.{name.removeprefix('TANGRAM_CPU_').lower()}" in str(err.value)  # names the field
