"""CPU node agent configuration (environment variables ``TANGRAM_CPU_*``)."""

from __future__ import annotations

import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from services.cpu_manager.docker_config import NonNegInt, PositiveInt
from tangram import config
from tangram.config import MeshConfig

# A Docker network to join (a name, "bridge", "host"), and extra binds for sandboxes,
# comma-separated absolute HOST:CONTAINER[:ro|rw]: checked here, not by the engine later.
NetworkMode = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")]
MOUNT = r"/[^:,]+:/[^:,]+(:(ro|rw))?"
Mounts = Annotated[str, msgspec.Meta(pattern=rf"^\s*({MOUNT}\s*(,\s*({MOUNT}\s*)?)*)?$")]


class CpuManagerConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    node_id: str = msgspec.field(default_factory=lambda: socket.gethostname().split(".")[0])
    state_dir: str = ".state"
    backend: Literal["auto", "process", "docker"] = "auto"
    cores: str = ""  # cpulist to offer (default: the agent's affinity)
    memory_mb: int = 0  # memory to offer (default: all of it)
    heartbeat_s: float = 1.0
    env_ttl_s: float = 3600.0
    # --- docker backend (see docker_config.DockerConfig for what each one does)
    docker_host: str = ""  # "" = $DOCKER_HOST or the default socket
    image: str = "tangram-sandbox:latest"  # default sandbox image (`tangram sandbox-image`)
    exec_mode: Literal["executor", "docker_exec"] = "executor"  # in-container executor, or exec
    cpuset_via: Literal["auto", "cgroup", "docker"] = "auto"  # cgroup files or `docker update`
    pids_limit: PositiveInt = 512  # processes per sandbox
    network_mode: NetworkMode = "bridge"  # for environments that ask for a network (else none)
    warm_pool: NonNegInt = 2  # pre-created containers per pooled image
    pool_images: str = ""  # images with a warm pool, comma-separated ("" = the default image)
    max_envs: PositiveInt = 64  # environments per node
    mounts: Mounts = ""  # extra binds for sandboxes, comma-separated HOST:CONTAINER[:ro|rw]

    def env_root(self) -> Path:
        return Path(self.state_dir).resolve() / "envs" / self.node_id


def split_list(text: str) -> tuple[str, ...]:
    """A comma-separated setting as a tuple, blanks dropped."""
    return tuple(part.strip() for part in text.split(",") if part.strip())


def load(overrides: Mapping[str, Any] | None = None) -> tuple[MeshConfig, CpuManagerConfig]:
    return config.service(CpuManagerConfig, "TANGRAM_CPU_", overrides)


def load_own(overrides: Mapping[str, Any] | None = None) -> CpuManagerConfig:
    """The node agent's own config alone (for the CLI, which decides the backend up front)."""
    cfg: CpuManagerConfig = config.load(CpuManagerConfig, "TANGRAM_CPU_", overrides)
    return cfg
