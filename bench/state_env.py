"""Environment tiering: restore latency per tier on this machine, and trajectories per node.

    python bench/state_env.py [--docker-host unix:///path/docker.sock] [--mb 100] [--reps 3]

1. The machine's disk limits, measured in the same run: sequential write + fsync, and a read
   of that file with its pages dropped from the page cache (``posix_fadvise(DONTNEED)``).
2. On a private dockerd (as the tests start one; needs root and ``scripts/docker-engine.sh``):
   an environment with a ``--mb`` MiB work directory; the latency of an action in it when it
   is running, paused (the action thaws it) and on disk (the action restores it: a new
   container and the unpack of its snapshot, whose pages are dropped from the cache first),
   and how long saving it to disk took.
3. The simulator (``services/scheduler/sim/env_memory.py``, the AI-coding trace, environments
   busy ~47% of their life): the most concurrent trajectories on one node whose average ACT
   stays within that of the node filled to its memory without tiering, with the measured
   disk -> running latency as the restore cost.

Merges ``{"env_tiering": ...}`` into bench/results/state.json (other keys are kept).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "libs"), str(REPO / "tests" / "integration" / "docker")]

from engine import LocalDockerd, build_test_image, test_mounts  # noqa: E402

from services.cpu_manager.backend_api import ExecRequest  # noqa: E402
from services.cpu_manager.docker.backend import DockerBackend  # noqa: E402
from services.cpu_manager.docker.config import DockerConfig  # noqa: E402
from services.cpu_manager.docker.tiers import Tier  # noqa: E402
from services.scheduler.sim.env_memory import NodeModel, trajectories_per_node  # noqa: E402
from services.scheduler.sim.traces import (  # noqa: E402
    CodingConfig,
    Step,
    ai_coding,
    busy_fraction,
)
from tangram.contract import ErrorKind  # noqa: E402

RESULTS = REPO / "bench" / "results" / "state.json"
MIB = 1 << 20


# --------------------------------------------------------------------------- disk limits


def _drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def disk_limits(directory: Path, mb: int) -> dict[str, float]:
    """Sequential write+fsync and uncached read of ``mb`` MiB in ``directory`` (MB/s)."""
    path = directory / f"disk-{uuid.uuid4().hex[:6]}"
    block = os.urandom(MIB)
    t0 = time.perf_counter()
    with path.open("wb") as f:
        for _ in range(mb):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    write_s = time.perf_counter() - t0
    _drop_cache(path)
    t0 = time.perf_counter()
    with path.open("rb") as f:
        while f.read(4 * MIB):
            pass
    read_s = time.perf_counter() - t0
    path.unlink()
    return {
        "write_fsync_mb_per_s": round(mb * MIB / 1e6 / write_s, 1),
        "read_uncached_mb_per_s": round(mb * MIB / 1e6 / read_s, 1),
        "mb": mb,
    }


# --------------------------------------------------------------------------- restore latency


def request(tid: str, command: str, memory_mb: int = 512) -> ExecRequest:
    cores = (sorted(os.sched_getaffinity(0))[0],)
    argv = ("sh", "-c", command)
    return ExecRequest(uuid.uuid4().hex, tid, argv, cores, 120.0, 4096, memory_mb=memory_mb)


async def _run_ok(backend: DockerBackend, tid: str, command: str) -> float:
    t0 = time.perf_counter()
    out = await backend.run(request(tid, command))
    elapsed = time.perf_counter() - t0
    if out.failure is not None or out.exit_code != 0:
        raise RuntimeError(f"{command!r} failed: {out.failure} {out.detail} {out.stderr!r}")
    return elapsed


async def _fill(backend: DockerBackend, tid: str, mb: int) -> None:
    await _run_ok(
        backend, tid, f"for i in $(seq 1 {mb}); do head -c {MIB} /dev/urandom > f$i; done"
    )


async def _via_disk(backend: DockerBackend, tid: str) -> tuple[float, float]:
    """(save, restore) seconds: to disk, the snapshot's pages dropped, then an action."""
    t0 = time.perf_counter()
    await backend.tiers._to_disk(tid)
    saved = time.perf_counter() - t0
    assert backend.tiers.tier_of(tid) is Tier.DISK
    await backend.call(_drop_cache, backend.tiers.store.path(tid))
    if backend.cfg.warm_pool:
        await backend.pool.wait_full(timeout_s=60)
    restored = await _run_ok(backend, tid, "true")
    assert backend.tiers.tier_of(tid) is Tier.RUNNING
    return saved, restored


async def tier_latencies(backend: DockerBackend, mb: int, reps: int) -> dict[str, Any]:
    """Latency of ``true`` in an environment with ``mb`` MiB of files, per tier it starts in
    (a backend without a warm pool: a restore creates its container)."""
    tid = "bench-env"
    await _fill(backend, tid, mb)
    running = [await _run_ok(backend, tid, "true") for _ in range(reps * 3)]
    paused = []
    for _ in range(reps):
        await backend.tiers._pause(tid)
        assert backend.tiers.tier_of(tid) is Tier.PAUSED
        paused.append(await _run_ok(backend, tid, "true"))
    moves = [await _via_disk(backend, tid) for _ in range(reps)]
    cold = [await _run_ok(backend, f"new-{i}", "true") for i in range(reps)]
    size = mb * MIB
    restore_s = statistics.median(m[1] for m in moves)
    save_s = statistics.median(m[0] for m in moves)
    return {
        "work_dir_mb": mb,
        "running_s": _stats(running),
        "paused_to_running_s": _stats(paused),
        "disk_to_running_s": _stats([m[1] for m in moves]),
        "running_to_disk_s": _stats([m[0] for m in moves]),
        "new_container_first_action_s": _stats(cold),
        "restore_mb_per_s": round(size / 1e6 / restore_s, 1),
        "save_mb_per_s": round(size / 1e6 / save_s, 1),
    }


async def warm_pool_restores(backend: DockerBackend, mb: int, reps: int) -> dict[str, Any]:
    """disk -> running when the restore takes a warm-pool container (no creation)."""
    tid = "bench-env-pool"
    await _fill(backend, tid, mb)
    moves = [await _via_disk(backend, tid) for _ in range(reps)]
    assert backend.stats["pool_restores"] >= reps
    return {"disk_to_running_warm_pool_s": _stats([m[1] for m in moves])}


def _stats(samples: list[float]) -> dict[str, float]:
    return {
        "median": round(statistics.median(samples), 4),
        "max": round(max(samples), 4),
        "n": len(samples),
    }


async def measure(host: str, image: str, root: Path, mb: int, reps: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pool, case in ((0, tier_latencies), (1, warm_pool_restores)):
        cfg = DockerConfig(
            root=str(root / f"envs{pool}"),
            docker_host=host,
            node_id=f"bench{uuid.uuid4().hex[:6]}",
            incarnation=uuid.uuid4().hex[:8],
            image=image,
            mounts=test_mounts(),
            warm_pool=pool,
            tier_pause_after_s=0.0,
            tier_disk_after_s=0.0,  # moves made by the bench itself
        )
        backend = DockerBackend(cfg)
        await backend.start()
        try:
            out |= await case(backend, mb, reps)
        finally:
            await backend.close()
    return out


# --------------------------------------------------------------------------- simulator


TOLERANCES = (0.0, 0.01, 0.05)
HEADLINE = 0.01  # "equal" ACT: within 1% (the strict and 5% counts are reported beside it)


def simulated(restore_s: float, seed: int) -> dict[str, Any]:
    trace = ai_coding(CodingConfig(batch=256), seed)
    node = NodeModel(cores=64, memory_mb=64 * 1024, env_mb=4096, reward_dop=8, restore_s=restore_s)
    cap = trajectories_per_node(trace, node, TOLERANCES)
    return {
        "trajectories_per_node": cap.per_tolerance[HEADLINE],
        "act_tolerance": HEADLINE,
        "trajectories_per_node_by_tolerance": {str(t): v for t, v in cap.per_tolerance.items()},
        "target_act_s": round(cap.target_act_s, 3),
        "act_s_by_trajectories": {
            k: {str(n): round(a, 3) for n, a in sorted(c.items())} for k, c in cap.curves.items()
        },
        "node": dataclasses.asdict(node),
        "trace": {"workload": "ai_coding", "batch": 256, "seed": seed},
        "env_busy_fraction": round(busy_fraction(trace), 3),
    }


# --------------------------------------------------------------------------- real run

REAL_NODE_MB, REAL_ENV_MB = 1024, 256  # a node whose memory holds 4 environments
REAL_SLOTS = (4, 6, 8)
REAL_SCALE = 10.0


def _scaled(step: Step) -> tuple[float, float]:
    """(gap, action) seconds of a trace step on a real engine, both / ``REAL_SCALE``: the LLM
    gap, and the action's run time (at the simulator's DoP for a reward run) as ``sleep`` (CPU
    contention is the simulator's part; this run measures what tiering adds to real actions:
    pauses, snapshots and restores on a real engine, unscaled)."""
    units = 8 if step.profile == "reward" else 1
    return step.gap_s / REAL_SCALE, step.duration(units) / REAL_SCALE


async def real_run(
    host: str, image: str, root: Path, slots: int, tiering: bool, seconds: float
) -> dict[str, Any]:
    """``slots`` trajectories at once on one backend for ``seconds``; their mean ACT."""
    cfg = DockerConfig(
        root=str(root / f"real-{slots}-{tiering}"),
        docker_host=host,
        node_id=f"real{uuid.uuid4().hex[:6]}",
        incarnation=uuid.uuid4().hex[:8],
        image=image,
        mounts=test_mounts(),
        warm_pool=0,
        pool_memory_mb=REAL_ENV_MB,
        # without tiering the node holds what its memory holds; with it, the scheduler places
        # more (it counts running and paused ones only) and the node's pressure rule keeps
        # the resident ones within its memory
        max_envs=64 if tiering else REAL_NODE_MB // REAL_ENV_MB,
        tier_budget_mb=REAL_NODE_MB if tiering else 0,
        tier_pause_after_s=0.5 if tiering else 0.0,
        tier_disk_after_s=0.0,
        tier_min_idle_s=0.5,
        tier_tick_s=0.2,
    )
    trace = ai_coding(CodingConfig(batch=64), 7)
    acts: list[float] = []
    censored: list[float] = []  # still waiting for room at the run's end: their waits so far
    resident: list[int] = []
    deadline = time.monotonic() + seconds
    backend = DockerBackend(cfg)
    await backend.start()

    async def trajectory_loop(slot: int) -> None:
        for i in range(slot, 10**6, slots):
            traj = trace[i % len(trace)]
            tid = f"{traj.trajectory_id}-{i}"
            for step in traj.steps:
                gap, run_s = _scaled(step)
                await asyncio.sleep(gap)
                if time.monotonic() > deadline:
                    return
                act, done = await _act(backend, tid, run_s, deadline)
                (acts if done else censored).append(act)
            await backend.drop_env(tid)

    async def sample() -> None:
        while time.monotonic() < deadline:
            resident.append(len(backend.envs()) - len(backend.envs_on_disk()))
            await asyncio.sleep(0.2)

    try:
        async with asyncio.timeout(seconds + 300), asyncio.TaskGroup() as tg:
            for slot in range(slots):
                tg.create_task(trajectory_loop(slot))
            tg.create_task(sample())
    finally:
        await backend.close()
    return {
        "mean_act_s": round(statistics.mean(acts), 4),
        "actions": len(acts),
        # left out of mean_act_s: with them, at their waits so far (a lower bound)
        "censored": len(censored),
        "mean_act_s_with_censored": round(statistics.mean(acts + censored), 4),
        "resident_envs_mean": round(statistics.mean(resident), 2),
        "resident_envs_max": max(resident),
        "restores": backend.stats["restored"],
        "pauses": backend.stats["paused"],
    }


async def _act(
    backend: DockerBackend, tid: str, run_s: float, deadline: float
) -> tuple[float, bool]:
    """One action's completion time, and whether it completed; a node at its cap says busy and
    it is asked again (until the run's end: then its wait so far, not completed)."""
    t0 = time.perf_counter()
    while True:
        out = await backend.run(request(tid, f"sleep {run_s:.3f}", REAL_ENV_MB))
        if out.failure is ErrorKind.BACKEND_UNAVAILABLE:  # memory full: wait for room
            if time.monotonic() > deadline:
                return time.perf_counter() - t0, False
            await asyncio.sleep(0.05)
            continue
        if out.failure is not None or out.exit_code != 0:
            raise RuntimeError(f"action failed: {out.failure} {out.detail}")
        return time.perf_counter() - t0, True


REAL_TOLERANCES = (0.01, 0.05, 0.15)


def real_capacity(
    runs: dict[str, dict[int, dict[str, Any]]], full: int, tolerance: float
) -> dict[str, int | None]:
    """The most trajectories whose mean ACT is within ``tolerance`` of the node filled to its
    memory without tiering (None: not even the fewest tried)."""
    bound = runs["without"][full]["mean_act_s"] * (1 + tolerance)
    out: dict[str, int | None] = {}
    for name, by_n in runs.items():
        fits = [n for n, r in sorted(by_n.items()) if r["mean_act_s"] <= bound]
        out[name] = max(fits, default=None)
    return out


async def real_runs(host: str, image: str, root: Path, seconds: float) -> dict[str, Any]:
    full = REAL_NODE_MB // REAL_ENV_MB
    base = await real_run(host, image, root, full, False, seconds)
    over = await real_run(host, image, root, full + 1, False, seconds)
    tiered = {n: await real_run(host, image, root, n, True, seconds) for n in REAL_SLOTS}
    runs = {"without": {full: base, full + 1: over}, "with": tiered}
    by_tolerance = {str(t): real_capacity(runs, full, t) for t in REAL_TOLERANCES}
    return {
        "trajectories_per_node": by_tolerance[str(HEADLINE)],
        "act_tolerance": HEADLINE,
        "trajectories_per_node_by_tolerance": by_tolerance,
        "without": {str(n): r for n, r in runs["without"].items()},
        "with": {str(n): r for n, r in tiered.items()},
        "node": {"memory_mb": REAL_NODE_MB, "env_mb": REAL_ENV_MB, "seconds_per_run": seconds},
        "scaling": f"LLM gaps and action run times / {REAL_SCALE:g}, actions as sleep "
        "(AI-coding trace, seed 7); pauses, snapshots and restores unscaled",
    }


# --------------------------------------------------------------------------- main


def merge(result: dict[str, Any]) -> None:
    """Read-modify-write: other benches' keys in the same file are kept."""
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    current = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    current["env_tiering"] = result
    tmp = RESULTS.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(current, indent=2) + "\n")
    tmp.replace(RESULTS)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docker-host", default="", help="use this engine, not a private one")
    parser.add_argument("--mb", type=int, default=100, help="MiB in the work directory")
    parser.add_argument("--reps", type=int, default=3, help="measurements per tier")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--real-s", type=float, default=60.0, help="seconds per real run; 0: none")
    args = parser.parse_args()
    (REPO / ".state").mkdir(exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="tg-state-env-", dir=REPO / ".state"))
    local = None
    host = args.docker_host
    if not host:
        local = LocalDockerd()
        host = local.start().host
    try:
        image = build_test_image(host)
        limits = disk_limits(root, 256)
        latency = asyncio.run(measure(host, image, root, args.mb, args.reps))
        real = asyncio.run(real_runs(host, image, root, args.real_s)) if args.real_s > 0 else None
    finally:
        if local is not None:
            local.stop()
        shutil.rmtree(root, ignore_errors=True)
    restore_s = latency["disk_to_running_s"]["median"]
    result = {"disk": limits, "restore": latency} | simulated(restore_s, args.seed)
    if real is not None:
        result["real_run"] = real
    merge(result)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
