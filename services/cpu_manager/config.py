"""CPU node agent configuration (environment variables ``TANGRAM_CPU_*``)."""

from __future__ import annotations

import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec

from tangram import config
from tangram.config import MeshConfig


class CpuManagerConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    node_id: str = msgspec.field(default_factory=lambda: socket.gethostname().split(".")[0])
    state_dir: str = ".state"
    backend: str = "auto"  # auto | process | docker
    cores: str = ""  # cpulist to offer (default: the agent's affinity)
    memory_mb: int = 0  # memory to offer (default: all of it)
    heartbeat_s: float = 1.0
    env_ttl_s: float = 3600.0
    docker_host: str = ""  # "" = $DOCKER_HOST or the default socket
    image: str = "tangram-sandbox:latest"  # default sandbox image of the docker backend
    warm_pool: int = 2  # pre-created containers per image (docker backend)
    max_envs: int = 64  # environments per node (docker backend)
    mounts: str = ""  # extra binds for sandboxes, comma-separated HOST:CONTAINER[:ro|rw]

    def env_root(self) -> Path:
        return Path(self.state_dir).resolve() / "envs" / self.node_id


def load(overrides: Mapping[str, Any] | None = None) -> tuple[MeshConfig, CpuManagerConfig]:
    own = {k: v for k, v in (overrides or {}).items() if k in CpuManagerConfig.__struct_fields__}
    return config.mesh(overrides), config.load(CpuManagerConfig, "TANGRAM_CPU_", own)
