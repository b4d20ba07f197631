"""Formulation (§4.1): valid specs become cost vectors; invalid ones name their problem."""

from __future__ import annotations

import pytest

from services.gateway.formulation import (
    CPU,
    Limits,
    check_reply_subject,
    formulate,
)
from tangram.bus import MAX_VALUE_NESTING
from tangram.contract import ActionSpec, ExecAction, InferAction
from tangram.errors import InvalidRequest

RESULTS = "tangram.v1.results.c1"


def spec(command: str | list[str] = "true", **kw: object) -> ActionSpec:
    env = kw.pop("env", {})
    return ActionSpec(
        action_id="a",
        job_id="j",
        trajectory_id="t",
        action=ExecAction(command=command, env=env),
        **kw,
    )  # type: ignore[arg-type]


def test_cost_vector_ranges_and_key_resource():
    act = formulate(
        spec(cpus=[2, 5], memory_mb=300),
        now=7.0,
        limits=Limits(),
        reply_subject=RESULTS,
        traceparent="tp",
    )
    assert act.key_resource == CPU
    assert act.demands[0].choices == (2, 3, 4, 5)
    assert (act.demands[0].min, act.demands[0].max) == (2, 5)
    assert act.env_memory_mb == 300
    assert (act.submitted_at, act.reply_subject, act.traceparent) == (7.0, RESULTS, "tp")
    assert formulate(spec(cpus=3), now=0, limits=Limits()).demands[0].choices == (3,)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"command": ""}, "empty command"),
        ({"command": "   "}, "empty command"),
        ({"command": []}, "empty command"),
        ({"command": [""]}, "empty command"),
        ({"command": "echo \x00"}, "NUL"),
        ({"cpus": [4, 2]}, "min > max"),
        ({"cpus": 9}, "limit of 8 cores"),
        ({"memory_mb": 5000}, "limit of 4096 MiB"),
        ({"env": {"A=B": "1"}}, "A=B"),
        ({"env": {"": "1"}}, "environment variable"),
    ],
)
def test_invalid_specs_name_the_problem(kw: dict, message: str):
    with pytest.raises(InvalidRequest, match=message):
        formulate(spec(**kw), now=0, limits=Limits(max_cpus=8, max_memory_mb=4096))


@pytest.mark.parametrize(
    "subject",
    ["", "tangram.v1.results.c1", "tangram.v1.results.client-default.abc123"],
)
def test_a_reply_subject_under_the_results_prefix_is_taken(subject: str):
    assert formulate(spec(), now=0, limits=Limits(), reply_subject=subject).reply_subject == subject


@pytest.mark.parametrize(
    "subject",
    [
        "tangram.v1.sched.actions",  # the scheduler's own intake
        "tangram.v1.node.node0",  # a node agent's commands
        "tangram.v1.gateway",
        "_r.x",
        "_INBOX_gateway.abc",
        "tangram.v1.results",  # the prefix alone
        "tangram.v1.resultsX.c1",
        "tangram.v1.results.>",
        "tangram.v1.results.*.c1",
        "tangram.v1.results..c1",
        "tangram.v1.results.c1.",
    ],
)
def test_a_reply_subject_outside_the_results_prefix_is_refused(subject: str):
    with pytest.raises(InvalidRequest, match=r"reply_subject .* tangram\.v1\.results\.<id>"):
        formulate(spec(), now=0, limits=Limits(), reply_subject=subject)
    with pytest.raises(InvalidRequest):
        check_reply_subject(subject)


def test_an_infer_payload_nested_deeper_than_a_dispatch_carries_is_refused():
    # Accepted, a payload 29 deep rode in a dispatch past the bus's nesting limit: the node
    # refused that dispatch at every resend and the call never ran nor ended (review R2).
    def nested(depth: int) -> object:
        value: object = 1
        for _ in range(depth):
            value = [value]
        return value

    def spec(depth: int) -> ActionSpec:
        action = InferAction(service="judge", payload=nested(depth))
        return ActionSpec(action_id="a", job_id="j", trajectory_id="", action=action)

    formulate(spec(MAX_VALUE_NESTING), now=0.0, limits=Limits())
    with pytest.raises(InvalidRequest, match="payload nests containers deeper"):
        formulate(spec(MAX_VALUE_NESTING + 1), now=0.0, limits=Limits())
