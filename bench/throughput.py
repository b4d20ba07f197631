"""No-op actions (`true`) through the whole path at increasing offered load.

Starts a real mesh (embedded nats-server + PostgreSQL, each service its own process), then for
each offered rate submits actions open-loop for a fixed time from many trajectories and
measures, per action as the client sees it: completion time (submit -> result) and system
overhead (completion time minus the command's own execution time on the node).

    python -m bench.throughput [--rates 200,500,1000,2000,4000] [--seconds 5] [--no-fsync]

Writes bench/results/throughput.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path

import uvloop

from tangram.client import Client
from tangram.launcher import Mesh, MeshOptions

OUT = Path(__file__).parent / "results" / "throughput.json"


def pct(xs: list[float], p: int) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[p - 1] if len(xs) > 1 else xs[0]


async def one(client: Client, i: int, rate: int, trajectories: int, out: list) -> None:
    t0 = time.perf_counter()
    res = await client.exec(
        ["true"],
        trajectory_id=f"r{rate}-t{i % trajectories}",
        job_id=f"bench-{rate}",
        memory_mb=16,
        wait_s=120,
    )
    total = time.perf_counter() - t0
    exec_s = res.timings.exec_s if res.timings else 0.0
    out.append((total, exec_s, res.ok if res.ok else (res.error.kind.value if res.error else "?")))


async def offered(client: Client, rate: int, seconds: float, trajectories: int) -> dict:
    """Submit at ``rate``/s for ``seconds`` (open loop), then wait for every result."""
    out: list[tuple[float, float, bool]] = []
    tasks: list[asyncio.Task[None]] = []
    n = int(rate * seconds)
    start = time.perf_counter()
    for i in range(n):
        due = start + i / rate
        delay = due - time.perf_counter()
        if delay > 0.001:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(one(client, i, rate, trajectories, out)))
    sent = time.perf_counter() - start
    await asyncio.gather(*tasks)
    wall = time.perf_counter() - start
    totals = [t for t, _, _ in out]
    overheads = [max(0.0, t - e) for t, e, _ in out]
    return {
        "offered_per_s": rate,
        "submitted": n,
        "submit_s": round(sent, 3),
        "wall_s": round(wall, 3),
        "throughput_per_s": round(n / wall, 1),
        "succeeded": sum(ok is True for _, _, ok in out),
        "failed": dict(Counter(ok for _, _, ok in out if ok is not True)),
        "completion_ms": {
            "p50": round(1000 * pct(totals, 50), 3),
            "p99": round(1000 * pct(totals, 99), 3),
        },
        "overhead_ms": {
            "p50": round(1000 * pct(overheads, 50), 3),
            "p99": round(1000 * pct(overheads, 99), 3),
        },
        "exec_ms_p50": round(1000 * pct([e for _, e, _ in out], 50), 3),
    }


async def main(args: argparse.Namespace) -> dict:
    rates = [int(r) for r in args.rates.split(",")]
    with tempfile.TemporaryDirectory(prefix="tangram-bench-") as tmp:
        opts = MeshOptions(
            state_dir=Path(tmp),
            fsync=args.fsync,
            backend="process",
            env={"TANGRAM_GATEWAY_MAX_IN_FLIGHT": "100000"},
        )
        async with Mesh(opts) as mesh, Client.connect(mesh.nats_url) as client:
            await offered(client, 100, 1.0, args.trajectories)  # warm up
            points = []
            for rate in rates:
                point = await offered(client, rate, args.seconds, args.trajectories)
                print(json.dumps(point), flush=True)
                points.append(point)
    return {
        "what": "no-op actions (argv ['true']) through client -> gateway -> Postgres -> "
        "scheduler -> cpu_manager (process backend) -> client; open-loop offered load",
        "machine": {"cores": os.cpu_count(), "python": platform.python_version()},
        "postgres_fsync": args.fsync,
        "seconds_per_rate": args.seconds,
        "trajectories": args.trajectories,
        "points": points,
    }


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rates", default="200,500,1000,2000,3000")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--trajectories", type=int, default=256)
    ap.add_argument("--no-fsync", dest="fsync", action="store_false")
    ap.add_argument("--out", default=str(OUT))
    a = ap.parse_args()
    result = uvloop.run(main(a))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {a.out}")
