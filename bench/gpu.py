"""gpu_manager benchmarks (issue 11, item 7) -> bench/results/gpu.json.

- restore bandwidth of a ~400 MB model (built in code, random init) from its invariant host
  copy, as the gpu_manager restores after an eviction (into the arena the evicted copy freed,
  ``arenas.py``; a fresh model rebuilt on it), against this machine's copy limit measured in
  the same run (a plain preallocated tensor copy of the same size; on CUDA, pinned host ->
  device); beside it, a restore into a new allocation (the first of its size on a CPU
  device, whose pages fault in as they are copied);
- per-call overhead of the handle path (batch former + ``run_batch`` + the handle's own
  payload conversion) on a resident tiny model over the model's bare forward time (p50);
- calls/s of a tiny model with dynamic batching on and off.

Through the mesh (a real one: NATS, Postgres, gateway, scheduler, gpu_manager on one CPU
"device"), with the tiny model registered as a service:

- per-call system overhead, calls sequential and the service resident: the completion the
  client measures (submit -> result) minus the call's execution as the agent times it (in its
  worker thread, around the batch's forward pass: the hops to and from the worker count as
  overhead), p50/p99; the same again on a mesh whose Postgres does not fsync
  (``sequential_resident_fsync_off``) and the difference (``fsync_cost_ms_p50``): the WAL
  flush of the call's intake, which no call skips (it may start only once it is durable);
- calls/s with 64 concurrent callers, ``max_batch=1`` (batching off) vs ``max_batch=32``, and
  the calls per forward pass the agent reports (``ServiceState.calls / batches``).

Runs on torch's CPU device here (no GPU), with few torch threads: the machine is shared.
"""

from __future__ import annotations

import asyncio
import json
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import uvloop

from services.gpu_manager import examples
from services.gpu_manager.arenas import Arenas
from services.gpu_manager.batching import BatchFormer, Call, run_batch
from services.gpu_manager.host_copy import HostCopy
from tangram import ServiceSpec, ServiceState
from tangram.client import Client
from tangram.launcher import Mesh, MeshOptions

OUT = Path(__file__).parent / "results" / "gpu.json"
THREADS = 1
REPS = 7
MESH_FACTORY = "services.gpu_manager.examples:tiny_service"
MESH_SEQUENTIAL = 300
MESH_CALLERS = 64
MESH_PER_CALLER = 20
WARM = 20


def _seconds(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def _timed_restore(copy: HostCopy, device: torch.device, arenas: Arenas) -> float:
    """One restore as the gpu_manager makes it (``GpuExecutor._restore``): into memory an
    evicted copy freed when there is some of its size (``arenas.py``), a fresh model rebuilt
    on it; then the copy is evicted, its arena kept for the next restore."""
    arena = arenas.take(device, copy.nbytes)
    t0 = time.perf_counter()
    resident = copy.restore(device, arena, paths=[str(device)])
    del arena  # the pool's handle on the memory: the resident's slab is the one left
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    arenas.give(copy.release(resident))
    return elapsed


def restore_bandwidth() -> dict[str, Any]:
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    model = examples.transformer()
    copy = HostCopy(model)
    n = copy.nbytes
    arenas = Arenas(limit=n)  # the agent's pool, room for this one copy
    plain = torch.zeros(n, dtype=torch.uint8, device=device)
    src = torch.empty(n, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
    src.copy_(copy.host)
    first = _timed_restore(copy, device, arenas)  # nothing freed yet: a fresh allocation
    restores, limits = [], []
    for _ in range(REPS):  # interleaved, so both see the same machine load
        limits.append(_seconds(lambda: plain.copy_(src)))
        restores.append(_timed_restore(copy, device, arenas))
    fresh = min(_timed_restore(copy, device, Arenas(limit=0)) for _ in range(3))
    gbps = n / min(restores) / 1e9
    limit = n / min(limits) / 1e9
    return {
        "model_mb": round(n / 2**20, 1),
        "device": str(device),
        "gb_per_s": round(gbps, 2),
        "limit_gb_per_s": round(limit, 2),
        "fraction_of_limit": round(gbps / limit, 3),
        "restore_ms": round(min(restores) * 1e3, 1),
        "restore_p50_ms": round(statistics.median(restores) * 1e3, 1),
        "reused_arenas": arenas.reused,
        "first_restore_gb_per_s": round(n / first / 1e9, 2),
        "restore_fresh_arena_gb_per_s": round(n / fresh / 1e9, 2),
        "note": "best of interleaved runs of the gpu_manager's restore after an eviction (into "
        "the arena the evicted copy freed, a fresh model rebuilt on it); first / fresh_arena: "
        "into a new allocation, as the first restore of a size on a CPU device",
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
    resident = HostCopy(examples.tiny_service()[0]).restore("cpu")
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
        run_batch(resident.model, examples.mlp_handle, batch)

    fwd, path = _p50_us(forward), _p50_us(handle_path)
    return {
        "forward_p50_us": round(fwd, 1),
        "handle_path_p50_us": round(path, 1),
        "overhead_p50_us": round(path - fwd, 1),
        "overhead_over_forward": round((path - fwd) / fwd, 2),
    }


def calls_per_s(max_batch: int, n: int = 4000) -> float:
    resident = HostCopy(examples.tiny_service()[0]).restore("cpu")
    former = BatchFormer(capacity=n)
    for i in range(n):
        former.submit(Call(str(i), "tiny", [0.1 * (i % 7)] * 4, float(i)))
    t0 = time.perf_counter()
    done = 0
    while (batch := former.take("tiny", max_batch)) is not None:
        done += len(run_batch(resident.model, examples.mlp_handle, batch))
    return done / (time.perf_counter() - t0)


def _pct(xs: list[float], p: int) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[p - 1]


async def _infer(client: Client, service: str, i: int) -> tuple[float, float]:
    """One call: (client-measured completion, the agent's exec timing), in seconds."""
    t0 = time.perf_counter()
    res = await client.infer(service, [0.1 * (i % 7)] * 4, job_id="bench-gpu", timeout_s=120)
    total = time.perf_counter() - t0
    if res.status != "succeeded" or res.timings is None:
        raise RuntimeError(f"call {i} to {service} failed: {res.error}")
    return total, res.timings.exec_s


async def _state(client: Client, name: str) -> ServiceState:
    (state,) = [s for s in await client.list_services() if s.spec.name == name]
    return state


async def _register(client: Client, name: str, max_batch: int) -> None:
    spec = ServiceSpec(name, MESH_FACTORY, max_batch=max_batch)
    state = await client.register_service(spec)
    if state.error:
        raise RuntimeError(f"registering {name}: {state.error}")
    for i in range(WARM):  # restore it and warm the path
        await _infer(client, name, i)
    await _counted(client, name, WARM)  # its counters from here on are the run's


async def mesh_overhead(client: Client, n: int = MESH_SEQUENTIAL) -> dict[str, Any]:
    await _register(client, "tiny-seq", 1)
    samples = [await _infer(client, "tiny-seq", i) for i in range(n)]
    totals = [t for t, _ in samples]
    overheads = [max(0.0, t - e) for t, e in samples]
    return {
        "calls": n,
        "completion_ms": {"p50": _ms(_pct(totals, 50)), "p99": _ms(_pct(totals, 99))},
        "agent_exec_ms_p50": _ms(_pct([e for _, e in samples], 50)),
        "overhead_ms": {"p50": _ms(_pct(overheads, 50)), "p99": _ms(_pct(overheads, 99))},
    }


async def mesh_calls_per_s(client: Client, max_batch: int) -> dict[str, Any]:
    name = f"tiny-b{max_batch}"
    await _register(client, name, max_batch)
    before = await _state(client, name)

    async def caller(c: int) -> list[tuple[float, float]]:
        return [await _infer(client, name, c * MESH_PER_CALLER + i) for i in range(MESH_PER_CALLER)]

    t0 = time.perf_counter()
    done = await asyncio.gather(*(caller(c) for c in range(MESH_CALLERS)))
    wall = time.perf_counter() - t0
    calls = MESH_CALLERS * MESH_PER_CALLER
    after = await _counted(client, name, before.calls + calls)
    totals = [t for run in done for t, _ in run]
    batches = after.batches - before.batches
    return {
        "max_batch": max_batch,
        "calls": calls,
        "calls_per_s": round(calls / wall, 1),
        "completion_ms_p50": _ms(_pct(totals, 50)),
        "forward_passes": batches,
        "calls_per_forward_pass": round(calls / max(1, batches), 2),
    }


async def _counted(client: Client, name: str, calls: int) -> ServiceState:
    """The service's counters once the agent's heartbeats have reported ``calls``."""
    for _ in range(100):
        state = await _state(client, name)
        if state.calls >= calls:
            return state
        await asyncio.sleep(0.2)
    raise RuntimeError(f"{name}: the agent reported {state.calls} calls, not {calls}")


def _ms(s: float) -> float:
    return round(1000 * s, 3)


def _env() -> dict[str, str]:
    return {
        "TANGRAM_GPU_BACKEND": "cpu",
        "TANGRAM_GPU_CPU_DEVICES": "1",
        "TANGRAM_GPU_CPU_BUDGET_MB": "64",
        "TANGRAM_GPU_TORCH_THREADS": str(THREADS),
        "TANGRAM_GPU_HEARTBEAT_S": "0.5",
        "TANGRAM_GATEWAY_MAX_IN_FLIGHT": "100000",
    }


def _options(tmp: str, fsync: bool = True) -> MeshOptions:
    return MeshOptions(
        state_dir=Path(tmp),
        backend="process",
        env=_env(),
        quota_manager=False,
        quiet=True,
        fsync=fsync,
    )


async def without_fsync() -> dict[str, Any]:
    """The sequential figure again on a mesh whose Postgres does not fsync: what of the
    overhead is the intake's WAL flush (an action is acknowledged, and may start, only once
    its intake is durable, so every call waits for one)."""
    with tempfile.TemporaryDirectory(prefix="tangram-bench-gpu-") as tmp:
        async with Mesh(_options(tmp, fsync=False)) as mesh:
            async with Client.connect(mesh.nats_url) as client:
                return await mesh_overhead(client)


async def through_the_mesh() -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="tangram-bench-gpu-") as tmp:
        async with Mesh(_options(tmp)) as mesh, Client.connect(mesh.nats_url) as client:
            overhead = await mesh_overhead(client)
            off = await mesh_calls_per_s(client, 1)
            on = await mesh_calls_per_s(client, 32)
    unsynced = await without_fsync()
    return {
        "what": "a tiny model (examples.tiny_service) as a registered service, through client "
        "-> gateway -> scheduler -> gpu_manager (1 CPU device, 1 torch thread) -> client; "
        "Postgres fsync on",
        "sequential_resident": overhead,
        "sequential_resident_fsync_off": unsynced,
        "fsync_cost_ms_p50": round(
            overhead["overhead_ms"]["p50"] - unsynced["overhead_ms"]["p50"], 3
        ),
        "concurrent": {
            "callers": MESH_CALLERS,
            "max_batch_1": off,
            "max_batch_32": on,
            "speedup": round(on["calls_per_s"] / off["calls_per_s"], 2),
        },
    }


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
        "mesh": uvloop.run(through_the_mesh()),
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
