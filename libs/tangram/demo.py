"""``tangram demo``: an embedded mesh running a small AI-coding rollout.

Each trajectory plays several turns of an agent writing code: a short tool action writes a
module and its tests into the trajectory's environment, then a reward action runs the test
suite with ``{dop}`` worker processes on the cores it is granted (an elastic action). The
closing table splits action completion time into queue, execution and system overhead.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from tangram import demo_mopd
from tangram.client import Client
from tangram.contract import ActionResult
from tangram.launcher import Mesh, MeshOptions

RUNNER = r"""
import sys, importlib, multiprocessing as mp
def run(name):
    mod = importlib.import_module("test_solution")
    try:
        getattr(mod, name)(); return 1
    except AssertionError:
        return 0
if __name__ == "__main__":
    mod = importlib.import_module("test_solution")
    names = [n for n in dir(mod) if n.startswith("test_")]
    with mp.Pool(int(sys.argv[1])) as pool:
        ok = sum(pool.map(run, names))
    print(f"{ok}/{len(names)} passed")
    sys.exit(0 if ok == len(names) else 1)
"""


FIB = """def fib(n):
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a
"""


@dataclass(frozen=True)
class DemoOptions:
    trajectories: int = 32
    turns: int = 4
    tests: int = 6
    seed: int = 0


def solution(turn: int, rng: random.Random) -> str:
    """The 'model output' of one turn: a function that is right from turn 2 on, mostly."""
    bug = " + 1" if turn == 0 and rng.random() < 0.7 else ""
    return FIB.replace("return a", f"return a{bug}")


def tests(n: int) -> str:
    cases = [
        f"def test_{i}():\n    assert sum(fib(k % 25) for k in range(20000)) == "
        f"sum(_ref(k % 25) for k in range(20000))\n"
        for i in range(n)
    ]
    ref = FIB.replace("def fib", "def _ref")
    return "from solution import fib\n" + ref + "\n".join(cases)


def heredoc(path: str, body: str) -> str:
    return f"cat > {path} <<'TANGRAM_EOF'\n{body}\nTANGRAM_EOF"


async def trajectory(
    client: Client, job: str, t: int, opts: DemoOptions, done: Progress, task: TaskID
) -> list[tuple[str, ActionResult, float]]:
    rng = random.Random(opts.seed * 1000 + t)
    tid = f"{job}-traj{t}"
    out: list[tuple[str, ActionResult, float]] = []
    setup = heredoc("run_tests.py", RUNNER) + "\n" + heredoc("test_solution.py", tests(opts.tests))
    for turn in range(opts.turns):
        await asyncio.sleep(rng.uniform(0.05, 0.3))  # the policy model "thinks"
        write = setup + "\n" if turn == 0 else ""
        write += heredoc("solution.py", solution(turn, rng))
        for kind, cmd, cpus in (
            ("tool", write, 1),
            ("reward", "python3 run_tests.py {dop}", (1, 4)),
        ):
            t0 = time.monotonic()
            res = await client.exec(
                cmd, trajectory_id=tid, job_id=job, cpus=cpus, timeout_s=120, profile=f"demo.{kind}"
            )
            out.append((kind, res, time.monotonic() - t0))
            done.advance(task)
    await client.close_env(tid)
    return out


def pct(xs: Sequence[float], p: float) -> float:
    if not xs:
        return 0.0
    return statistics.quantiles(xs, n=100, method="inclusive")[int(p) - 1] if len(xs) > 1 else xs[0]


def report(console: Console, rows: list[tuple[str, ActionResult, float]], wall: float) -> None:
    table = Table(title="action completion time (ms)")
    for col in ("actions", "n", "", "p50", "p95", "p99"):
        table.add_column(col, justify="right" if col not in ("actions", "") else "left")
    for kind in ("tool", "reward", "all"):
        picked = [(r, act) for k, r, act in rows if kind in (k, "all")]
        parts = {
            "completion": [act for _, act in picked],
            "queue": [r.timings.queue_s for r, _ in picked if r.timings],
            "execution": [r.timings.exec_s for r, _ in picked if r.timings],
            "overhead": [
                max(0.0, act - (r.timings.queue_s + r.timings.exec_s))
                for r, act in picked
                if r.timings
            ],
        }
        for i, (name, xs) in enumerate(parts.items()):
            ms = [1000 * x for x in xs]
            table.add_row(
                kind if i == 0 else "",
                str(len(ms)) if i == 0 else "",
                name,
                *(f"{pct(ms, p):.1f}" for p in (50, 95, 99)),
            )
        table.add_section()
    console.print(table)
    ok = sum(r.ok for _, r, _ in rows)
    infra = sum(r.infrastructure_failure for _, r, _ in rows)
    failed_tests = sum(
        1 for k, r, _ in rows if k == "reward" and not r.ok and not r.infrastructure_failure
    )
    console.print(
        f"{len(rows)} actions in {wall:.1f}s ({len(rows) / wall:.0f}/s): {ok} succeeded, "
        f"{failed_tests} reward runs with failing tests (the policy's fault), "
        f"{infra} infrastructure failures"
    )
    console.print("overhead = completion seen by the client - queue - execution")


async def run_demo(mesh_opts: MeshOptions, opts: DemoOptions) -> int:
    console = Console()
    mesh_opts.env.setdefault("TANGRAM_GPU_CPU_BUDGET_MB", demo_mopd.DEVICE_BUDGET_MB)
    console.print(f"starting an embedded mesh in {mesh_opts.state_dir} ...")
    async with Mesh(mesh_opts) as mesh:
        console.print(
            f"mesh up: nats {mesh.nats_url}; {opts.trajectories} trajectories x "
            f"{opts.turns} turns (a write action and a test run each)"
        )
        job = f"demo-{int(time.time())}"
        async with Client.connect(mesh.nats_url) as client:
            columns = (
                TextColumn("rollout"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
            )
            with Progress(*columns, console=console) as progress:
                task = progress.add_task("actions", total=opts.trajectories * opts.turns * 2)
                t0 = time.monotonic()
                per = await asyncio.gather(
                    *(
                        trajectory(client, job, t, opts, progress, task)
                        for t in range(opts.trajectories)
                    )
                )
                wall = time.monotonic() - t0
        report(console, [row for rows in per for row in rows], wall)
        console.print(f"ran on the {mesh_opts.backend} backend (mesh.json is removed on exit)")
        infra = sum(r.infrastructure_failure for rows in per for _, r, _ in rows)
        if mesh_opts.gpu_manager:
            async with Client.connect(mesh.nats_url) as client:
                infra += await demo_mopd.run(console, client, job, opts.trajectories)
    return 1 if infra else 0
