"""A completion fits one message whatever the command wrote: output is cut after decoding,
at a character boundary, and flagged (issue 17: 0xff bytes tripled past the bus limit)."""

from __future__ import annotations

import pytest

from services.cpu_manager.backend_api import ExecOutcome
from services.cpu_manager.outcome import to_outcome
from tangram.agent.fit import COMPLETION_BUDGET, MAX_DETAIL_CHARS, cut, fit_completion, split
from tangram.contract import MAX_MESSAGE_BYTES, MAX_OUTPUT_CAP, Completion, Outcome, encode


def completion(outcome: Outcome) -> Completion:
    return Completion(
        node_id="n0", incarnation="i" * 32, action_id="a" * 128, attempt=3, outcome=outcome
    )


def raw(stdout: bytes, stderr: bytes = b"", truncated: bool = False) -> Completion:
    """As the CPU agent builds it: a backend's capped bytes, decoded with replacement."""
    out = ExecOutcome(0, stdout, stderr, truncated, truncated, 1.0, 2.0)
    return completion(to_outcome(out))


def test_a_small_completion_is_left_alone():
    c = raw(b"hello", b"world")
    assert fit_completion(c) is c


def test_invalid_bytes_that_triple_when_decoded_still_fit():
    c = raw(b"\xff" * 200_000)
    assert len(encode(c)) > MAX_MESSAGE_BYTES  # the 600 KB completion
    fitted = fit_completion(c)
    assert len(encode(fitted)) <= COMPLETION_BUDGET < MAX_MESSAGE_BYTES
    assert fitted.outcome.stdout_truncated
    assert not fitted.outcome.stderr_truncated
    assert set(fitted.outcome.stdout) == {"\ufffd"}
    assert len(fitted.outcome.stdout) > 150_000  # it keeps what fits, not a token amount


@pytest.mark.parametrize("byte", [b"a", b"\xff"])
def test_both_streams_at_the_largest_cap_fit(byte: bytes):
    c = raw(byte * MAX_OUTPUT_CAP, byte * MAX_OUTPUT_CAP)
    fitted = fit_completion(c)
    size = len(encode(fitted))
    assert COMPLETION_BUDGET - 64 <= size <= COMPLETION_BUDGET  # all the room is used
    o = fitted.outcome
    assert o.stdout_truncated
    assert o.stderr_truncated
    assert abs(len(o.stdout.encode()) - len(o.stderr.encode())) <= 3  # shared evenly
    assert (o.exit_code, o.started_at, o.finished_at) == (0, 1.0, 2.0)


def test_a_multibyte_character_is_never_cut_in_half():
    assert cut("€€".encode(), 4) == "€"
    assert cut("€€".encode(), 3) == "€"
    assert cut("€€".encode(), 2) == ""
    euros = completion(Outcome(stdout="€" * 300_000))  # 900 KB of 3-byte characters
    for budget in (COMPLETION_BUDGET, COMPLETION_BUDGET - 1, COMPLETION_BUDGET - 2):
        fitted = fit_completion(euros, budget)
        assert len(encode(fitted)) <= budget
        assert set(fitted.outcome.stdout) == {"€"}
        assert fitted.outcome.stdout_truncated


def test_a_short_stream_leaves_its_room_to_the_other():
    assert split(10, 10, 100) == (10, 10)
    assert split(10, 500, 100) == (10, 90)
    assert split(500, 10, 100) == (90, 10)
    assert split(500, 500, 100) == (50, 50)
    c = raw(b"x" * 600_000, b"short")
    o = fit_completion(c).outcome
    assert (o.stderr, o.stderr_truncated, o.stdout_truncated) == ("short", False, True)


def test_a_truncation_flag_from_the_backend_stays():
    o = fit_completion(raw(b"ok", truncated=True)).outcome
    assert (o.stdout, o.stdout_truncated, o.stderr_truncated) == ("ok", True, True)


def test_a_long_failure_detail_is_bounded():
    c = completion(Outcome(detail="d" * 100_000, stdout="x" * 600_000))
    o = fit_completion(c).outcome
    assert len(o.detail) == MAX_DETAIL_CHARS
    assert len(encode(fit_completion(c))) <= COMPLETION_BUDGET
