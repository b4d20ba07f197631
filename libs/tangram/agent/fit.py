"""Fit a completion into one message, whatever bytes the command wrote.

A backend caps each stream in raw bytes, but what travels is text: an invalid byte decodes to
a 3-byte replacement character, so 200,000 bytes of ``0xff`` become 600,000. The cut that
counts is therefore made here, after decoding, on the encoded size of the whole completion:
output beyond the budget is cut (at a character boundary) and flagged, so a completion is
never refused for its size and every action can end.
"""

from __future__ import annotations

from typing import Final

import msgspec

from tangram.contract import MAX_MESSAGE_BYTES, Completion, encode

# The bus refuses messages over MAX_MESSAGE_BYTES (itself half the broker's default 1 MiB
# max_payload); keep clear of it for headers and for whatever a later field adds.
COMPLETION_BUDGET: Final = MAX_MESSAGE_BYTES - 16 * 1024
MAX_DETAIL_CHARS: Final = 4096  # a failure's explanation, not a second output channel
_FIELD_OVERHEAD: Final = 16  # a present output field: its key and its string header


def fit_completion(c: Completion, budget: int = COMPLETION_BUDGET) -> Completion:
    """``c`` with stdout and stderr cut so that it encodes to at most ``budget`` bytes;
    a stream that lost anything here is flagged truncated."""
    o = c.outcome
    detail = o.detail[:MAX_DETAIL_CHARS]
    out, err = o.stdout.encode(), o.stderr.encode()
    bare = msgspec.structs.replace(
        o, stdout="", stderr="", detail=detail, stdout_truncated=True, stderr_truncated=True
    )
    room = budget - len(encode(msgspec.structs.replace(c, outcome=bare))) - 2 * _FIELD_OVERHEAD
    n_out, n_err = split(len(out), len(err), max(0, room))
    if (n_out, n_err) == (len(out), len(err)) and detail == o.detail:
        return c
    fitted = msgspec.structs.replace(
        o,
        detail=detail,
        stdout=cut(out, n_out),
        stderr=cut(err, n_err),
        stdout_truncated=o.stdout_truncated or n_out < len(out),
        stderr_truncated=o.stderr_truncated or n_err < len(err),
    )
    return msgspec.structs.replace(c, outcome=fitted)


def split(out: int, err: int, room: int) -> tuple[int, int]:
    """Bytes kept of each stream: all if both fit, else half each, a short one leaving its
    unused half to the other."""
    if out + err <= room:
        return out, err
    half = room // 2
    if out <= half:
        return out, room - out
    if err <= half:
        return room - err, err
    return half, room - half


def cut(data: bytes, n: int) -> str:
    """The first ``n`` bytes of UTF-8 ``data`` as text, without a character cut in half."""
    return data[:n].decode("utf-8", "ignore")
