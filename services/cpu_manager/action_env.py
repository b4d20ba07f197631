"""The environment variables an action sees, the same in every backend.

Tangram's own variables describe the grant and cannot be overridden: an action's ``env`` may
set any other variable (and replace a backend's base ones such as ``PATH``), but a
``TANGRAM_*`` name that Tangram sets always carries Tangram's value, so ``TANGRAM_CORES`` and
``TANGRAM_DOP`` are what the node really granted.

- ``TANGRAM_ACTION_ID``, ``TANGRAM_TRAJECTORY_ID``, ``TANGRAM_NODE_ID``
- ``TANGRAM_CORES``: the granted cores as a kernel cpulist (``0-3,8``; see ``cpulist``)
- ``TANGRAM_DOP``: how many cores were granted
"""

from __future__ import annotations

from collections.abc import Mapping

from services.cpu_manager.backend_api import ExecRequest
from services.cpu_manager.cpulist import format_cpulist


def tangram_vars(req: ExecRequest, node_id: str) -> dict[str, str]:
    """Tangram's own variables for ``req`` on node ``node_id``."""
    return {
        "TANGRAM_ACTION_ID": req.action_id,
        "TANGRAM_TRAJECTORY_ID": req.trajectory_id,
        "TANGRAM_NODE_ID": node_id,
        "TANGRAM_CORES": format_cpulist(req.cores),
        "TANGRAM_DOP": str(len(req.cores)),
    }


def action_environ(
    req: ExecRequest,
    node_id: str,
    base: Mapping[str, str] | None = None,
    tags: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """``base``, then the action's own ``env``, then Tangram's variables and a backend's
    ``tags`` (its own bookkeeping), which the action cannot override."""
    env = dict(base or {})
    env.update(req.env)
    env.update(tangram_vars(req, node_id))
    env.update(tags or {})
    return env
