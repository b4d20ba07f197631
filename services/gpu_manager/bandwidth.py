"""What a node's host links give: the restore bandwidth per link and the gather after a
sliced restore, each measured once at start with plain preallocated copies (best of three).

The per-link figure is what the scheduler prices a restore by (``gpu.restore_cost``): links are
measured one at a time, so a host whose memory cannot feed all of them at once would restore a
chunk slower than priced (the CPU stand-ins have one link, so there it is exact).
"""

from __future__ import annotations

import time

import torch

from services.gpu_manager import devices

BANDWIDTH_BYTES = 64 << 20  # a plain copy this large measures the node's restore bandwidth


def sync(device: torch.device) -> None:
    if device.type == "cuda":  # pragma: no cover - needs a GPU
        torch.cuda.synchronize(device)


def measure_bandwidth(inv: devices.Inventory) -> float:
    """Host -> device copy bandwidth (decimal GB/s: 1e9 bytes) per link: a plain preallocated
    copy into the first device of each link, best of three; the slowest link's (the CPU
    stand-ins: one link)."""
    firsts = {d.link: d for d in reversed(inv.devices)}
    return min((_copy_rate(torch.device(d.torch_device)) for d in firsts.values()), default=0.0)


def _copy_rate(device: torch.device, src: torch.Tensor | None = None) -> float:
    cuda = device.type == "cuda"
    if src is None:
        src = torch.ones(BANDWIDTH_BYTES, dtype=torch.uint8, pin_memory=cuda)
    dst = torch.zeros(BANDWIDTH_BYTES, dtype=torch.uint8, device=device)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=cuda)
        sync(device)
        sync(src.device)
        best = min(best, time.perf_counter() - t0)
    return round(BANDWIDTH_BYTES / best / 1e9, 2)


def measure_gather(inv: devices.Inventory) -> float:
    """Device -> device bandwidth (decimal GB/s) of the gather after a sliced restore (CUDA: the
    second device into the first); 0 where the slices land in the arena directly (CPU)."""
    if inv.kind != "cuda" or len(inv.devices) < 2:
        return 0.0
    return _peer_rate(inv)  # pragma: no cover - needs two GPUs


def _peer_rate(inv: devices.Inventory) -> float:  # pragma: no cover - needs two GPUs
    first, second = (torch.device(d.torch_device) for d in inv.devices[:2])
    return _copy_rate(first, torch.ones(BANDWIDTH_BYTES, dtype=torch.uint8, device=second))
