"""The node-agent runtime: the agent half of the scheduler <-> agent protocol, shared by every
kind of node agent (CPU today; GPU and quota next).

- :mod:`~tangram.agent.core`: the pure core (fencing, duplicates, overlap, outbox, env TTL,
  progress, drain and goodbye); every method takes ``now`` and returns effects.
- :mod:`~tangram.agent.shell`: :class:`Agent`, the async shell (bus, loops, owned tasks), and
  the :class:`Executor` protocol a kind of agent implements.
- :mod:`~tangram.agent.fit`: a completion cut to fit one message, output flagged truncated.
- :mod:`~tangram.agent.starts`: the executor's launches (the start phase the detector watches).
"""

from tangram.agent.core import AgentConfig, AgentCore, with_kill_reason
from tangram.agent.fit import COMPLETION_BUDGET, fit_completion
from tangram.agent.shell import Agent, Canaries, Executor, Prepares, Reports
from tangram.agent.starts import Launch, Launches, Starts

__all__ = [
    "COMPLETION_BUDGET",
    "Agent",
    "AgentConfig",
    "AgentCore",
    "Canaries",
    "Executor",
    "Launch",
    "Launches",
    "Prepares",
    "Reports",
    "Starts",
    "fit_completion",
    "with_kill_reason",
]
