"""Typed configuration of the Docker backend: one Struct, nested in the node agent's config.

An operator sets each field as ``TANGRAM_CPU_<FIELD>`` (``services.cpu_manager.config``);
``root``, ``node_id`` and ``incarnation`` are the node's, filled in by the agent.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from services.cpu_manager.docker.tiers import TierPolicy

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]
NonNegFloat = Annotated[float, msgspec.Meta(ge=0)]
# A Docker network to join (a name, "bridge", "host"), and an extra bind for sandboxes, an
# absolute HOST:CONTAINER[:ro|rw]: checked here, not by the engine later.
NetworkMode = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")]
Mount = Annotated[str, msgspec.Meta(pattern=r"^/[^:,\s]+:/[^:,\s]+(:(ro|rw))?$")]
NODE_FIELDS = frozenset({"root", "node_id", "incarnation"})  # the agent's, not settings


class DockerConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """How the Docker backend makes, pins, locks down and pools per-trajectory containers."""

    # --- the node's (NODE_FIELDS): set by the agent, never from the environment
    root: str = ""  # host dir for each env's work/ and ctl/ dirs; dockerd must see the same path
    node_id: str = "node"
    incarnation: str = ""
    # --- settings
    docker_host: str = ""  # "" = $DOCKER_HOST or the default socket
    image: str = "tangram-sandbox:latest"  # default sandbox image (`tangram sandbox-image`)
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
    pool_memory_mb: PositiveInt = 512  # warm-pool containers (an env gets its first action's)
    pids_limit: PositiveInt = 512  # processes per sandbox
    tmpfs_mb: PositiveInt = 64  # /tmp, counted against the container's memory
    network_mode: NetworkMode = "bridge"  # used only for environments that ask for a network
    mounts: tuple[Mount, ...] = ()  # extra binds (read-only unless ":rw")
    max_envs: PositiveInt = 64  # trajectory environments per node (the pool is extra)
    warm_pool: NonNegInt = 2  # pre-created containers per pooled image
    pool_images: tuple[str, ...] = ()  # images with a warm pool; () = (image,)
    api_timeout_s: PositiveFloat = 30.0
    threads: PositiveInt = 16  # Docker SDK calls run on this many threads, never on the loop
    ready_timeout_s: PositiveFloat = 15.0  # container start until its executor answers
    exec_grace_s: PositiveFloat = 5.0  # past timeout_s before an exec counts as hung
    park_idle: bool = True  # throttle an env's CPU quota to 1% of a core between actions
    pool_retry_s: PositiveFloat = 2.0  # back-off after a failed warm-pool creation
    # --- environment tiering (docker/tiers.py): idle environments are paused, then saved to
    # disk and their containers removed; their next action restores them. 0 turns a rule off.
    tier_pause_after_s: NonNegFloat = 30.0  # idle this long: `docker pause` (memory kept)
    tier_disk_after_s: NonNegFloat = 600.0  # idle this long: to disk (memory released)
    tier_budget_mb: NonNegInt = 0  # running + paused envs' memory above this: oldest idle to disk
    tier_min_idle_s: NonNegFloat = 5.0  # under memory pressure, idle at least this long
    tier_tick_s: PositiveFloat = 1.0  # how often the thresholds are checked

    def tier_policy(self) -> TierPolicy:
        """The tiering thresholds, for the pure policy."""
        return TierPolicy(
            pause_after_s=self.tier_pause_after_s,
            disk_after_s=self.tier_disk_after_s,
            budget_mb=self.tier_budget_mb,
            pressure_min_idle_s=self.tier_min_idle_s,
        )

    def images_to_pool(self) -> tuple[str, ...]:
        """The images that get a warm pool."""
        return self.pool_images or (self.image,)
