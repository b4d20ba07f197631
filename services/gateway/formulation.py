"""Turn a client's ActionSpec into the unified action of §4.1, or say exactly what is wrong.

Pure: no I/O. Decoding already enforced types and bounds; this checks what a schema cannot
(min ≤ max, an empty command, the cluster's limits) and builds the cost vector.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from services.gateway.quota_formulation import formulate_quota, quota_of
from tangram import subjects
from tangram.bus import MAX_VALUE_NESTING, too_deep
from tangram.contract import (
    ActionSpec,
    Demand,
    ExecAction,
    InferAction,
    QuotaSpec,
    UnifiedAction,
    encode,
    kind_of,
)
from tangram.errors import InvalidRequest, clipped

CPU = "cpu"
GPU = "gpu"


@dataclass(frozen=True, slots=True)
class Limits:
    """What one action may ask for at most in this deployment."""

    max_cpus: int = 256
    max_memory_mb: int = 256 * 1024


def cpu_choices(cpus: int | list[int], limits: Limits) -> tuple[int, ...]:
    """The allowed core counts of a ``cpus`` demand (an int, or an inclusive [min, max])."""
    lo, hi = (cpus, cpus) if isinstance(cpus, int) else (cpus[0], cpus[1])
    if lo > hi:
        raise InvalidRequest(f"cpus range ({lo}, {hi}) has min > max", hint="use (min, max)")
    if hi > limits.max_cpus:
        raise InvalidRequest(
            f"cpus={hi} exceeds this mesh's limit of {limits.max_cpus} cores per action"
        )
    return tuple(range(lo, hi + 1))


def check_exec(action: ExecAction) -> None:
    """Reject commands that cannot run: empty, or with NUL bytes; bad environment names."""
    cmd = action.command
    parts = [cmd] if isinstance(cmd, str) else cmd
    if not parts or not parts[0].strip():
        raise InvalidRequest("empty command", hint="give a shell string or a non-empty argv list")
    if any("\x00" in p for p in parts):
        raise InvalidRequest("command contains a NUL byte")
    for name, value in action.env.items():
        if not name or "=" in name or "\x00" in name or "\x00" in value:
            # cut: a name of 300 KB of control characters, quoted whole, made the reply too
            # big for the broker (no answer at all)
            why = clipped(repr(name), 64)
            raise InvalidRequest(f"invalid environment variable name or value: {why}")


def check_reply_subject(subject: str, owner: str = "") -> None:
    """A client names where its results are pushed, and the scheduler publishes there with
    the rights of the mesh: so only a literal subject under the results prefix, where the
    broker lets a client read its own (``tangram.v1.results.<id>[.<more>]``, see
    ``tangram.auth``), never a subject the services listen on. A request of the client
    credential ``owner`` names a subject under its own results id alone
    (``tangram.v1.results.<owner>.<more>``): one client must not have its results pushed to
    another. Empty: no push wanted."""
    if not subject:
        return
    base = subjects.results(owner) if owner else subjects.RESULTS_PREFIX
    prefix = base.split(".")
    tokens = subject.split(".")
    under = tokens[: len(prefix)] == prefix and len(tokens) > len(prefix)
    if not under or not all(tokens) or "*" in subject or ">" in subject:
        raise InvalidRequest(
            f"reply_subject {subject!r} is refused: results are pushed only to a subject"
            f" {base}.<{'more' if owner else 'id'}>[.<more>] (no wildcards, no empty tokens)",
            hint="leave reply_subject unset, or use the one the client library names",
        )


def formulate(
    spec: ActionSpec,
    *,
    now: float,
    limits: Limits,
    reply_subject: str = "",
    traceparent: str = "",
    quotas: Mapping[str, QuotaSpec] | None = None,
    owner: str = "",
) -> UnifiedAction:
    """Validate ``spec`` and build its unified action (cost vector, key resource); http and
    lease actions against the declared ``quotas``. ``owner``: the client credential asking
    ("": the operator's door, or a mesh without auth)."""
    check_reply_subject(reply_subject, owner)
    if quota_of(spec) is not None:
        return formulate_quota(
            spec, quotas or {}, now=now, reply_subject=reply_subject, traceparent=traceparent
        )
    if isinstance(spec.action, InferAction):
        return formulate_infer(spec, now=now, reply_subject=reply_subject, traceparent=traceparent)
    if not isinstance(spec.action, ExecAction):
        raise InvalidRequest(f"{kind_of(spec.action)} actions are not served by this mesh yet")
    if not spec.trajectory_id:
        raise InvalidRequest("an exec action needs a trajectory_id (its environment)")
    check_exec(spec.action)
    if spec.memory_mb > limits.max_memory_mb:
        raise InvalidRequest(
            f"memory_mb={spec.memory_mb} exceeds this mesh's limit of {limits.max_memory_mb} MiB"
        )
    demands = (Demand(resource=CPU, choices=cpu_choices(spec.cpus, limits)),)
    return UnifiedAction(
        spec=spec,
        demands=demands,
        key_resource=CPU,
        env_memory_mb=spec.memory_mb,
        submitted_at=now,
        reply_subject=reply_subject,
        traceparent=traceparent,
    )


def formulate_infer(
    spec: ActionSpec, *, now: float, reply_subject: str = "", traceparent: str = ""
) -> UnifiedAction:
    """An infer action: GPUs of a chunk size the scheduler chooses among the service's DoPs
    (``choices`` empty: the scheduler knows the services; it fails an unknown one naming the
    registered ones). It needs no environment, so ``trajectory_id`` may be empty. Its
    payload may nest only as deep as the dispatch carrying it to a node allows (deeper, the
    node's bus refused that dispatch at every resend: the call never ran nor ended)."""
    action = spec.action
    if isinstance(action, InferAction) and too_deep(encode(action.payload), MAX_VALUE_NESTING):
        raise InvalidRequest(f"payload nests containers deeper than {MAX_VALUE_NESTING} levels")
    return UnifiedAction(
        spec=spec,
        demands=(Demand(resource=GPU, choices=()),),
        key_resource=GPU,
        env_memory_mb=0,
        submitted_at=now,
        reply_subject=reply_subject,
        traceparent=traceparent,
    )
