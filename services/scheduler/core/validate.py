"""What the scheduler checks of an action handed to it from inside the mesh (pure).

Decoding already bounds every field (``tangram.contract``); these are the rules that span
fields, which a gateway of another version, a bug or a forged message could break. An action
that breaks one is refused with an error that names the rule, never queued: a queued action
the core cannot read would take the scheduler down at its first pass.
"""

from __future__ import annotations

from tangram.contract import UnifiedAction

GPU = "gpu"  # a GPU call's demand lists no choices: the scheduler picks its chunk
CPU = "cpu"


def problem(action: UnifiedAction) -> str | None:
    """Why the scheduler cannot queue ``action`` (None: it can)."""
    aid = action.spec.action_id
    if not action.demands:
        return f"action {aid}: no demands (its cost vector is empty)"
    if action.env_memory_mb < 0:
        return f"action {aid}: env_memory_mb {action.env_memory_mb} is negative"
    if action.attempt < 0:
        return f"action {aid}: attempt {action.attempt} is negative"
    if action.demands[0].resource != action.key_resource:
        return f"action {aid}: its first demand is not its key resource {action.key_resource!r}"
    for d in action.demands:
        if not d.choices and d.resource != GPU:
            return f"action {aid}: demand for {d.resource!r} offers no choices"
        if d.resource == CPU and d.choices and d.choices[0] < 1:
            return f"action {aid}: it asks for {d.choices[0]} cores"
        if list(d.choices) != sorted(set(d.choices)):
            return f"action {aid}: the choices for {d.resource!r} are not sorted and unique"
    return None
