"""Device inventory: NVML GPUs when present, else configured CPU stand-ins.

On a machine without a GPU the gpu_manager runs the same code on torch's CPU device: ``count``
CPU "devices", each with its own memory budget, so restore, eviction and batching are exercised
end to end. Devices are grouped into buddy chunks (§5.3, Algorithm 4) by ``tangram.chunks``,
the rule the scheduler grants by.

Each device names the host link it restores through (``link``; a restore onto a chunk copies
one slice per device, ``slices.py``), so the scheduler can price a sliced restore truthfully:
the CPU stand-ins all share one (one memory system: slices copied in parallel there gain
nothing a link would give); NVML GPUs have one each, except GPUs behind one PCIe switch, which
share its uplink (NVML's topology: a common ancestor at ``NVML_TOPOLOGY_MULTIPLE`` or closer).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec

from tangram import contract
from tangram.chunks import Chunk, root_chunks
from tangram.errors import Unavailable

log = logging.getLogger(__name__)

MB = 1 << 20


class DevicesConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Which devices to use; the CPU fallback's shape; memory kept back from each GPU."""

    backend: Literal["auto", "nvml", "cpu"] = "auto"
    cpu_devices: Annotated[int, msgspec.Meta(ge=1, le=64)] = 2
    cpu_budget_mb: Annotated[int, msgspec.Meta(ge=1)] = 1024
    gpu_reserve_mb: Annotated[int, msgspec.Meta(ge=0)] = 1024  # CUDA context, allocator slack


@dataclass(frozen=True, slots=True)
class Device:
    """One device: its index in the node, the torch device that runs it, its byte budget."""

    index: int
    name: str
    torch_device: str
    budget_bytes: int
    link: int = 0  # the host link it restores through (module docstring)


@dataclass(frozen=True, slots=True)
class Inventory:
    """The devices of this node and the kind that backs them (``"cuda"`` or ``"cpu"``)."""

    kind: str
    devices: tuple[Device, ...]

    @property
    def roots(self) -> tuple[Chunk, ...]:
        return root_chunks(len(self.devices))

    def describe(self) -> str:
        """One line for the operator: what runs here."""
        mb = {d.budget_bytes // MB for d in self.devices}
        return f"{len(self.devices)} {self.kind} device(s), budget {'/'.join(map(str, mb))} MB"

    @property
    def links(self) -> int:
        """How many independent host links the devices restore through."""
        return len({d.link for d in self.devices})

    def offer(self, restore_gb_per_s: float, gather_gb_per_s: float = 0.0) -> contract.Inventory:
        """What the GPU node offers the scheduler: devices, links, bandwidth per link."""
        gpus = tuple(
            contract.GpuDevice(
                index=d.index, memory_mb=d.budget_bytes // MB, name=d.name, link=d.link
            )
            for d in self.devices
        )
        return contract.Inventory(
            kind="gpu",
            gpus=gpus,
            memory_mb=sum(g.memory_mb for g in gpus),
            backend=self.kind,
            restore_gb_per_s=restore_gb_per_s,
            gather_gb_per_s=gather_gb_per_s,
        )


def cpu_inventory(cfg: DevicesConfig) -> Inventory:
    """``cfg.cpu_devices`` CPU stand-ins of ``cfg.cpu_budget_mb`` each, all on one link (the
    host's memory system)."""
    budget = cfg.cpu_budget_mb * MB
    devices = tuple(Device(i, f"cpu{i}", "cpu", budget, 0) for i in range(cfg.cpu_devices))
    return Inventory("cpu", devices)


def discover(cfg: DevicesConfig) -> Inventory:
    """NVML GPUs usable by torch, else (``auto``) the CPU stand-ins. Blocking: run in a thread."""
    if cfg.backend == "cpu":
        return cpu_inventory(cfg)
    gpus = _nvml_devices(cfg)
    if gpus:
        return Inventory("cuda", gpus)
    if cfg.backend == "nvml":
        raise Unavailable("no GPU answered NVML, or torch cannot use CUDA")
    return cpu_inventory(cfg)


def _nvml_devices(cfg: DevicesConfig) -> tuple[Device, ...]:
    try:
        import pynvml  # type: ignore[import-not-found,unused-ignore]
        import torch
    except ImportError:
        return ()
    if not torch.cuda.is_available():  # pragma: no cover - needs a GPU
        return ()
    return _query(pynvml, cfg)  # pragma: no cover - needs a GPU


def _query(nvml: Any, cfg: DevicesConfig) -> tuple[Device, ...]:  # pragma: no cover - GPU
    try:
        nvml.nvmlInit()
        try:
            handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
            links = shared_links(len(handles), lambda i, j: _ancestor(nvml, handles, i, j))
            return tuple(_nvml_device(nvml, i, cfg, links[i]) for i in range(len(handles)))
        finally:
            nvml.nvmlShutdown()
    except nvml.NVMLError as exc:
        log.warning("NVML unusable, falling back: %s", exc)
        return ()


def _ancestor(nvml: Any, handles: list[Any], i: int, j: int) -> int:  # pragma: no cover - GPU
    try:
        return int(nvml.nvmlDeviceGetTopologyCommonAncestor(handles[i], handles[j]))
    except nvml.NVMLError:  # topology unknown: a link of its own, the common case
        return NVML_TOPOLOGY_HOSTBRIDGE


def _nvml_device(
    nvml: Any, i: int, cfg: DevicesConfig, link: int
) -> Device:  # pragma: no cover - GPU
    handle = nvml.nvmlDeviceGetHandleByIndex(i)
    name = nvml.nvmlDeviceGetName(handle)
    total = int(nvml.nvmlDeviceGetMemoryInfo(handle).total)
    name = name.decode() if isinstance(name, bytes) else str(name)
    return Device(i, name, f"cuda:{i}", max(0, total - cfg.gpu_reserve_mb * MB), link)


# NVML's GPU topology levels (nvmlGpuTopologyLevel_t): a common ancestor at MULTIPLE or closer is
# a PCIe switch (or the same board); HOSTBRIDGE and beyond is the CPU's root complex.
NVML_TOPOLOGY_MULTIPLE = 20
NVML_TOPOLOGY_HOSTBRIDGE = 30


def shared_links(n: int, ancestor: Callable[[int, int], int]) -> tuple[int, ...]:
    """Per device, its host link: the lowest-numbered device it shares a PCIe switch with
    (``ancestor(i, j)`` at ``NVML_TOPOLOGY_MULTIPLE`` or closer), itself when none."""
    links: list[int] = []
    for i in range(n):
        same = next((j for j in range(i) if ancestor(i, j) <= NVML_TOPOLOGY_MULTIPLE), None)
        links.append(i if same is None else links[same])
    return tuple(links)
