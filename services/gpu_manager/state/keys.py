"""Logical keys of tensors: a hash of their bytes, so equal tensors share one key and a changed
tensor never aliases the old one (the key is all a tier knows a tensor by)."""

from __future__ import annotations

import hashlib
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where used: the disk store's writer starts without it
    import torch

KEY_RE = re.compile(r"^[0-9a-f]{40}$")
_HASH_CHUNK = 16 << 20  # bytes hashed per update: bounds the temporary view, not the speed


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as a flat uint8 CPU tensor (a view when it is contiguous already)."""
    import torch

    flat = t.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)


def key_of(data: torch.Tensor) -> str:
    """The key of a flat uint8 tensor: BLAKE2b-160 of its bytes, in hex."""
    h = hashlib.blake2b(digest_size=20)
    view = data.numpy()
    for start in range(0, len(view), _HASH_CHUNK):
        h.update(view[start : start + _HASH_CHUNK].data)
    return h.hexdigest()


def is_key(text: str) -> bool:
    return KEY_RE.match(text) is not None
