"""A policy's name as data: parsed and checked without building the policy (which for the
elastic policies means compiling their kernels), then built where it is used."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.scheduler.policies.base import MinPolicy, Policy

if TYPE_CHECKING:
    from services.scheduler.policies.durations import DurationLearner

POLICY_SPECS = ("min", "elastic", "elastic:DEPTH", "fixed-dop:K", "trajectory-static:K")
KNOWN = ", ".join(POLICY_SPECS)


class Kind(enum.StrEnum):
    MIN = "min"
    ELASTIC = "elastic"
    FIXED_DOP = "fixed-dop"
    TRAJECTORY_STATIC = "trajectory-static"


# kind -> (its argument when none is given, None when one is required; what it must be)
_ARGS: dict[Kind, tuple[int | None, str]] = {
    Kind.ELASTIC: (2, "the elastic depth must be ≥ 1"),
    Kind.FIXED_DOP: (None, "fixed DoP must be ≥ 1"),
    Kind.TRAJECTORY_STATIC: (1, "a trajectory reservation must be ≥ 1 unit"),
}


@dataclass(frozen=True, slots=True)
class PolicySpec:
    """A valid policy name: its kind and its argument (elastic depth, DoP, reservation)."""

    kind: Kind
    arg: int = 0


def parse_policy(text: str) -> PolicySpec:
    """``text`` (one of ``POLICY_SPECS``) as data; a ValueError naming the problem if bad."""
    name, colon, arg = text.partition(":")
    try:
        kind = Kind(name)
    except ValueError:
        kind = None
    if kind is None or (kind is Kind.MIN and colon):
        raise ValueError(f"unknown scheduling policy {text!r}; known: {KNOWN}")
    if kind is Kind.MIN:
        return PolicySpec(kind)
    default, rule = _ARGS[kind]
    try:
        value = int(arg) if arg or default is None else default
    except ValueError as exc:
        raise ValueError(f"bad scheduling policy {text!r}: {exc}; known: {KNOWN}") from exc
    if value < 1:
        raise ValueError(f"bad scheduling policy {text!r}: {rule}; known: {KNOWN}")
    return PolicySpec(kind, value)


def make_policy(spec: PolicySpec | str, learner: DurationLearner | None = None) -> Policy:
    """Build a policy from its spec (or its name, parsed first).

    Stateful policies (trajectory-static) need one instance per pool, which the scheduler core
    builds with their ``for_pool``; ``learner`` lets the elastic policies of all pools share
    what they learn per profile.
    """
    # imported here: the elastic kernels compile, and config checks names without them
    from services.scheduler.policies.elastic import ElasticPolicy
    from services.scheduler.policies.fixed import FixedDopPolicy
    from services.scheduler.policies.static import TrajectoryStaticPolicy

    spec = parse_policy(spec) if isinstance(spec, str) else spec
    match spec.kind:
        case Kind.MIN:
            return MinPolicy()
        case Kind.ELASTIC:
            return ElasticPolicy(depth=spec.arg, learner=learner)
        case Kind.FIXED_DOP:
            return FixedDopPolicy(spec.arg)
        case Kind.TRAJECTORY_STATIC:
            return TrajectoryStaticPolicy(spec.arg)
