"""The node-agent runtime: the agent half of the scheduler <-> agent protocol, shared by every
kind of node agent (CPU today; GPU and quota next).

- :mod:`~tangram.agent.core`: the pure core (fencing, duplicates, overlap, outbox, env TTL,
  progress, drain and goodbye); every method takes ``now`` and returns effects.
- :mod:`~tangram.agent.shell`: :class:`Agent`, the async shell (bus, loops, owned tasks), and
  the :class:`Executor` protocol a kind of agent implements.
- :mod:`~tangram.agent.fit`: a completion cut to fit one message, output flagged truncated.
"""

from tangram.agent.core import AgentConfig, AgentCore, with_kill_reason
from tangram.agent.fit import COMPLETION_BUDGET, fit_completion
from tangram.agent.shell import Agent, Executor, Prepares, Reports

__all__ = [
    "COMPLETION_BUDGET",
    "Agent",
    "AgentConfig",
    "AgentCore",
    "Executor",
    "Prepares",
    "Reports",
    "fit_completion",
    "with_kill_reason",
]
