"""The paper's Kubernetes baseline for AI coding (§6.1), as a simulator engine.

Each trajectory creates a pod at its first action that *requests* ``request`` cores and may burst
to ``limit`` cores; the pod lives until the trajectory ends. Pods are bound to the node with the
most unrequested cores (kube-scheduler's least-allocated score) and stay Pending, FCFS, while no
node has ``request`` cores unrequested. Inside a node the kernel shares the cores (CFS): every
running action asks for ``min(threads, limit)`` cores, where ``threads`` is the DoP it runs with
(its largest allowed amount, capped by the limit), and the cores are water-filled among them
with equal weights (equal requests, equal shares). An action's speed on ``c`` cores follows the
same Amdahl model as everywhere else, and a single thread on ``c < 1`` cores runs at ``c``.

Because the shares change whenever an action starts or ends on a node, completion times are
fluid: ``due`` tells the simulator the current finish time of every action whose node changed.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from services.scheduler.sim.engines import SimAction, Started

EPS = 1e-12


@dataclass(frozen=True, slots=True)
class KubeConfig:
    request: float = 0.5  # cores a pod requests: what placement accounts
    limit: float = 4.0  # cores a pod may use at most (its CFS quota)
    pod_start_s: float = 0.0  # pod creation latency before the first action can run

    @staticmethod
    def parse(spec: str) -> KubeConfig:
        """``kubernetes`` or ``kubernetes:REQUEST:LIMIT`` (cores, may be fractional)."""
        _, _, args = spec.partition(":")
        if not args:
            return KubeConfig()
        request, _, limit = args.partition(":")
        try:
            cfg = KubeConfig(float(request), float(limit or request))
        except ValueError as exc:
            raise ValueError(f"bad kubernetes spec {spec!r}: {exc}") from exc
        if not 0.0 < cfg.request <= cfg.limit:
            raise ValueError(f"bad kubernetes spec {spec!r}: need 0 < request <= limit")
        return cfg


@dataclass(slots=True)
class _Run:
    """One action running in a pod: the work left as a fraction and its current speed."""

    action: SimAction
    threads: float
    left: float = 1.0
    rate: float = 0.0  # fraction of the work per second at the current share


@dataclass(slots=True)
class _Node:
    capacity: float
    requested: float = 0.0
    runs: dict[str, _Run] = field(default_factory=dict)
    clock: float = 0.0
    changed: bool = False


def speed(step_t_ori: float, p: float, cores: float) -> float:
    """Fraction of an action's work done per second on ``cores`` (Amdahl; time-sliced below 1)."""
    if cores < 1.0:
        return cores / step_t_ori
    return 1.0 / (step_t_ori * ((1.0 - p) + p / cores))


def water_fill(demands: list[float], capacity: float) -> list[float]:
    """Max-min fair shares of ``capacity`` among ``demands`` with equal weights."""
    out = [0.0] * len(demands)
    left, todo = capacity, sorted(range(len(demands)), key=lambda i: demands[i])
    for k, i in enumerate(todo):
        share = left / (len(todo) - k)
        out[i] = min(demands[i], share)
        left -= out[i]
    return out


class KubeEngine:
    """CPU nodes run as Kubernetes would run a pod per trajectory (see the module docstring)."""

    def __init__(self, cfg: KubeConfig, nodes: int, cores: int) -> None:
        self.cfg = cfg
        self._nodes = [_Node(float(cores)) for _ in range(nodes)]
        self._pod: dict[str, int] = {}  # trajectory -> node
        self._ready_at: dict[str, float] = {}  # trajectory -> when its pod can run actions
        self._pending: deque[str] = deque()  # trajectories whose pod waits for room, FCFS
        self._waiting: list[SimAction] = []
        self._where: dict[str, int] = {}  # running action -> node

    def submit(self, a: SimAction, now: float) -> None:
        if a.trajectory_id not in self._pod and a.trajectory_id not in self._pending:
            self._pending.append(a.trajectory_id)
        self._waiting.append(a)

    def schedule(self, now: float) -> list[Started]:
        self._bind_pods(now)
        started: list[Started] = []
        still: list[SimAction] = []
        for a in self._waiting:
            ready = self._ready_at.get(a.trajectory_id)
            if ready is None or ready > now:
                still.append(a)
                continue
            started.append(self._start(a, now))
        self._waiting = still
        return started

    def wake_at(self) -> float | None:
        """The next time a pod becomes ready while actions wait for it (pod start latency)."""
        times = [
            self._ready_at[a.trajectory_id]
            for a in self._waiting
            if a.trajectory_id in self._ready_at
        ]
        return min(times, default=None)

    def _bind_pods(self, now: float) -> None:
        while self._pending:
            n = max(range(len(self._nodes)), key=lambda i: (self._free_request(i), -i))
            if self._free_request(n) < self.cfg.request - EPS:
                return  # Pending: FCFS, nothing behind the head binds either
            tid = self._pending.popleft()
            self._pod[tid] = n
            self._nodes[n].requested += self.cfg.request
            self._ready_at[tid] = now + self.cfg.pod_start_s

    def _free_request(self, n: int) -> float:
        node = self._nodes[n]
        return node.capacity - node.requested

    def _start(self, a: SimAction, now: float) -> Started:
        n = self._pod[a.trajectory_id]
        node = self._nodes[n]
        self._advance(node, now)
        threads = min(float(a.step.choices[-1]), self.cfg.limit)
        node.runs[a.action_id] = _Run(a, threads)
        node.changed = True
        self._where[a.action_id] = n
        return a.action_id, max(1, round(threads))

    def complete(self, action_id: str, now: float) -> None:
        node = self._nodes[self._where.pop(action_id)]
        self._advance(node, now)
        del node.runs[action_id]
        node.changed = True

    def close(self, trajectory_id: str, now: float) -> None:
        n = self._pod.pop(trajectory_id, None)
        self._ready_at.pop(trajectory_id, None)
        if n is not None:
            self._nodes[n].requested -= self.cfg.request

    def due(self, now: float) -> dict[str, float]:
        """Finish times of the actions on every node whose sharing changed since the last call."""
        out: dict[str, float] = {}
        for node in self._nodes:
            if not node.changed:
                continue
            node.changed = False
            self._advance(node, now)
            self._share(node)
            for aid, run in node.runs.items():
                out[aid] = now + max(run.left, 0.0) / run.rate
        return out

    def _advance(self, node: _Node, now: float) -> None:
        dt = now - node.clock
        if dt > 0.0:
            for run in node.runs.values():
                run.left -= run.rate * dt
        node.clock = now

    def _share(self, node: _Node) -> None:
        runs = list(node.runs.values())
        shares = water_fill([r.threads for r in runs], node.capacity)
        for run, cores in zip(runs, shares, strict=True):
            step = run.action.step
            run.rate = speed(step.t_ori_s, step.parallel_fraction, cores)
