"""Elastic degree of parallelism: fill the granted core count into an action's command (§5.2)."""

from __future__ import annotations

from collections.abc import Sequence

DOP_TOKEN = "{dop}"


def substitute_dop(argv: Sequence[str], n: int) -> tuple[str, ...]:
    """Replace every literal ``{dop}`` in ``argv`` by ``n``; other braces are left alone."""
    if n < 1:
        raise ValueError(f"dop must be at least 1, got {n}")
    text = str(n)
    return tuple(arg.replace(DOP_TOKEN, text) for arg in argv)


def wants_dop(argv: Sequence[str]) -> bool:
    """True when the command is elastic, i.e. mentions ``{dop}``."""
    return any(DOP_TOKEN in arg for arg in argv)
