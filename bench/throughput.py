"""No-op actions (`true`) through the whole path at increasing offered load, and a local Ray
running the same work, side by side in the same run.

Starts a real mesh (embedded nats-server with its monitoring port + PostgreSQL, each service its
own process; no gpu_manager or quota_manager, whose idle CPU would pollute the figures), then for
each offered rate submits actions open-loop for a fixed time from many trajectories and measures,
per action as the client sees it: completion time (submit -> result) and system overhead
(completion time minus the command's own execution time on the node). Around each point it reads
where the cost went: CPU per action per process (bench.procstat), Postgres commits, rows and WAL,
NATS messages (bench.meshstats). Then, with the mesh stopped, Ray runs in its own process
(bench.ray_side).

    python -m bench.throughput [--rates 200,500,1000,2000,3000] [--seconds 5] [--nodes 1]
                               [--no-fsync] [--ray/--no-ray]

Writes bench/results/throughput.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections import Counter
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvloop

from bench import meshstats, procstat
from bench.meshstats import SETTLE_S, PgStats
from tangram.client import Client
from tangram.discovery import free_port
from tangram.embedded import EmbeddedNats
from tangram.errors import TangramError
from tangram.launcher import Mesh, MeshOptions

OUT = Path(__file__).parent / "results" / "throughput.json"
IDLE_S = 3.0
KEPT_UP = 0.95  # a point kept up when it completed at least this share of its offered rate

NOTES = {
    "sustained_per_s": "the mesh's best sustained throughput: the highest completed_per_s over "
    "the points (actions that succeeded / wall time from first submission to last result). A "
    "point beyond capacity drains its backlog at the mesh's capacity, so this is the capacity "
    "as long as it does not fall with a backlog.",
    "kept_up_per_s": "the highest completed_per_s among points that kept up (completed_per_s >= "
    f"{KEPT_UP} x offered); null if none did",
    "ray_true_per_s": "Ray's best rate over the in-flight windows tried, for a task running "
    "subprocess.run(['true']); ray_noop_per_s the same for a task returning None; Ray runs "
    "alone, after the mesh has stopped",
    "ratio_vs_ray": "sustained_per_s / ray_true_per_s",
    "cpu_ms_per_action": "CPU ms (utime+stime from /proc) per succeeded action over the point's "
    "wall time, per process group: postgres = postmaster and every backend (exited ones through "
    "the postmaster's cutime); children = what services forked (the `true`s); client = this "
    "process; sum = all groups; machine_busy = the whole machine; outside = machine_busy - sum, "
    "other processes' CPU meanwhile: far above 0, the machine was shared and the figures are "
    "suspect. The headline copies the sustained point's.",
    "quiet_wait_s": "before each point and before Ray, the bench waits (at most --wait-quiet s) "
    "until the machine is quiet; how long it waited, and whether it got there",
    "postgres_by_client": "postgres CPU ms per action of the backends of each service's "
    "connections (by client port; backends alive at the point's end); server = the rest "
    "(postmaster, WAL writer, checkpointer, backends that exited during the point)",
    "commits_per_action": f"pg_stat_database xact_commit delta per action, read {SETTLE_S}s after "
    "the point's last result (stats are published by idle backends), less the bench's own read; "
    "includes the mesh's background work (sweeps) during the point",
    "nats_msgs_per_action": "nats-server /varz in_msgs delta per action (messages published, "
    "client's included); nats_per_action has out_msgs and bytes",
    "step_start": "an RL step's start, after the points: `trajectories` new trajectories submit "
    "their first action at once (new: each makes its environment), then one more action each "
    "(known); per burst the wall time from the first submission to the last result, its rate, "
    "and the longest queue wait (timings.queue_s); --step-rounds bursts of each",
}


def pct(xs: list[float], p: int) -> float:
    if not xs:
        return float("nan")  # nothing succeeded: no latency to report
    return statistics.quantiles(xs, n=100, method="inclusive")[p - 1] if len(xs) > 1 else xs[0]


async def one(client: Client, i: int, rate: int, trajectories: int, out: list) -> None:
    t0 = time.perf_counter()
    try:
        res = await client.exec(
            ["true"],
            trajectory_id=f"r{rate}-t{i % trajectories}",
            job_id=f"bench-{rate}",
            memory_mb=16,
            wait_s=120,
        )
    except TangramError as exc:  # counted as a failure of its kind, not the end of the bench
        out.append((time.perf_counter() - t0, 0.0, type(exc).__name__))
        return
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
    done = [(t, e) for t, e, ok in out if ok is True]  # a failure's time is no latency sample
    totals = [t for t, _ in done]
    overheads = [max(0.0, t - e) for t, e in done]
    succeeded = len(done)
    return {
        "offered_per_s": rate,
        "submitted": n,
        "submit_s": round(sent, 3),
        "wall_s": round(wall, 3),
        "throughput_per_s": round(n / wall, 1),
        "completed_per_s": round(succeeded / wall, 1),
        "succeeded": succeeded,
        "failed": dict(Counter(ok for _, _, ok in out if ok is not True)),
        "completion_ms": {
            "p50": round(1000 * pct(totals, 50), 3),
            "p99": round(1000 * pct(totals, 99), 3),
        },
        "overhead_ms": {
            "p50": round(1000 * pct(overheads, 50), 3),
            "p99": round(1000 * pct(overheads, 99), 3),
        },
        "exec_ms_p50": round(1000 * pct([e for _, e in done], 50), 3),
    }


async def step_start(client: Client, trajectories: int, rounds: int) -> dict[str, Any]:
    """An RL step's start: ``trajectories`` new trajectories each submit their first action at
    once, then (the burst drained) one more action each, now of trajectories the node knows;
    ``rounds`` times. Per burst: the wall time to the last result and the longest queue wait."""
    out: dict[str, list[dict[str, float]]] = {"new": [], "known": []}
    for r in range(rounds):
        await quiet(10.0)
        for kind in ("new", "known"):
            t0 = time.perf_counter()
            res = await asyncio.gather(
                *(
                    client.exec(
                        ["true"],
                        trajectory_id=f"step{r}-t{i}",
                        job_id="bench-step",
                        memory_mb=16,
                        wait_s=120,
                    )
                    for i in range(trajectories)
                )
            )
            wall = time.perf_counter() - t0
            assert all(x.ok for x in res), [x.error for x in res if not x.ok][:3]
            out[kind].append(
                {
                    "wall_ms": round(1000 * wall, 1),
                    "per_s": round(trajectories / wall, 1),
                    "max_queue_ms": round(
                        1000 * max(x.timings.queue_s for x in res if x.timings), 1
                    ),
                }
            )
    return {"trajectories": trajectories, **out}


# ---------------------------------------------------------------------- where the cost goes


@dataclass
class Cpu:
    groups: dict[str, float]  # ms so far per process group
    table: dict[int, procstat.Stat]  # every process, for per-backend figures
    t: float


@dataclass
class Counters:
    pg: dict[str, float]
    nats: dict[str, float]
    backends: dict[int, int]  # Postgres backend pid -> client port


class Probe:
    """Reads the mesh's processes and servers around each load point."""

    def __init__(self, mesh: Mesh, nats: EmbeddedNats, pg: PgStats) -> None:
        assert mesh.pg is not None
        assert mesh.pg.proc is not None
        assert nats.proc is not None
        self.mesh, self.nats, self.pg = mesh, nats, pg
        self.servers = [
            procstat.Root(mesh.pg.proc.pid, "postgres", "postgres"),
            procstat.Root(nats.proc.pid, "nats", "nats"),
        ]

    def roots(self) -> list[procstat.Root]:
        services = [
            procstat.Root(p.pid, k.split(".")[0], "children") for k, p in self.mesh.procs.items()
        ]
        return services + self.servers

    def cpu(self) -> Cpu:
        table = procstat.scan()
        groups = procstat.snapshot(self.roots(), table)
        groups["client"] = procstat.self_ms()
        groups["machine_busy"] = procstat.machine_busy_ms()
        return Cpu(groups, table, time.perf_counter())

    async def counters(self) -> Counters:
        assert self.nats.http_port is not None
        pg, backends = await self.pg.read()
        return Counters(pg, await meshstats.nats_read(self.nats.http_port), backends)

    def owners(self, backends: dict[int, int]) -> dict[int, str]:
        """Backend pid -> the service whose connection it serves ("bench": ours)."""
        pids = {k.split(".")[0]: p.pid for k, p in self.mesh.procs.items()} | {"bench": os.getpid()}
        by_port = meshstats.port_owners(pids)
        return {pid: by_port.get(port, "unknown") for pid, port in backends.items()}


def cpu_report(c0: Cpu, c1: Cpu, owners: dict[int, str], actions: int) -> dict[str, Any]:
    g0, g1 = dict(c0.groups), dict(c1.groups)
    busy = g1.pop("machine_busy") - g0.pop("machine_busy")
    per = procstat.per_action(g0, g1, actions)
    by_client = procstat.pids_ms(c0.table, c1.table, owners)
    pg_total = g1.get("postgres", 0.0) - g0.get("postgres", 0.0)
    by_client["server"] = pg_total - sum(by_client.values())
    n = max(actions, 1)
    outside = (busy - sum(g1[k] - g0.get(k, 0.0) for k in g1)) / n
    return {
        "cpu_window_s": round(c1.t - c0.t, 3),
        "cpu_ms_per_action": per
        | {"machine_busy": round(busy / n, 3), "outside": round(outside, 3)},
        "postgres_by_client": {k: round(v / n, 3) for k, v in sorted(by_client.items())},
    }


def counters_report(k0: Counters, k1: Counters, actions: int) -> dict[str, Any]:
    return meshstats.pg_deltas(k0.pg, k1.pg, actions) | meshstats.nats_deltas(
        k0.nats, k1.nats, actions
    )


async def point(
    probe: Probe, client: Client, rate: int, args: argparse.Namespace, k0: Counters
) -> tuple[dict, Counters]:
    """One offered-load point with its cost; returns it and the counters it ended on."""
    waited = await quiet(args.wait_quiet)
    c0 = probe.cpu()
    p = await offered(client, rate, args.seconds, args.trajectories)
    c1 = probe.cpu()
    await asyncio.sleep(SETTLE_S)
    k1 = await probe.counters()
    p |= cpu_report(c0, c1, probe.owners(k0.backends | k1.backends), p["succeeded"])
    return p | counters_report(k0, k1, p["succeeded"]) | waited, k1


async def idle(probe: Probe, k0: Counters) -> tuple[dict, Counters]:
    """What the mesh costs doing nothing, per second (heartbeats, sweeps)."""
    c0 = probe.cpu()
    await asyncio.sleep(IDLE_S)
    c1 = probe.cpu()
    await asyncio.sleep(SETTLE_S)
    k1 = await probe.counters()
    seconds = IDLE_S + SETTLE_S
    cpu = {k: round((c1.groups[k] - c0.groups.get(k, 0.0)) / IDLE_S, 2) for k in c1.groups}
    return {
        "cpu_ms_per_s": cpu,
        "commits_per_s": round(
            (k1.pg["xact_commit"] - k0.pg["xact_commit"] - meshstats.OWN_COMMITS_PER_WINDOW)
            / seconds,
            2,
        ),
        "nats_msgs_per_s": round((k1.nats["in_msgs"] - k0.nats["in_msgs"]) / seconds, 2),
    }, k1


async def quiet(limit_s: float, cores: float = 0.3, sample_s: float = 1.0) -> dict[str, Any]:
    """Wait until the whole machine is busy under ``cores`` over ``sample_s`` (an idle mesh
    is far below), at most ``limit_s``: a bench sharing its 2 cores measures its neighbours."""
    t0 = time.perf_counter()
    while True:
        b0 = procstat.machine_busy_ms()
        await asyncio.sleep(sample_s)
        load = (procstat.machine_busy_ms() - b0) / (1000 * sample_s)
        if load < cores or time.perf_counter() - t0 >= limit_s:
            return {"quiet_wait_s": round(time.perf_counter() - t0, 1), "quiet": load < cores}


# ---------------------------------------------------------------------- the runs


def mesh_options(state: Path, nats_url: str, args: argparse.Namespace) -> MeshOptions:
    return MeshOptions(
        state_dir=state,
        nats_url=nats_url,
        nodes=args.nodes,
        fsync=args.fsync,
        backend="process",
        env={"TANGRAM_GATEWAY_MAX_IN_FLIGHT": "100000"},
        quota_manager=False,
        gpu_manager=False,
    )


async def run_mesh(args: argparse.Namespace, stack: AsyncExitStack, state: Path) -> dict[str, Any]:
    # our own NATS, with the monitoring endpoint the launcher's does not open
    nats = EmbeddedNats(state / "nats", http_port=free_port())
    await asyncio.to_thread(nats.start)
    stack.push_async_callback(asyncio.to_thread, nats.stop)
    mesh = await stack.enter_async_context(Mesh(mesh_options(state / "mesh", nats.url, args)))
    client = await stack.enter_async_context(Client.connect(mesh.nats_url))
    pg = await PgStats.connect(mesh.postgres_dsn)
    stack.push_async_callback(pg.close)
    probe = Probe(mesh, nats, pg)
    await offered(client, 100, 1.0, args.trajectories)  # warm up
    await asyncio.sleep(SETTLE_S)  # our own setup queries' stats published before the first read
    k = await probe.counters()
    idle_per_s, k = await idle(probe, k)
    points = []
    for rate in [int(r) for r in args.rates.split(",")]:
        p, k = await point(probe, client, rate, args, k)
        print(json.dumps(p), flush=True)
        points.append(p)
    step = (
        await step_start(client, args.trajectories, args.step_rounds) if args.step_rounds else None
    )
    print(json.dumps({"step_start": step}), flush=True)
    return {
        "postgres_version": await pg.version(),
        "idle_per_s": idle_per_s,
        "points": points,
        "step_start": step,
    }


async def run_ray(args: argparse.Namespace) -> dict[str, Any]:
    """Ray in its own process, alone on the machine; {"error": why} if it cannot run."""
    argv = [sys.executable, "-m", "bench.ray_side", "--tasks", str(args.ray_tasks)]
    proc = await asyncio.create_subprocess_exec(
        *argv,
        "--windows",
        args.ray_windows,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await proc.communicate()
    lines = out.decode().strip().splitlines()
    if proc.returncode != 0 or not lines:
        return {"error": f"bench.ray_side exited {proc.returncode}: {err.decode()[-500:]}"}
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def headline(mesh: dict[str, Any], ray: dict[str, Any] | None) -> dict[str, Any]:
    pts = mesh["points"]
    best = max(pts, key=lambda p: p["completed_per_s"])
    kept = [
        p["completed_per_s"] for p in pts if p["completed_per_s"] >= KEPT_UP * p["offered_per_s"]
    ]
    ray_best = (ray or {}).get("best_per_s", {})
    ray_true = ray_best.get("true")
    return {
        "sustained_per_s": best["completed_per_s"],
        "sustained_at_offered_per_s": best["offered_per_s"],
        "kept_up_per_s": max(kept) if kept else None,
        "ray_true_per_s": ray_true,
        "ray_noop_per_s": ray_best.get("noop"),
        "ratio_vs_ray": round(best["completed_per_s"] / ray_true, 3) if ray_true else None,
        "ray_unavailable": None if ray_true else (ray or {}).get("error", "not run (--no-ray)"),
        "cpu_ms_per_action": best["cpu_ms_per_action"],
        "postgres_by_client": best["postgres_by_client"],
        "commits_per_action": best["commits_per_action"],
        "nats_msgs_per_action": best["nats_msgs_per_action"],
    }


async def main(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="tangram-bench-") as tmp:
        async with AsyncExitStack() as stack:
            mesh = await run_mesh(args, stack, Path(tmp))
    ray = None
    if args.ray:  # the mesh is down by now
        ray = await quiet(args.wait_quiet) | await run_ray(args)
    return {
        "what": "no-op actions (argv ['true']) through client -> gateway -> Postgres -> "
        "scheduler -> cpu_manager (process backend) -> client; open-loop offered load; "
        "side by side with a local Ray running subprocess.run(['true']) in a task",
        "notes": NOTES,
        **headline(mesh, ray),
        "nodes": args.nodes,
        "machine": {"cores": os.cpu_count(), "python": platform.python_version()},
        "postgres_version": mesh["postgres_version"],
        "postgres_fsync": args.fsync,
        "seconds_per_rate": args.seconds,
        "trajectories": args.trajectories,
        "idle_per_s": mesh["idle_per_s"],
        "points": mesh["points"],
        "step_start": mesh["step_start"],
        "ray": ray,
    }


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rates", default="200,500,1000,2000,3000")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--trajectories", type=int, default=256)
    ap.add_argument("--nodes", type=int, default=1, help="cpu_manager node agents")
    ap.add_argument("--no-fsync", dest="fsync", action="store_false")
    ap.add_argument(
        "--step-rounds", type=int, default=3, help="bursts of --trajectories new ones (0: none)"
    )
    ap.add_argument(
        "--ray", action=argparse.BooleanOptionalAction, default=True, help="Ray side by side"
    )
    ap.add_argument("--ray-tasks", type=int, default=3000)
    ap.add_argument(
        "--ray-windows", default="64,256,1024,0", help="in-flight bounds; 0 = all at once"
    )
    ap.add_argument("--wait-quiet", type=float, default=60.0, help="s to wait for a quiet machine")
    ap.add_argument("--out", default=str(OUT))
    return ap.parse_args()


if __name__ == "__main__":
    a = parse()
    result = uvloop.run(main(a))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {a.out}")
