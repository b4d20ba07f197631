"""The demo's MOPD phase: teacher models of different sizes score every trajectory through
the GPU pool (multi-teacher on-policy distillation), and a table shows what the pool did.

The teachers are small byte-level LMs built in code (random init, no downloads; see
``services.gpu_manager.examples``). The demo's gpu_manager gets devices too small to hold all
three at once, so calls restore teachers from their host copies and evict others (LRU).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections import Counter
from collections.abc import Sequence

from rich.console import Console
from rich.table import Table

from tangram.client import Client
from tangram.contract import ActionResult, ServiceSpec
from tangram.errors import TangramError

EXAMPLES = "services.gpu_manager.examples"
TEACHERS = (
    ServiceSpec("teacher-s", f"{EXAMPLES}:teacher_small", max_batch=8),
    ServiceSpec("teacher-m", f"{EXAMPLES}:teacher_medium", max_batch=8),
    ServiceSpec("teacher-l", f"{EXAMPLES}:teacher_large", max_batch=8),
)
COLUMNS: tuple[str, ...] = ("teacher", "calls", "ok", "restores", "after eviction")
COLUMNS += ("restore ms p50", "exec ms p50", "mean score")
DEVICE_BUDGET_MB = "64"  # per CPU device: teacher-l fits beside teacher-s, not teacher-m


def texts(n: int) -> list[str]:
    """The trajectories' final answers (what the teachers score)."""
    return [f"def fib(n):  # trajectory {i}\n    a, b = 0, 1\n    return a" for i in range(n)]


async def run(console: Console, client: Client, job: str, n: int) -> int:
    """Register the teachers, score ``n`` trajectories with each, print the table; returns
    the number of infrastructure failures."""
    console.print("MOPD: registering 3 teachers (13, 25 and 49 MB) on the GPU pool ...")
    try:
        states = [await client.register_service(t) for t in TEACHERS]
    except TangramError as exc:
        console.print(f"MOPD skipped: {exc}")
        return 0
    for s in states:
        console.print(f"  {s.spec.name}: {s.error or f'{s.footprint_mb} MB, ready'}")
    t0 = time.monotonic()
    calls = [
        score(client, job, t.name, text, i) for i, text in enumerate(texts(n)) for t in TEACHERS
    ]
    rows = await asyncio.gather(*calls)
    wall = time.monotonic() - t0
    table(console, rows, wall)
    return sum(r.infrastructure_failure for _, r in rows)


async def score(
    client: Client, job: str, teacher: str, text: str, i: int
) -> tuple[str, ActionResult]:
    res = await client.infer(teacher, text, job_id=job, trajectory_id=f"{job}-traj{i}")
    return teacher, res


def table(console: Console, rows: Sequence[tuple[str, ActionResult]], wall: float) -> None:
    t = Table(title="MOPD: teacher calls through the GPU pool")
    for col in COLUMNS:
        first = col == "teacher"
        t.add_column(col, justify="left" if first else "right", no_wrap=first)
    for spec in TEACHERS:
        mine = [r for name, r in rows if name == spec.name]
        t.add_row(spec.name, *_stats(mine))
    console.print(t)
    console.print(
        f"{len(rows)} teacher calls in {wall:.1f}s; a restore copies a teacher from its host "
        "copy onto the device; 'after eviction' restores found it evicted (LRU) since its last use"
    )


def _stats(results: Sequence[ActionResult]) -> tuple[str, ...]:
    ok = [r for r in results if r.ok]
    restored = [r for r in results if r.timings is not None and r.timings.restore_s > 0]
    first = Counter(r.allocation.gpus for r in restored if r.allocation is not None)
    scores = [float(r.output) for r in ok if isinstance(r.output, int | float)]
    return (
        str(len(results)),
        str(len(ok)),
        str(len(restored)),
        str(len(restored) - len(first)),
        _ms([r.timings.restore_s for r in restored if r.timings]),
        _ms([r.timings.exec_s for r in ok if r.timings]),
        f"{statistics.fmean(scores):.3f}" if scores else "-",
    )


def _ms(xs: Sequence[float]) -> str:
    return f"{1000 * statistics.median(xs):.1f}" if xs else "-"
