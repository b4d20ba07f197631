"""GPU node agent configuration (environment variables ``TANGRAM_GPU_*``).

``TANGRAM_GPU_BACKEND`` picks the devices: ``auto`` (NVML GPUs usable by torch, else CPU
stand-ins), ``nvml`` (GPUs or fail) or ``cpu``; ``TANGRAM_GPU_CPU_DEVICES`` and
``TANGRAM_GPU_CPU_BUDGET_MB`` shape the CPU stand-ins. A bad value fails at load, naming it.

``TANGRAM_GPU_HOST_BUDGET_MB``, ``TANGRAM_GPU_STATE_DIR`` and ``TANGRAM_GPU_DISK_BUDGET_MB``
shape the state tiers (``state/``); ``TANGRAM_GPU_PREFETCH=false`` ignores the scheduler's hints.

``TANGRAM_GPU_PREPARE_TIMEOUT_S`` bounds one service's import and build. The timeouts of a
registration nest, each shorter than the one waiting on it, so the caller hears the innermost
(the typed error naming the stuck factory) rather than a bare timeout: this one (90 s) <
the scheduler's ``TANGRAM_SCHEDULER_PREPARE_TIMEOUT_S`` (120 s, its wait for every GPU node) <
the gateway's ``TANGRAM_GATEWAY_REGISTER_TIMEOUT_S`` (150 s, its wait for the scheduler).
"""

from __future__ import annotations

import socket
from collections.abc import Mapping
from typing import Annotated, Any, Literal

import msgspec

from services.gpu_manager.devices import DevicesConfig
from services.gpu_manager.state.manager import StateConfig
from tangram import config
from tangram.config import MeshConfig

PREFIX = "TANGRAM_GPU_"


def _default_node_id() -> str:
    return "gpu-" + socket.gethostname().split(".")[0]


class GpuManagerConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    node_id: str = msgspec.field(default_factory=_default_node_id)
    heartbeat_s: float = 1.0
    backend: Literal["auto", "nvml", "cpu"] = "auto"
    cpu_devices: Annotated[int, msgspec.Meta(ge=1, le=64)] = 2
    cpu_budget_mb: Annotated[int, msgspec.Meta(ge=1)] = 2048
    gpu_reserve_mb: Annotated[int, msgspec.Meta(ge=0)] = 1024  # CUDA context, allocator slack
    max_queued: Annotated[int, msgspec.Meta(ge=1)] = 10_000  # calls waiting for a device
    torch_threads: Annotated[int, msgspec.Meta(ge=0)] = 0  # per process; 0 = torch's default
    # one service's import and build (see the module docstring for how the timeouts nest)
    prepare_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 90.0
    # model state tiers below the devices (state/): host memory (0 MB: unbounded) and a disk
    # directory (empty: no disk tier); scheduler hints promote queued services ahead of calls
    host_budget_mb: Annotated[int, msgspec.Meta(ge=0)] = 0
    state_dir: str = ""
    disk_budget_mb: Annotated[int, msgspec.Meta(ge=0)] = 0
    state_verify: bool = False  # hash every stored file at start (lengths are always checked)
    prefetch: bool = True

    def state(self) -> StateConfig:
        return StateConfig(
            host_budget_mb=self.host_budget_mb,
            disk_dir=self.state_dir,
            disk_budget_mb=self.disk_budget_mb,
            verify_on_start=self.state_verify,
        )

    def devices(self) -> DevicesConfig:
        return DevicesConfig(
            backend=self.backend,
            cpu_devices=self.cpu_devices,
            cpu_budget_mb=self.cpu_budget_mb,
            gpu_reserve_mb=self.gpu_reserve_mb,
        )


def load(overrides: Mapping[str, Any] | None = None) -> tuple[MeshConfig, GpuManagerConfig]:
    """The mesh config and the GPU agent's (``overrides`` over ``TANGRAM_GPU_*`` over the
    defaults); bad values raise InvalidRequest naming the field."""
    return config.service(GpuManagerConfig, PREFIX, overrides)
