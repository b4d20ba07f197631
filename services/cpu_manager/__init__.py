"""The CPU node agent (cpu_manager): runs actions pinned to the cores the scheduler granted.

``service.py`` is the agent on the shared agent runtime (``tangram.agent``); ``backend_api`` is
the interface it drives, ``choice`` picks a backend: ``docker/`` (isolating, per-trajectory
containers) or ``process/`` (plain subprocesses, no isolation). What both backends share lives
here: the core-list format (``cpulist``), the action's variables (``action_env``), how a
program that cannot start is reported (``spawn_failure``), NUMA reading (``numa``), the
node's inventory, ``{dop}`` substitution and the config (``config``, Docker's nested in it).
"""
