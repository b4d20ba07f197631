"""The gpu_manager as a process on the real bus: a user's factory from its PYTHONPATH, calls
whose outputs equal the model called directly (also right after an eviction and restore),
failing factories that leave it up, and bad input on its subject. The scheduler is a fake
listening where the scheduler listens (the scheduler's GPU side is tested on its own)."""

from __future__ import annotations

import importlib
import os
import sys
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tangram import subjects
from tangram.bus import Bus
from tangram.contract import (
    Ack,
    Completion,
    ErrorKind,
    NodeMessage,
    NodeReport,
    Outcome,
    Prepare,
    PreparedService,
    ServiceSpec,
)
from tangram.errors import InvalidRequest
from tangram.launcher import Mesh

from ..support import eventually, running_mesh, unbatched
from ..unit.test_gpu_agent import infer

pytestmark = pytest.mark.slow

USER_MODULE = "tangram_user_rewards"
USER_CODE = textwrap.dedent(
    """
    import torch

    def judge():
        torch.manual_seed(7)
        model = torch.nn.Sequential(torch.nn.Linear(4, 400), torch.nn.Tanh(), torch.nn.Linear(400, 400), torch.nn.Linear(400, 1))

        def handle(model, payloads):
            device = next(model.parameters()).device
            x = torch.tensor(payloads, dtype=torch.float32, device=device)
            return model(x).squeeze(1).tolist()

        return model, handle

    def rival():
        torch.manual_seed(8)
        model = torch.nn.Sequential(torch.nn.Linear(4, 400), torch.nn.Linear(400, 400), torch.nn.Linear(400, 1))
        return model, lambda model, payloads: model(torch.tensor(payloads)).squeeze(1).tolist()

    def broken():
        raise ImportError("weights for broken are not on this node")
    """
)


class FakeScheduler:
    def __init__(self) -> None:
        self.heard: list[NodeMessage] = []
        self.epoch = 0  # answered to reports: the only way an agent's epoch floor rises

    async def on_node(self, msg: NodeMessage, _raw: Any) -> Ack:
        self.heard += unbatched(msg)
        return Ack(epoch=self.epoch) if isinstance(msg, NodeReport) else Ack()

    def service(self, name: str) -> PreparedService | None:
        reports = [m for m in self.heard if isinstance(m, NodeReport)]
        found = [s for s in reports[-1].services if s.name == name] if reports else []
        return found[0] if found else None

    def outcome(self, action_id: str) -> Outcome | None:
        done = [m for m in self.heard if isinstance(m, Completion) and m.action_id == action_id]
        return done[0].outcome if done else None


@pytest.fixture
async def gpu_node(tmp_path: Path) -> AsyncIterator[tuple[Mesh, Bus, FakeScheduler]]:
    user = tmp_path / "user"
    user.mkdir()
    (user / f"{USER_MODULE}.py").write_text(USER_CODE)
    env = {
        "PYTHONPATH": os.pathsep.join([str(user), os.environ.get("PYTHONPATH", "")]),
        "TANGRAM_GPU_NODE_ID": "gpu0",
        "TANGRAM_GPU_BACKEND": "cpu",
        "TANGRAM_GPU_CPU_BUDGET_MB": "1",  # one of judge / rival per device at a time
        "TANGRAM_GPU_HEARTBEAT_S": "0.2",
        "TANGRAM_GPU_TORCH_THREADS": "1",
    }
    async with running_mesh(tmp_path / "mesh", servers_only=True, env=env) as mesh:
        bus = await Bus.connect(mesh.nats_url, "fake-scheduler")
        scheduler = FakeScheduler()
        bus.serve(subjects.SCHED_NODES, scheduler.on_node, max_in_flight=100)
        await bus.start()
        sys.path.insert(0, str(user))
        try:
            await mesh.start_service("gpu_manager")
            await eventually(
                lambda: [m for m in scheduler.heard if isinstance(m, NodeReport)],
                what="the gpu_manager to register",
                timeout_s=60,
            )
            yield mesh, bus, scheduler
        finally:
            sys.path.remove(str(user))
            sys.modules.pop(USER_MODULE, None)
            await bus.close()


async def test_user_factories_serve_exact_outputs_through_evictions(
    gpu_node: tuple[Mesh, Bus, FakeScheduler],
):
    mesh, bus, scheduler = gpu_node
    names = ("judge", "rival", "broken")
    specs = (
        *(ServiceSpec(n, f"{USER_MODULE}:{n}") for n in names),
        ServiceSpec("absent", "no_such_pkg_q:factory"),
    )
    await bus.request(subjects.node("gpu0"), Prepare(services=specs, epoch=1), timeout=5)
    for s in specs:
        await eventually(lambda s=s: scheduler.service(s.name), what=f"{s.name} prepared")
    assert "not on this node" in scheduler.service("broken").error  # type: ignore[union-attr]
    assert "cannot be imported" in scheduler.service("absent").error  # type: ignore[union-attr]
    user = importlib.import_module(USER_MODULE)
    x = [0.25, -1.0, 2.0, 0.5]
    expected = {n: getattr(user, n)()[1](getattr(user, n)()[0], [x])[0] for n in ("judge", "rival")}
    order = [("c1", "judge"), ("c2", "judge"), ("c3", "rival"), ("c4", "judge")]
    for aid, name in order:
        await bus.request(subjects.node("gpu0"), infer(aid, name, x, incarnation=""), timeout=5)
        await eventually(lambda aid=aid: scheduler.outcome(aid), what=aid, timeout_s=30)
    outs = {aid: scheduler.outcome(aid) for aid, _ in order}
    for aid, name in order:
        assert outs[aid].output == expected[name], aid  # type: ignore[union-attr]  # bit-exact
    assert outs["c2"].restore_s == 0  # type: ignore[union-attr]
    assert outs["c4"].restore_s > 0  # type: ignore[union-attr]  # rival evicted judge
    await bus.request(subjects.node("gpu0"), infer("b", "broken", x, incarnation=""), timeout=5)
    bad = await eventually(lambda: scheduler.outcome("b"), what="the broken call")
    assert bad.failure is ErrorKind.INVALID_REQUEST
    assert mesh.procs["gpu_manager"].returncode is None  # failing factories left it up


async def test_bad_input_on_the_node_subject_is_refused(gpu_node: tuple[Mesh, Bus, FakeScheduler]):
    _, bus, scheduler = gpu_node
    subject = subjects.node("gpu0").subject
    for junk in (b"\x00garbage", b"\x82\xa4type\xa7prepare\xa8services\x01"):
        reply = await bus.nc.request(subject, junk, timeout=5)
        assert b"invalid_request" in reply.data
    # a command's own epoch is never adopted (a forged huge one would wedge the agent) ...
    await bus.request(subjects.node("gpu0"), Prepare(services=(), epoch=1 << 60), timeout=5)
    await bus.request(subjects.node("gpu0"), Prepare(services=(), epoch=1), timeout=5)
    # ... the floor rises from the scheduler's answer to a report, and then holds
    scheduler.epoch = 5

    async def stale_refused() -> bool:
        try:
            await bus.request(subjects.node("gpu0"), Prepare(services=(), epoch=1), timeout=5)
        except InvalidRequest as exc:
            return "stale scheduler epoch" in str(exc)
        return False

    await eventually(stale_refused, what="a command of an older epoch refused")
