"""Scheduler → one GPU node: prefetch hints (plexrl §4.5.1).

The scheduler sees what is queued; it names the services (and DoP variants) its next grants on
a node will need, most urgent first, and the node promotes them disk → host → device ahead of
the calls. A hint is advice, sent without waiting for a reply: a node that does not know a name
answers an error (when asked) and prefetches the others. Bounded at decode time.
"""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta

from tangram.contract.base import _Msg
from tangram.contract.resources import Dop, ServiceName

MAX_PREFETCH = 64  # services in one hint: more than a node's next grants can use


class PrefetchItem(_Msg):
    """One service variant a node's next grants will need."""

    name: ServiceName
    dop: Dop = 1


class Prefetch(_Msg, tag="prefetch"):
    """The services a node's next grants will need, most urgent first."""

    services: Annotated[tuple[PrefetchItem, ...], Meta(max_length=MAX_PREFETCH)]
    epoch: Annotated[int, Meta(ge=0)] = 0
