"""Model state tiers (issue 15, model half) -> ``model_restore``, ``dedupe`` and ``prefetch`` in
bench/results/state.json (merged: the environment half's keys are kept).

- restore of a ~400 MB model disk -> host -> device (CPU "device" here): the StateManager's
  promotion (safetensors files read cold: the page cache is dropped for them first) and the
  arena copy, against this machine's limits measured in the same run, interleaved: a cold
  sequential read of one file of the same size, and a plain preallocated tensor copy; the
  restored model's outputs are checked bit-exact against the model called directly;
- bytes saved by dedupe on services sharing a base: base + 3 fine-tunes that change only the
  head + 2 DoP variants registered as services of their own (same weights);
- prefetch: a GpuExecutor (2 CPU devices holding one service each, a host tier holding two of
  four services, the rest on disk) serving a seeded random trace of calls one after another,
  with and without the scheduler's hint naming the next calls' services: how often a call finds
  its service on its device / in host memory, and the mean call latency.

Models have random, distinct layers (``nn.TransformerEncoder`` clones one layer, which would
make dedupe look better than it is). torch threads kept at 1: the machine is shared.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import random
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import torch
from torch import nn

from services.gateway.formulation import formulate_infer
from services.gpu_manager.config import GpuManagerConfig
from services.gpu_manager.executor import GpuExecutor
from services.gpu_manager.state.manager import MB, StateConfig, StateManager
from tangram.contract import ActionSpec, Dispatch, InferAction, ServiceSpec

OUT = Path(__file__).parent / "results" / "state.json"
THREADS = 1
REPS = 3
RESTORE_LAYERS = 24  # of 2048 x 2048 float32: ~403 MB
DEDUPE_LAYERS = 8
PREFETCH_CALLS = 60
PREFETCH_SERVICES = 4
CALL_S = 0.05  # each call's handler time: the window a hint has to promote the next service


def layered(layers: int, seed: int, dim: int = 2048) -> nn.Module:
    """Linear layers with distinct random weights, then a small head."""
    torch.manual_seed(seed)
    body = [nn.Linear(dim, dim) for _ in range(layers)]
    return nn.Sequential(*body, nn.Linear(dim, 16)).eval()


def _forward(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(x)


def _drop_cache(root: Path) -> None:
    """Evict the store's files from the page cache: the next read comes from the disk."""
    for p in root.iterdir():
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _cold_read_s(path: Path, buf: torch.Tensor) -> float:
    """One sequential read of ``path`` into ``buf``, the page cache dropped first."""
    _drop_cache_file(path)
    view = memoryview(buf.numpy())
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        got = 0
        while n := f.readinto(view[got:]):
            got += n
    return time.perf_counter() - t0


def _drop_cache_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _seconds(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# ---------------------------------------------------------------------- restore


def model_restore(root: Path) -> dict[str, Any]:
    x = torch.randn(4, 2048)
    models = {f"m{i}": layered(RESTORE_LAYERS, seed=i) for i in range(2)}
    refs = {n: _forward(m, x) for n, m in models.items()}
    nbytes = sum(p.numel() * p.element_size() for p in models["m0"].parameters())
    # the host tier holds one of the two: capturing m1 sends m0 to disk, each restore the other
    mgr = StateManager(StateConfig(host_budget_mb=nbytes * 3 // 2 // MB, disk_dir=str(root)))
    mgr.start()
    t0 = time.perf_counter()
    copies = {n: mgr.capture(n, m) for n, m in models.items()}
    capture_s = time.perf_counter() - t0
    del models
    limit_file = root.parent / "limit.bin"
    limit_file.write_bytes(os.urandom(1 << 20) * (nbytes // (1 << 20)))
    buf = torch.empty(limit_file.stat().st_size, dtype=torch.uint8)
    src, dst = torch.randn(nbytes // 4), torch.zeros(nbytes // 4)
    arena = torch.zeros(copies["m0"].nbytes, dtype=torch.uint8)
    promote, copy, reads, memcpy = [], [], [], []
    exact = True
    for rep in range(2 * REPS):  # interleaved, so the limits see the same machine load
        name = f"m{rep % 2}"
        if mgr.in_host(name):
            continue
        _drop_cache(root)
        reads.append(_cold_read_s(limit_file, buf))
        memcpy.append(_seconds(lambda: dst.copy_(src)))
        t0 = time.perf_counter()
        held = mgr.acquire(name)
        t1 = time.perf_counter()
        resident = copies[name].restore("cpu", arena)
        t2 = time.perf_counter()
        mgr.release(held)
        exact &= torch.equal(_forward(resident.model, x), refs[name])
        copies[name].evict(resident)
        promote.append(t1 - t0)
        copy.append(t2 - t1)
    limit_file.unlink()
    gb = nbytes / 1e9
    best = {
        "disk_to_host_s": min(promote),
        "host_to_device_s": min(copy),
        "read_limit_s": min(reads),
        "copy_limit_s": min(memcpy),
    }
    return {
        "model_mb": round(nbytes / MB, 1),
        "tensors": len(copies["m0"].keys),
        "device": "cpu",
        "disk_to_host_s": round(best["disk_to_host_s"], 3),
        "host_to_device_s": round(best["host_to_device_s"], 3),
        "disk_to_device_s": round(best["disk_to_host_s"] + best["host_to_device_s"], 3),
        "disk_to_host_gb_per_s": round(gb / best["disk_to_host_s"], 2),
        "host_to_device_gb_per_s": round(gb / best["host_to_device_s"], 2),
        "disk_read_limit_gb_per_s": round(gb / best["read_limit_s"], 2),
        "copy_limit_gb_per_s": round(gb / best["copy_limit_s"], 2),
        "disk_fraction_of_limit": round(best["read_limit_s"] / best["disk_to_host_s"], 3),
        "copy_fraction_of_limit": round(best["copy_limit_s"] / best["host_to_device_s"], 3),
        "capture_two_models_s": round(capture_s, 2),
        "runs": len(promote),
        "median_disk_to_device_s": round(
            statistics.median(p + c for p, c in zip(promote, copy, strict=True)), 3
        ),
        "bit_exact": exact,
        "note": "best of interleaved runs; disk reads cold (page cache dropped by fadvise); "
        "capture = hash + fsynced safetensors writes of both models",
    }


# ---------------------------------------------------------------------- dedupe


def _fine_tune(seed: int, head_seed: int) -> nn.Module:
    model = layered(DEDUPE_LAYERS, seed)
    torch.manual_seed(head_seed)
    head = model[-1]
    assert isinstance(head, nn.Linear)
    with torch.no_grad():
        head.weight.add_(torch.randn_like(head.weight) * 0.01)
    return model


def dedupe(root: Path) -> dict[str, Any]:
    mgr = StateManager(StateConfig(disk_dir=str(root)))
    mgr.start()
    services: dict[str, nn.Module] = {"base": layered(DEDUPE_LAYERS, 0)}
    services |= {f"ft{i}": _fine_tune(0, i) for i in (1, 2, 3)}
    services |= {f"base-dop{d}": layered(DEDUPE_LAYERS, 0) for d in (2, 4)}
    for name, model in services.items():
        mgr.capture(name, model)
    r = mgr.report()
    disk = sum(p.stat().st_size for p in root.iterdir())
    return {
        "services": sorted(services),
        "logical_bytes": r.logical_bytes,
        "stored_bytes": r.stored_bytes,
        "disk_bytes": disk,
        "bytes_saved_fraction": round(1 - r.stored_bytes / r.logical_bytes, 4),
        "note": "base (8 x 2048^2 layers + head) + 3 fine-tunes changing the head only + the base "
        "registered twice more as DoP variants; host and disk each hold the stored bytes",
    }


# ---------------------------------------------------------------------- prefetch


def _service(seed: int) -> tuple[nn.Module, Any]:
    def handle(model: nn.Module, payloads: list[Any]) -> list[Any]:
        time.sleep(CALL_S)  # the call's own work: the window a hint has to move the next
        x = torch.tensor(payloads, dtype=torch.float32)
        return model(x).sum(dim=1).tolist()  # type: ignore[no-any-return]

    return layered(3, seed, dim=1024), handle  # ~12.6 MB


def svc_0() -> tuple[nn.Module, Any]:
    return _service(10)


def svc_1() -> tuple[nn.Module, Any]:
    return _service(11)


def svc_2() -> tuple[nn.Module, Any]:
    return _service(12)


def svc_3() -> tuple[nn.Module, Any]:
    return _service(13)


def _dispatch(i: int, service: str) -> Dispatch:
    spec = ActionSpec(
        action_id=f"c{i}",
        job_id="bench",
        trajectory_id="",
        action=InferAction(service=service, payload=[0.1] * 1024),
        timeout_s=60,
    )
    action = msgspec.structs.replace(formulate_infer(spec, now=0.0), attempt=1)
    return Dispatch(action=action, epoch=1, incarnation="bench")


async def _serve_trace(root: Path, prefetch: bool, trace: list[str]) -> dict[str, Any]:
    cfg = GpuManagerConfig(
        node_id="bench",
        backend="cpu",
        cpu_devices=2,
        cpu_budget_mb=16,  # one service per device
        host_budget_mb=30,  # two services of four
        state_dir=str(root),
        prefetch=prefetch,
    )
    ex = GpuExecutor(cfg)
    await ex.start()
    specs = [ServiceSpec(f"s{i}", f"bench.state:svc_{i}") for i in range(PREFETCH_SERVICES)]
    await ex.prepare(specs)
    latencies = []
    try:
        for i, name in enumerate(trace):
            upcoming = list(dict.fromkeys(trace[i + 1 : i + 3]))  # the queue behind this call
            if upcoming:
                ex.prefetcher.hint([(n, 1) for n in upcoming])
            t0 = time.perf_counter()
            out = await ex.run(_dispatch(i, name))
            latencies.append(time.perf_counter() - t0)
            assert out.exit_code == 0, out
    finally:
        await ex.close()
    calls = sum(r.calls for r in ex.ran.values())
    return {
        "calls": calls,
        "device_hit_fraction": round(sum(r.device_hits for r in ex.ran.values()) / calls, 3),
        "host_hit_fraction": round(sum(r.host_hits for r in ex.ran.values()) / calls, 3),
        "mean_call_ms": round(statistics.mean(latencies) * 1e3, 1),
        "promotions_on_demand_or_prefetch": ex.state.report().promotions,
        "prefetched_to_host": ex.prefetcher.host,
        "prefetched_to_device": ex.prefetcher.device,
        "violations": ex.state.violations(),
    }


def prefetch(root: Path) -> dict[str, Any]:
    rng = random.Random(0)
    trace = [f"s{rng.randrange(PREFETCH_SERVICES)}" for _ in range(PREFETCH_CALLS)]
    out = {}
    for mode in (False, True):
        with tempfile.TemporaryDirectory(dir=root) as d:
            out["with" if mode else "without"] = asyncio.run(_serve_trace(Path(d), mode, trace))
    out["note"] = (
        f"{PREFETCH_SERVICES} services of ~12.6 MB, 2 CPU devices holding one each, host tier "
        f"holding two; {PREFETCH_CALLS} sequential calls in a seeded random order, each "
        f"{CALL_S * 1e3:.0f} ms of handler time; with: before each call the node is hinted the "
        "next two calls' services (what the scheduler's queue shows)"
    )
    return out


# ---------------------------------------------------------------------- results


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Held while reading and rewriting the shared results file (the environment half writes
    other keys of it)."""
    fd = os.open(path.parent, os.O_RDONLY)  # the directory: no lock file left behind
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def merge(result: dict[str, Any]) -> None:
    """Put ``result``'s keys into OUT, keeping every other key; atomic replace."""
    OUT.parent.mkdir(exist_ok=True)
    with _locked(OUT):
        current = json.loads(OUT.read_text()) if OUT.exists() else {}
        current.update(result)
        tmp = OUT.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(current, indent=2) + "\n")
        os.replace(tmp, OUT)


def main() -> None:
    torch.set_num_threads(THREADS)
    with tempfile.TemporaryDirectory(prefix="tangram-state-") as d:
        root = Path(d)
        (root / "restore").mkdir()
        (root / "dedupe").mkdir()
        result = {
            "model_restore": model_restore(root / "restore"),
            "dedupe": dedupe(root / "dedupe"),
            "prefetch": prefetch(root),
        }
    merge(result)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
