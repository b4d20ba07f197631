"""Typed configuration of the Docker backend: one Struct, embedded or built by the agent."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]


class DockerConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """How the Docker backend makes, pins, locks down and pools per-trajectory containers."""

    root: str  # host dir for each env's work/ and ctl/ dirs; dockerd must see the same path
    docker_host: str = ""  # "" = $DOCKER_HOST or the default socket
    node_id: str = "node"
    incarnation: str = ""
    default_image: str = "tangram-sandbox:latest"
    # executor: a request over a unix socket to the container's entrypoint (fast path);
    # docker_exec: one `docker exec` per action (images without python3, or to compare).
    exec_mode: Literal["executor", "docker_exec"] = "executor"
    # cgroup: write the container's cpuset/quota files; docker: `docker update`; auto: cgroup
    # where the container's cgroup is visible and owned, docker otherwise.
    cpuset_via: Literal["auto", "cgroup", "docker"] = "auto"
    cgroup_root: str = "/sys/fs/cgroup"
    python: str = "python3"  # the interpreter inside the image that runs the executor
    user: str = "65534:65534"  # "" = the image's user; numeric works in any image
    workdir: str = "/work"
    memory_mb: PositiveInt = 512  # warm-pool containers; an env gets its first action's memory_mb
    pids_limit: PositiveInt = 512
    tmpfs_mb: PositiveInt = 64  # /tmp, counted against the container's memory
    network_mode: str = "bridge"  # used only for environments that ask for a network
    mounts: tuple[str, ...] = ()  # extra binds "HOST:CONTAINER[:ro|rw]" (read-only by default)
    max_envs: PositiveInt = 64  # trajectory environments per node (the pool is extra)
    warm_pool: NonNegInt = 2  # pre-created containers per pooled image
    pool_images: tuple[str, ...] = ()  # () = (default_image,)
    api_timeout_s: PositiveFloat = 30.0
    threads: PositiveInt = 16  # Docker SDK calls run on this many threads, never on the loop
    ready_timeout_s: PositiveFloat = 15.0  # container start until its executor answers
    exec_grace_s: PositiveFloat = 5.0  # past timeout_s before an exec counts as hung
    park_idle: bool = True  # throttle an env's CPU quota to 1% of a core between actions
    exclusive_cores: bool = True  # refuse an action whose cores another action holds
    pool_retry_s: PositiveFloat = 2.0  # back-off after a failed warm-pool creation

    def images_to_pool(self) -> tuple[str, ...]:
        """The images that get a warm pool."""
        return self.pool_images or (self.default_image,)
