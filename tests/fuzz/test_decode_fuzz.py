"""Random bytes, random msgpack values and deep nesting never get past the bus's decoding as
anything but a decoded request or a typed ``invalid_request`` reply: no exception escapes."""

from __future__ import annotations

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from tangram.bus import MAX_NESTING, decode_request, too_deep
from tangram.contract import ErrorReply, GatewayRequest, NodeCommand, NodeMessage, SchedulerRequest

UNIONS = [GatewayRequest, SchedulerRequest, NodeMessage, NodeCommand]
values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(
            st.sampled_from(["type", "spec", "action_id", "kind", "cpus", "x"]), inner, max_size=5
        )
    ),
    max_leaves=20,
)


def decodes_or_refuses(data: bytes, union: object) -> None:
    out = decode_request(data, union)
    if isinstance(out, ErrorReply):
        assert out.code == "invalid_request"
        assert out.message


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200), st.sampled_from(UNIONS))
def test_random_bytes(data: bytes, union: object):
    decodes_or_refuses(data, union)


@settings(max_examples=300, deadline=None)
@given(values, st.sampled_from(UNIONS))
def test_random_structures(value: object, union: object):
    decodes_or_refuses(msgspec.msgpack.encode(value), union)


def nest(depth: int, kinds: list[bool]) -> bytes:
    """``depth`` containers, each an array (True) or a one-key map (False), around a 1."""
    out = b""
    for i in range(depth):
        out += b"\x91" if kinds[i % len(kinds)] else b"\x81\xa1k"
    return out + b"\x01"


@settings(max_examples=200, deadline=None)
@given(
    st.integers(0, 3000),
    st.lists(st.booleans(), min_size=1, max_size=4),
    st.sampled_from(UNIONS),
    st.sampled_from(["get_result", "submit", "completion", "dispatch", "status", "nope"]),
)
def test_deep_nesting_anywhere_gets_a_typed_refusal(
    depth: int, kinds: list[bool], union: object, tag: str
):
    inner = nest(depth, kinds)
    # As an unknown field (msgspec skips it, recursing), as a known one, and as the whole body.
    head = b"\x83\xa4type" + msgspec.msgpack.encode(tag) + b"\xa9action_id\xa1x"
    known = b"\x82" + head[1:].replace(b"\xa1x", inner)
    for data in (head + b"\xa2zz" + inner, known, inner):
        out = decode_request(data, union)
        if depth > MAX_NESTING + 1:
            assert isinstance(out, ErrorReply), out
            assert out.code == "invalid_request"
            assert "nested" in out.message
        else:
            decodes_or_refuses(data, union)


@settings(max_examples=300, deadline=None)
@given(values)
def test_the_depth_scan_agrees_with_the_value(value: object):
    data = msgspec.msgpack.encode(value)
    assert too_deep(data, limit=2) == (_depth(value) > 2)


def _depth(value: object) -> int:
    if isinstance(value, list) and value:
        return 1 + max(_depth(v) for v in value)
    if isinstance(value, dict) and value:
        return 1 + max(_depth(v) for v in value.values())
    return 0


def test_a_huge_bad_value_is_not_echoed_whole() -> None:
    # msgspec quotes the offending value: a 500 KB tag came back whole in the error reply (an
    # amplifier, and near the broker's payload limit; review R3)
    tag = "x" * 500_000
    out = decode_request(msgspec.msgpack.encode({"type": tag}), GatewayRequest)
    assert isinstance(out, ErrorReply)
    assert out.code == "invalid_request"
    assert "malformed message" in out.message
    assert len(out.message) < 1_000, len(out.message)
