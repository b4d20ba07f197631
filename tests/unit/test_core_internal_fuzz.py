"""Internal messages that decode but make no sense (negative or duplicate cores, unknown
kinds, completions of unknown attempts, failures of unknown incarnations) fed to the
scheduler's cores in random order: none may raise (a raise in a handler is an error reply,
but one in the decide or tick loop takes the scheduler down)."""

from __future__ import annotations

import random

from services.scheduler.core.quota import QuotaCore
from services.scheduler.core.scheduler import CoreConfig, SchedulerCore
from tangram.contract import (
    Completion,
    ErrorKind,
    GpuDevice,
    Inventory,
    NodeLeaving,
    NodeReport,
    NumaCores,
    Outcome,
    Progress,
    RunningAction,
)

from .core_kit import action

rng = random.Random(1)


def rcores() -> tuple[int, ...]:
    return tuple(rng.choice([-1, 0, 1, 2, 3, 2**31]) for _ in range(rng.randint(0, 4)))


def report(node: str) -> NodeReport:
    kind = rng.choice(["cpu", "gpu", "quota", "weird"])
    numa = tuple(
        NumaCores(numa_node=rng.choice([0, 1, -1]), cores=rcores())
        for _ in range(rng.randint(0, 2))
    )
    gpus = tuple(
        GpuDevice(index=rng.choice([0, 1, -1, 7]), memory_mb=rng.choice([0, -5, 1000]))
        for _ in range(rng.randint(0, 3))
    )
    running = tuple(
        RunningAction(
            action_id=rng.choice(["a", "b", "c", "zz"]),
            attempt=rng.randint(-1, 3),
            trajectory_id=rng.choice(["t", "u", ""]),
            cores=rcores(),
            waiting=rng.random() < 0.3,
        )
        for _ in range(rng.randint(0, 3))
    )
    return NodeReport(
        node_id=node,
        incarnation=rng.choice(["i0", "i1"]),
        inventory=Inventory(numa=numa, memory_mb=rng.choice([0, -1, 1000]), kind=kind, gpus=gpus),
        running=running,
        envs=("t",),
        seq=rng.randint(0, 5),
        full=True,
        seen_epoch=rng.randint(0, 2),
        seen=rng.randint(0, 50),
        progress=Progress(started=rng.randint(0, 9)),
    )


def test_nonsense_node_messages_never_raise_in_the_cores() -> None:
    for _trial in range(400):
        core = SchedulerCore(cfg=CoreConfig(pipeline=rng.random() < 0.5))
        core.epoch = 1
        q = QuotaCore()
        now = 0.0
        for _step in range(30):
            now += rng.random()
            node = rng.choice(["n0", "n1"])
            r = rng.random()
            if r < 0.4:
                rep = report(node)
                (q if rep.inventory.kind == "quota" else core).node_report(rep, now)
            elif r < 0.6:
                core.enqueue(
                    action(
                        rng.choice(["a", "b", "c"]),
                        rng.choice(["t", "u"]),
                        cpus=rng.choice([1, 2, [1, 4]]),
                    ),
                    now,
                )
            elif r < 0.75:
                c = Completion(
                    node_id=node,
                    incarnation=rng.choice(["i0", "i1"]),
                    action_id=rng.choice(["a", "b", "c"]),
                    attempt=rng.randint(0, 3),
                    outcome=Outcome(
                        exit_code=rng.choice([0, 1, None]),
                        failure=rng.choice([None, ErrorKind.NODE_DIED]),
                    ),
                )
                core.complete(c, now)
                q.complete(c, now)
            elif r < 0.8:
                lv = NodeLeaving(
                    node_id=node,
                    incarnation=rng.choice(["i0", "i1"]),
                    draining=rng.random() < 0.5,
                    started=rng.choice([None, ("a",), ()]),
                    envs=rng.choice([None, ("t",)]),
                )
                core.node_leaving(lv, now)
                q.node_leaving(lv, now)
            elif r < 0.85:
                core.node_failed(node, rng.choice(["i0", "i1"]), now, "x", 3.0)
                q.agent_failed(node, "i0", now, "x")
            elif r < 0.9:
                core.env_expired(node, rng.choice(["t", "u"]))
            else:
                core.cancel(rng.choice(["a", "b", "c"]), now)
            core.schedule(now)
            core.tick(now)
            q.schedule(now)
            q.tick(now)
