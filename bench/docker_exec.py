"""Per-action overhead of the CPU node agent's backends, and a new trajectory's first action.

    python bench/docker_exec.py [--docker-host unix:///path/docker.sock] [--n 500]

Without ``--docker-host`` it starts a private dockerd (as the tests do; needs root and
``scripts/docker-engine.sh``). Every action is ``true``; consecutive actions alternate their
granted cores, so every one really re-pins. Reported per case: end-to-end latency of
``backend.run`` (p50/p99, ms) and the overhead on top of ``true`` itself (latency minus the
median host spawn of ``true``). Writes bench/results/docker_exec.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "integration" / "docker")]

from engine import LocalDockerd, build_test_image, test_mounts  # noqa: E402

from services.cpu_manager.backend_api import ExecRequest  # noqa: E402
from services.cpu_manager.docker.backend import DockerBackend  # noqa: E402
from services.cpu_manager.docker.config import DockerConfig  # noqa: E402

RESULTS = REPO / "bench" / "results" / "docker_exec.json"
CPUS = sorted(os.sched_getaffinity(0))


def percentiles(samples_s: list[float], baseline_s: float = 0.0) -> dict[str, float]:
    """p50/p99 in ms of ``samples_s`` minus ``baseline_s`` (clamped at zero)."""
    ms = sorted(max(s - baseline_s, 0.0) * 1e3 for s in samples_s)
    p99 = ms[min(len(ms) - 1, round(0.99 * (len(ms) - 1)))]
    return {"p50_ms": round(statistics.median(ms), 3), "p99_ms": round(p99, 3), "n": len(ms)}


def request(trajectory_id: str, i: int) -> ExecRequest:
    """Action ``i`` of a trajectory: ``true`` on one core, alternating between two."""
    core = CPUS[i % len(CPUS)] if len(CPUS) > 1 else CPUS[0]
    return ExecRequest(uuid.uuid4().hex, trajectory_id, ("true",), (core,), 30.0, 4096)


async def timed(fn: Callable[[], Awaitable[Any]]) -> float:
    """Seconds one awaited call takes."""
    t0 = time.perf_counter()
    out = await fn()
    elapsed = time.perf_counter() - t0
    failure = getattr(out, "failure", None)
    if failure is not None or getattr(out, "exit_code", 0) not in (0, None):
        raise RuntimeError(f"benchmark action failed: {out}")
    return elapsed


def host_true_s(n: int) -> float:
    """Median time to spawn and reap ``true`` on the host: the command's own cost."""
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        subprocess.run(["true"], check=True)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


async def steady_state(backend: Any, n: int) -> list[float]:
    """Latency of ``n`` actions of one trajectory whose environment already exists."""
    tid = f"bench-{uuid.uuid4().hex[:6]}"
    for i in range(5):  # create the env and warm up
        await timed(lambda i=i: backend.run(request(tid, i)))
    return [await timed(lambda i=i: backend.run(request(tid, i))) for i in range(n)]


async def first_actions(backend: DockerBackend, n: int, warm: bool) -> list[float]:
    """Latency of the first action of ``n`` new trajectories (pool refilled before each)."""
    samples = []
    for i in range(n):
        if warm:
            await backend.pool.wait_full(timeout_s=60)
        tid = f"first-{i}-{uuid.uuid4().hex[:6]}"
        samples.append(await timed(lambda tid=tid: backend.run(request(tid, 0))))
        await backend.drop_env(tid)
    return samples


async def pin_costs(backend: DockerBackend, n: int) -> dict[str, Any]:
    """Re-pinning alone: ``docker update`` vs writing the cgroup files."""
    await timed(lambda: backend.run(request("pin", 0)))
    env = backend.env("pin")
    assert env is not None
    update, write = [], []
    for i in range(n):
        cores = (CPUS[i % len(CPUS)],)
        t0 = time.perf_counter()
        await backend.call(backend.engine.update_cpus, env.container_id, cores)
        update.append(time.perf_counter() - t0)
        if env.cgroup is not None:
            t0 = time.perf_counter()
            env.cgroup.set_cpus(cores)
            write.append(time.perf_counter() - t0)
    out = {"docker_update": percentiles(update)}
    if write:
        out["cgroup_write"] = percentiles(write) | {"cgroup_version": env.cgroup.version}
    return out


def config(host: str, image: str, root: Path, **kw: Any) -> DockerConfig:
    """A benchmark backend's config."""
    base: dict[str, Any] = {
        "root": str(root / uuid.uuid4().hex[:6]),
        "docker_host": host,
        "node_id": f"bench{uuid.uuid4().hex[:6]}",
        "image": image,
        "mounts": test_mounts(),
        "warm_pool": 0,
        "pool_memory_mb": 256,
    }
    return DockerConfig(**(base | kw))


async def with_backend(cfg: DockerConfig, body: Callable[[DockerBackend], Awaitable[Any]]) -> Any:
    """Run ``body`` against a started backend, closing it afterwards."""
    backend = DockerBackend(cfg)
    try:
        await backend.start()
        return await body(backend)
    finally:
        await backend.close()


async def process_case(root: Path, n: int) -> list[float] | None:
    """(c) the process backend, if the lead's module is there."""
    try:
        from services.cpu_manager.process.backend import ProcessBackend, ProcessConfig
    except ImportError:
        return None
    backend = ProcessBackend(ProcessConfig(root=root / "process"))
    await backend.start()
    try:
        return await steady_state(backend, n)
    finally:
        await backend.close()


async def bench(host: str, image: str, n: int, n_first: int) -> dict[str, Any]:
    """All cases."""
    root = Path(tempfile.mkdtemp(prefix="tgb-"))
    try:
        return await _bench(host, image, n, n_first, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


async def _bench(host: str, image: str, n: int, n_first: int, root: Path) -> dict[str, Any]:
    base = host_true_s(200)
    cfg = lambda **kw: config(host, image, root, **kw)  # noqa: E731
    update_exec = await with_backend(
        cfg(exec_mode="docker_exec", cpuset_via="docker"), lambda b: steady_state(b, n // 3)
    )
    executor = await with_backend(
        cfg(exec_mode="executor", cpuset_via="cgroup"), lambda b: steady_state(b, n)
    )
    process = await process_case(root, n)
    warm = await with_backend(cfg(warm_pool=2), lambda b: first_actions(b, n_first, warm=True))
    cold = await with_backend(cfg(), lambda b: first_actions(b, n_first, warm=False))
    pins = await with_backend(cfg(), lambda b: pin_costs(b, n // 3))
    result: dict[str, Any] = {
        "update_exec": percentiles(update_exec, base) | {"latency": percentiles(update_exec)},
        "executor": percentiles(executor, base) | {"latency": percentiles(executor)},
    }
    if process is not None:
        result["process"] = percentiles(process, base) | {"latency": percentiles(process)}
    result |= {
        "first_action_warm": percentiles(warm),
        "first_action_cold": percentiles(cold),
        "pin": pins,
        "host_true_ms": round(base * 1e3, 3),
        "machine": {"cpus": len(CPUS), "kernel": platform.release(), "python": sys.version[:6]},
        "notes": "p50_ms/p99_ms of the steady-state cases are run() latency minus the host's "
        "median spawn of `true`; latency is end-to-end. first_action_* are end-to-end.",
    }
    return result


def main() -> int:
    """Entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--docker-host", default="", help="use this engine instead of a private one"
    )
    parser.add_argument("--n", type=int, default=600, help="actions per steady-state case")
    parser.add_argument(
        "--first", type=int, default=20, help="new trajectories per first-action case"
    )
    args = parser.parse_args()
    local = None
    host = args.docker_host
    if not host:
        local = LocalDockerd()
        host = local.start().host
    try:
        image = build_test_image(host)
        result = asyncio.run(bench(host, image, args.n, args.first))
    finally:
        if local is not None:
            local.stop()
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
