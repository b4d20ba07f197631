"""gpu_manager benchmarks (issue 11, item 7) -> bench/results/gpu.json.

- restore bandwidth of a ~400 MB model (built in code, random init) from its invariant host
  copy into a preallocated arena, against this machine's copy limit measured in the same run
  (a plain preallocated tensor copy of the same size; on CUDA, pinned host -> device);
- per-call overhead of the handle path (batch former + ``run_batch`` + the handle's own
  payload conversion) on a resident tiny model over the model's bare forward time (p50);
- calls/s of a tiny model with dynamic batching on and off.

Runs on torch's CPU device here (no GPU), with few torch threads: the machine is shared.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from services.gpu_manager.batching import BatchFormer, Call, run_batch
from services.gpu_manager.host_copy import HostCopy
from tests import gpu_models

OUT = Path(__file__).parent / "results" / "gpu.json"
THREADS = 1
REPS = 7


def _seconds(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def _timed_restore(copy: HostCopy, device: torch.device, arena: torch.Tensor | None) -> float:
    """One restore (then an eviction, as the manager does before the next restore)."""
    t0 = time.perf_counter()
    resident = copy.restore(device, arena)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    copy.evict(resident)
    return elapsed


def restore_bandwidth() -> dict[str, Any]:
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    model = gpu_models.transformer()
    copy = HostCopy(model)
    n = copy.nbytes
    arena = torch.zeros(n, dtype=torch.uint8, device=device)  # preallocated and touched
    plain = torch.zeros(n, dtype=torch.uint8, device=device)
    src = torch.empty(n, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
    src.copy_(copy.host)
    restores, limits = [], []
    for _ in range(REPS):  # interleaved, so both see the same machine load
        limits.append(_seconds(lambda: plain.copy_(src)))
        restores.append(_timed_restore(copy, device, arena))
    fresh = min(_timed_restore(copy, device, None) for _ in range(3))
    gbps = n / min(restores) / 1e9
    limit = n / min(limits) / 1e9
    return {
        "model_mb": round(n / 2**20, 1),
        "device": str(device),
        "gb_per_s": round(gbps, 2),
        "limit_gb_per_s": round(limit, 2),
        "fraction_of_limit": round(gbps / limit, 3),
        "restore_ms": round(min(restores) * 1e3, 1),
        "restore_fresh_arena_gb_per_s": round(n / fresh / 1e9, 2),
        "note": "best of interleaved runs; restore = slab copy + rebinding a recycled model to the arena",
    }


def _p50_us(fn: Callable[[], object], reps: int = 2000) -> float:
    for _ in range(50):
        fn()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        fn()
        samples.append((time.perf_counter_ns() - t0) / 1e3)
    return statistics.median(samples)


def call_overhead() -> dict[str, float]:
    resident = HostCopy(gpu_models.tiny_service()[0]).restore("cpu")
    payload = [0.1, 0.2, 0.3, 0.4]
    x = torch.tensor([payload])
    former = BatchFormer()

    def forward() -> None:
        with torch.inference_mode():
            resident.model(x)

    def handle_path() -> None:
        former.submit(Call("c", "tiny", payload, 0.0))
        batch = former.take("tiny", 1)
        assert batch is not None
        run_batch(resident.model, gpu_models.mlp_handle, batch)

    fwd, path = _p50_us(forward), _p50_us(handle_path)
    return {
        "forward_p50_us": round(fwd, 1),
        "handle_path_p50_us": round(path, 1),
        "overhead_p50_us": round(path - fwd, 1),
        "overhead_over_forward": round((path - fwd) / fwd, 2),
    }


def calls_per_s(max_batch: int, n: int = 4000) -> float:
    resident = HostCopy(gpu_models.tiny_service()[0]).restore("cpu")
    former = BatchFormer(capacity=n)
    for i in range(n):
        former.submit(Call(str(i), "tiny", [0.1 * (i % 7)] * 4, float(i)))
    t0 = time.perf_counter()
    done = 0
    while (batch := former.take("tiny", max_batch)) is not None:
        done += len(run_batch(resident.model, gpu_models.mlp_handle, batch))
    return done / (time.perf_counter() - t0)


def main() -> None:
    torch.set_num_threads(THREADS)
    torch.manual_seed(0)
    result = {
        "restore": restore_bandwidth(),
        "call_overhead": call_overhead(),
        "batching": {
            "calls_per_s_max_batch_1": round(calls_per_s(1)),
            "calls_per_s_max_batch_64": round(calls_per_s(64)),
        },
        "machine": {
            "torch": torch.__version__,
            "cuda": torch.cuda.is_available(),
            "torch_threads": THREADS,
            "cpu": platform.processor() or platform.machine(),
            "note": "2 cores shared with other jobs; torch threads kept at 1",
        },
    }
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
