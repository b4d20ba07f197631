"""What every contract module shares: the message base, the constrained scalar types, the
size bounds and the codec (encoders and decoders built once).

Rules (see STYLE.md): messages are ``kw_only`` and ``omit_defaults``; unknown fields are
allowed so that services can be rolled one at a time; a new field always gets a default and
a field never changes type. Values are constrained at decode time, so handlers only ever
see valid objects. Everything is encoded with MessagePack.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Final, TypeVar

import msgspec
from msgspec import Meta, Struct

CONTRACT_VERSION: Final = 1

# Bounds that keep one message well under NATS' default 1 MiB max_payload.
MAX_COMMAND_BYTES: Final = 64 * 1024
MAX_ARGS: Final = 4096
MAX_ENV_VARS: Final = 256
MAX_OUTPUT_CAP: Final = 256 * 1024
MAX_MESSAGE_BYTES: Final = 512 * 1024

Id = Annotated[str, Meta(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:@/-]*$")]
NodeId = Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")]
Cores = Annotated[int, Meta(ge=1, le=4096)]
PosSeconds = Annotated[float, Meta(gt=0, le=7 * 24 * 3600)]
Timestamp = Annotated[float, Meta(ge=0)]
MemoryMb = Annotated[int, Meta(ge=1, le=16 * 1024 * 1024)]
Subject = Annotated[str, Meta(min_length=1, max_length=256, pattern=r"^[A-Za-z0-9_$.>*-]+$")]


class _Msg(Struct, kw_only=True, omit_defaults=True):
    """Base of every wire message (treat as immutable: change with msgspec.structs.replace)."""


_encoder = msgspec.msgpack.Encoder()


def encode(msg: Any) -> bytes:
    """Encode any contract message."""
    return _encoder.encode(msg)


# What the items of one batch message (commands, completions, results, actions) may take
# together, encoded: half the limit, room for the message's own fields and framing.
BATCH_BYTES: Final = MAX_MESSAGE_BYTES // 2
MAX_BATCH_ITEMS: Final = 4096  # items in one batch message between services

T = TypeVar("T")


def batches(items: Sequence[T], budget: int = BATCH_BYTES) -> list[list[T]]:
    """``items`` in order, cut into runs that encode to at most ``budget`` bytes together (an
    item larger than that goes alone: it fits a message by itself)."""
    if len(items) <= 1:
        return [list(items)] if items else []
    runs: list[list[T]] = [[]]
    size = 0
    for item in items:
        n = len(encode(item))
        if runs[-1] and size + n > budget:
            runs.append([])
            size = 0
        runs[-1].append(item)
        size += n
    return runs


class Codec:
    """Decoders built once per union type."""

    def __init__(self) -> None:
        self._decoders: dict[Any, msgspec.msgpack.Decoder[Any]] = {}

    def decoder(self, typ: Any) -> msgspec.msgpack.Decoder[Any]:
        dec = self._decoders.get(typ)
        if dec is None:
            dec = self._decoders[typ] = msgspec.msgpack.Decoder(typ)
        return dec

    def decode(self, data: bytes, typ: Any) -> Any:
        """Decode ``data`` as ``typ``; raises :class:`msgspec.ValidationError`/``DecodeError``."""
        return self.decoder(typ).decode(data)


codec = Codec()
