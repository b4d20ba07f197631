"""`true` actions through a locked-down mesh, as `tangram up` runs it -> bench/results/secure_mesh.json.

``make bench-throughput`` measures the mesh without its lock-down. A user's ``tangram up`` runs
with credentials per role on NATS, a Postgres role per service and, on the process backend as
root, each trajectory's actions as a uid of its own (``tangram-dropuid``). This runs that mesh
(embedded NATS and Postgres, one CPU node agent, fsync on) and a closed loop of ``true``
actions, ``--in-flight`` at a time, over ``--trajectories`` trajectories (each one's first
action creates its environment: a directory owned by a fresh uid), and reports per point the
rate of completed actions and what did not succeed (an idle environment reclaimed for memory
would show as ``environment_lost``: 512 MiB booked per environment, the default, fills this
24 GiB machine's books at ~47 trajectories unless idle ones are unbooked).

Then an RL step's start (``step_start``, as ``bench.throughput`` records it): 256 new
trajectories' first actions at once, each uid rid of leftovers and its directory made, then one
more action each.

    python -m bench.secure_mesh [--actions 3000] [--in-flight 128] [--trajectories 32,128]
                                [--step-trajectories 256] [--step-rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bench.throughput import step_start
from tangram.client import Client
from tangram.launcher import Mesh, MeshOptions

OUT = Path(__file__).parent / "results" / "secure_mesh.json"


async def point(client: Client, actions: int, in_flight: int, trajectories: int) -> dict[str, Any]:
    """``actions`` ``true`` actions, ``in_flight`` at a time, over ``trajectories`` new ones."""
    tag = f"t{trajectories}-{time.monotonic_ns()}"
    gate = asyncio.Semaphore(in_flight)
    outcomes: Counter[str] = Counter()

    async def one(i: int) -> None:
        async with gate:
            res = await client.exec(
                ["true"], job_id="bench", trajectory_id=f"{tag}-{i % trajectories}"
            )
            outcomes[
                res.status if res.error is None else f"{res.status}:{res.error.kind.value}"
            ] += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(actions)))
    wall = time.perf_counter() - t0
    return {
        "trajectories": trajectories,
        "actions": actions,
        "in_flight": in_flight,
        "wall_s": round(wall, 2),
        "completed_per_s": round(outcomes["succeeded"] / wall, 1),  # failures excluded
        "outcomes": dict(outcomes),
    }


async def main(args: argparse.Namespace) -> dict[str, Any]:
    base = Path(tempfile.mkdtemp(prefix="tgsm-", dir="/tmp"))
    os.chmod(base, 0o711)  # the trajectories' uids pass through to their directories
    opts = MeshOptions(
        state_dir=base / "state",
        backend="process",
        secure=True,
        quota_manager=False,
        gpu_manager=False,
        dashboard=False,
        reward_front=False,
        quiet=True,
    )
    points = []
    try:
        async with (
            Mesh(opts) as mesh,
            Client.connect(mesh.nats_url, creds=mesh.client_creds) as client,
        ):
            await point(client, 200, 32, 8)  # warm up (its own trajectories)
            for n in (int(t) for t in args.trajectories.split(",")):
                points.append(await point(client, args.actions, args.in_flight, n))
                print(json.dumps(points[-1]), flush=True)
            step = None
            if args.step_rounds:  # an RL step's start, each new trajectory's uid rid first
                step = await step_start(client, args.step_trajectories, args.step_rounds)
                print(json.dumps({"step_start": step}), flush=True)
    finally:
        await asyncio.to_thread(shutil.rmtree, base, True)
    return {
        "what": __doc__.split("\n\n")[0],
        "root": os.geteuid() == 0,
        "machine": {"cores": os.cpu_count(), "python": platform.python_version()},
        "points": points,
        "step_start": step,
    }


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--actions", type=int, default=3000)
    ap.add_argument("--in-flight", type=int, default=128)
    ap.add_argument("--trajectories", default="32,128")
    ap.add_argument("--step-trajectories", type=int, default=256)
    ap.add_argument(
        "--step-rounds", type=int, default=3, help="bursts of new trajectories (0: none)"
    )
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()
    found = asyncio.run(main(args))
    Path(args.out).write_text(json.dumps(found, indent=1) + "\n")
    print(f"wrote {args.out}")
