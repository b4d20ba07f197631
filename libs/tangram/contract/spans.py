"""Finished spans as the services ship them to the dashboard's store (subject ``SPANS``).

Published fire-and-forget in batches; a lost batch loses only trace detail (the action's own
row still has its timings). Times are wall-clock seconds; ids are W3C hex.
"""

from __future__ import annotations

from typing import Annotated, Final

from msgspec import Meta

from tangram.contract.base import _Msg

MAX_SPANS: Final = 2048  # spans in one batch: ~200 bytes each, well under the message bound

Hex = Annotated[str, Meta(min_length=1, max_length=32, pattern=r"^[0-9a-f]+$")]
Text = Annotated[str, Meta(max_length=256)]


class SpanRecord(_Msg, array_like=True):
    """One finished span (array-like: the field names would double its size)."""

    trace_id: Hex
    span_id: Hex
    parent_id: Annotated[str, Meta(max_length=16, pattern=r"^[0-9a-f]*$")] = ""
    name: Text = ""
    service: Text = ""
    start: Annotated[float, Meta(ge=0)] = 0.0
    end: Annotated[float, Meta(ge=0)] = 0.0
    error: bool = False
    action_id: Annotated[str, Meta(max_length=128)] = ""


class SpanBatch(_Msg, tag="spans"):
    spans: Annotated[tuple[SpanRecord, ...], Meta(max_length=MAX_SPANS)] = ()
