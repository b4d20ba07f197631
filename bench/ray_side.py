"""The side-by-side figure: a local Ray running the same work as the mesh's bench action.

Run as its own process (``python -m bench.ray_side``) so Ray's CPU never mixes with the mesh's,
and never while the mesh is measured. It starts Ray with the machine's cores, warms the workers,
then for each kind of task (``true`` in a subprocess, and a no-op) and each in-flight window
submits ``--tasks`` tasks and times first submission -> last result. CPU per task is summed over
this driver's process tree (raylet, GCS, workers: all its descendants; see bench.procstat).
Prints one JSON object on its last line. Ray keeps nothing durable: no commit, no log.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

from bench import procstat


def run_true() -> int:
    return subprocess.run(["true"], check=True).returncode


def noop() -> None:
    return None


def drive(fn: Any, n: int, window: int) -> float:
    """Seconds to run ``n`` tasks with at most ``window`` in flight (0: all submitted at once)."""
    import ray

    t0 = time.perf_counter()
    if window <= 0:
        ray.get([fn.remote() for _ in range(n)])
        return time.perf_counter() - t0
    pending: list[Any] = []
    submitted = 0
    while submitted < n or pending:
        while submitted < n and len(pending) < window:
            pending.append(fn.remote())
            submitted += 1
        # wait for a slice of the window, not one task: one ray.wait per result costs the driver
        k = max(1, min(len(pending), window // 8))
        ready, pending = ray.wait(pending, num_returns=k, fetch_local=True)
        ray.get(ready)  # raises if a task failed
    return time.perf_counter() - t0


def measure(fn: Any, n: int, window: int) -> dict[str, Any]:
    roots = [procstat.Root(os.getpid(), "driver", "ray_processes")]
    before = procstat.snapshot(roots)
    seconds = drive(fn, n, window)
    after = procstat.snapshot(roots)
    return {
        "window": window or "all",
        "tasks": n,
        "seconds": round(seconds, 3),
        "per_s": round(n / seconds, 1),
        "cpu_ms_per_task": procstat.per_action(before, after, n),
    }


def run(tasks: int, windows: list[int], cpus: int) -> dict[str, Any]:
    import ray

    t0 = time.perf_counter()
    ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    kinds = {"true": ray.remote(run_true), "noop": ray.remote(noop)}
    try:
        for fn in kinds.values():  # warm up: workers started, functions exported
            ray.get([fn.remote() for _ in range(200)])
        started_s = time.perf_counter() - t0
        configs = {k: [measure(fn, tasks, w) for w in windows] for k, fn in kinds.items()}
    finally:
        ray.shutdown()
    return {
        "ray_version": ray.__version__,
        "num_cpus": cpus,
        "start_and_warmup_s": round(started_s, 1),
        "configs": configs,
        "best_per_s": {k: max(c["per_s"] for c in cs) for k, cs in configs.items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tasks", type=int, default=3000)
    ap.add_argument("--windows", default="64,256,1024,0", help="in-flight bounds; 0 = all at once")
    ap.add_argument("--cpus", type=int, default=os.cpu_count() or 1)
    a = ap.parse_args()
    try:
        import ray  # noqa: F401
    except ImportError as exc:
        print(json.dumps({"error": f"ray not importable: {exc}"}))
        sys.exit(0)
    result = run(a.tasks, [int(w) for w in a.windows.split(",")], a.cpus)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
