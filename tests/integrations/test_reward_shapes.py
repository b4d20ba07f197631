"""The pure parts the adapters share: rewards read from a service's output, the reward
front's request and response shapes, and a command's result shown to a model."""

from __future__ import annotations

import json

import pytest

from services.reward_front import endpoints
from services.reward_front.service import _status
from tangram.contract import ActionError, ActionResult, ErrorKind
from tangram.errors import Busy, InvalidRequest, TangramError
from tangram.integrations.observation import observation
from tangram.integrations.rewards import BadReward, Reward, RewardFailed, RewardQuery, reward_of


def test_a_reward_is_a_number_or_a_dict_with_a_score():
    assert reward_of(1) == Reward(1.0)
    assert reward_of({"score": 0.5, "acc": 1}) == Reward(0.5, {"acc": 1.0})
    assert reward_of({"score": 0.5, "acc": 1}).as_verl() == {"score": 0.5, "acc": 1.0}
    for bad in ("0.5", None, {"acc": 1}, float("nan"), {"score": 1, "why": "text"}):
        with pytest.raises(BadReward):
            reward_of(bad)


def test_slime_request_becomes_one_query():
    body = json.dumps({"prompt": "2+2?", "response": "4", "label": "4"}).encode()
    assert endpoints.slime_query(body) == RewardQuery(prompt="2+2?", response="4", label="4")


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b"", "no body"),
        (b"{not json", "not JSON"),
        (b'{"prompt": "p"}', "missing required field `response`"),
        (b'{"response": 7}', "Expected `str`"),
    ],
)
def test_bad_slime_requests_say_what_is_wrong(body: bytes, says: str):
    with pytest.raises(endpoints.BadRequest, match=says):
        endpoints.slime_query(body)


def test_openrlhf_request_splits_the_response_from_its_prompt():
    body = {"query": ["Q: 2+2? A: 4", "other"], "prompts": ["Q: 2+2? A:", "x"], "labels": [4, 5]}
    queries = endpoints.openrlhf_queries(json.dumps(body).encode())
    assert [(q.prompt, q.response, q.label) for q in queries] == [
        ("Q: 2+2? A:", " 4", 4),
        ("x", "other", 5),
    ]
    with pytest.raises(endpoints.BadRequest, match="labels has 1 entries; query has 2"):
        endpoints.openrlhf_queries(json.dumps({**body, "labels": [1]}).encode())
    with pytest.raises(endpoints.BadRequest, match="length >= 1"):
        endpoints.openrlhf_queries(b'{"query": []}')


def test_openrlhf_body_logs_the_details_every_reward_has():
    found = endpoints.openrlhf_body([Reward(1.0, {"a": 1.0, "b": 2.0}), Reward(0.0, {"a": 0.0})])
    assert found == {"rewards": [1.0, 0.0], "scores": [1.0, 0.0], "extra_logs": {"a": [1.0, 0.0]}}


def test_observation_says_how_a_command_ended():
    ok = ActionResult(action_id="a", status="succeeded", exit_code=0, stdout="hi\n")
    assert observation(ok) == "hi\n[exit code 0]"
    failed = ActionResult(action_id="b", status="failed", exit_code=2, stderr="no such file")
    assert observation(failed) == "no such file\n[exit code 2]"
    lost = ActionResult(
        action_id="c",
        status="failed",
        error=ActionError(kind=ErrorKind.ENVIRONMENT_LOST, message="node gone"),
    )
    assert observation(lost) == "[not run to the end: environment_lost: node gone]"


def _failed(kind: ErrorKind, message: str = "") -> RewardFailed:
    error = ActionError(kind=kind, message=message)
    return RewardFailed(ActionResult(action_id="r", status="failed", error=error))


@pytest.mark.parametrize(
    ("exc", "status"),
    [
        (_failed(ErrorKind.INVALID_REQUEST, "unknown service 'x'; registered: y"), (404, None)),
        (_failed(ErrorKind.NODE_DIED), (503, 1.0)),  # the mesh's failure: retry
        (_failed(ErrorKind.COMMAND_FAILED), (502, None)),  # the reward handle raised
        (BadReward("not a reward"), (502, None)),
        (Busy("full", retry_after_s=2.5), (503, 2.5)),
        (InvalidRequest("bad"), (400, None)),
    ],
)
def test_mesh_failures_map_to_http_statuses(exc: TangramError, status: tuple[int, float | None]):
    assert _status(exc) == status
    assert _failed(ErrorKind.NODE_DIED).retryable
