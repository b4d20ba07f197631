"""Random bytes and random msgpack values never get past decoding as anything but a typed error."""

from __future__ import annotations

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from tangram.contract import GatewayRequest, NodeCommand, NodeMessage, SchedulerRequest, codec

UNIONS = [GatewayRequest, SchedulerRequest, NodeMessage, NodeCommand]
values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(
            st.sampled_from(["type", "spec", "action_id", "kind", "cpus", "x"]), inner, max_size=5
        )
    ),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200), st.sampled_from(UNIONS))
def test_random_bytes(data: bytes, union: object):
    try:
        codec.decode(data, union)
    except (msgspec.DecodeError, msgspec.ValidationError):
        pass


@settings(max_examples=300, deadline=None)
@given(values, st.sampled_from(UNIONS))
def test_random_structures(value: object, union: object):
    try:
        codec.decode(msgspec.msgpack.encode(value), union)
    except (msgspec.DecodeError, msgspec.ValidationError):
        pass
