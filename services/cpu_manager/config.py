"""CPU node agent configuration (environment variables ``TANGRAM_CPU_*``).

The Docker backend's settings are a nested Struct (``CpuManagerConfig.docker``), yet set with
the same flat names as the agent's own: ``TANGRAM_CPU_EXEC_MODE`` sets ``docker.exec_mode``.
Comma-separated values fill the list settings (``TANGRAM_CPU_MOUNTS=/a:/a:ro,/b:/b``). A bad
value fails at load, naming the field (``$.docker.exec_mode``).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import msgspec

from services.cpu_manager.docker.config import NODE_FIELDS, DockerConfig
from tangram import config
from tangram.config import MeshConfig
from tangram.errors import InvalidRequest

PREFIX = "TANGRAM_CPU_"
DOCKER_SETTINGS = tuple(f for f in DockerConfig.__struct_fields__ if f not in NODE_FIELDS)
LISTS = frozenset({"mounts", "pool_images"})  # comma-separated in the environment


class CpuManagerConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    node_id: str = msgspec.field(default_factory=lambda: socket.gethostname().split(".")[0])
    state_dir: str = ".state"
    backend: Literal["auto", "process", "docker"] = "auto"
    cores: str = ""  # cpulist to offer (default: the agent's affinity)
    memory_mb: int = 0  # memory to offer (default: all of it)
    heartbeat_s: float = 1.0
    env_ttl_s: float = 3600.0
    # The process backend run as root: each trajectory's actions as an unprivileged uid of its
    # own, its directory closed to the others (off: as the agent's user; see process.users).
    trajectory_uids: bool = True
    # The process backend starts actions through tangram-spawner (see process.spawner); off,
    # or where it cannot be built, the agent forks them itself.
    spawner: bool = True
    docker: DockerConfig = msgspec.field(default_factory=DockerConfig)

    def env_root(self) -> Path:
        return Path(self.state_dir).resolve() / "envs" / self.node_id

    def docker_for(self, incarnation: str) -> DockerConfig:
        """The Docker backend's config on this node, for this incarnation of the agent."""
        return msgspec.structs.replace(
            self.docker, root=str(self.env_root()), node_id=self.node_id, incarnation=incarnation
        )


def split_list(text: str) -> tuple[str, ...]:
    """A comma-separated setting as a tuple, blanks dropped."""
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _docker_raw(values: Mapping[str, Any]) -> dict[str, Any]:
    found = {k: values[k] for k in DOCKER_SETTINGS if values.get(k) is not None}
    for name in LISTS & found.keys():
        if isinstance(found[name], str):
            found[name] = split_list(found[name])
    return found


def _own_raw(values: Mapping[str, Any]) -> dict[str, Any]:
    own = set(CpuManagerConfig.__struct_fields__) - {"docker"}
    return {k: v for k, v in values.items() if k in own and v is not None}


def load_own(
    overrides: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None
) -> CpuManagerConfig:
    """The node agent's own config: ``overrides`` (flat names, as in the environment) over
    ``TANGRAM_CPU_*`` over the defaults. Bad values raise InvalidRequest naming the field."""
    environ = os.environ if environ is None else environ
    names = {*CpuManagerConfig.__struct_fields__, *DOCKER_SETTINGS} - {"docker"}
    values: dict[str, Any] = {n: environ.get(f"{PREFIX}{n.upper()}") for n in names}
    values.update({k: v for k, v in (overrides or {}).items() if v is not None})
    raw = _own_raw(values) | {"docker": _docker_raw(values)}
    try:
        return msgspec.convert(raw, CpuManagerConfig, strict=False)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"bad CpuManagerConfig: {exc}") from exc


def load(overrides: Mapping[str, Any] | None = None) -> tuple[MeshConfig, CpuManagerConfig]:
    """The mesh config and the node agent's; each takes the ``overrides`` that name its fields."""
    return config.mesh(overrides), load_own(overrides)
