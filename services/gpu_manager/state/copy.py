"""A service's state as keyed tensors: the layout of its device arena (as ``host_copy``) and,
per entry, the key of the bytes that fill it. The bytes live in the StateManager's tiers,
shared with every service holding an equal tensor; the model is kept as a ``meta`` skeleton.

A restore copies each entry's host bytes into its place in one device arena (so the device
side is the same as a ``HostCopy``'s: one arena per resident copy, evicted without write-back).
The caller makes sure the keys are in host memory and pinned for the copy (``manager``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from services.gpu_manager.host_copy import (
    Layout,
    Rebuild,
    Resident,
    _collect,
    _place,
    _rebound_meta,
    restore_sliced,
)
from services.gpu_manager.state.keys import key_of, raw_bytes


@dataclass(frozen=True, slots=True)
class Captured:
    """A model taken apart: its layout, each entry's bytes and key, its ``meta`` skeleton."""

    layout: Layout
    keys: tuple[str, ...]
    data: tuple[torch.Tensor, ...]  # flat uint8, in entry order (dropped once stored)
    skeleton: torch.nn.Module


def capture(model: torch.nn.Module) -> Captured:
    """Hash every distinct tensor of ``model``'s state; the model is moved to ``meta``."""
    tensors, bindings = _collect(model)
    layout = _place(tensors, bindings)
    data = tuple(raw_bytes(t) for _, t, _ in tensors)
    keys = tuple(key_of(d) for d in data)
    return Captured(layout, keys, data, _rebound_meta(model, layout))


class StoredCopy:
    """The restorable state of one service: layout, keys, skeleton; bytes in ``host``."""

    def __init__(self, captured: Captured, host: Mapping[str, torch.Tensor]) -> None:
        self.layout = captured.layout
        self.keys = captured.keys
        self.skeleton = captured.skeleton
        self._host = host
        self._spares: list[torch.nn.Module] = []

    @property
    def nbytes(self) -> int:
        """Device bytes the state needs (the arena, alignment included)."""
        return self.layout.nbytes

    def sizes(self) -> dict[str, int]:
        """Bytes per distinct key."""
        return {k: e.nbytes for k, e in zip(self.keys, self.layout.entries, strict=True)}

    def restore(
        self,
        device: torch.device | str,
        arena: torch.Tensor | None = None,
        paths: Sequence[str] = (),
    ) -> Resident:
        """A fresh model on ``device`` whose state is a copy of the host bytes, copied as one
        slice per device of ``paths`` through that device's link (``slices.py``; ``device``
        alone when empty). KeyError when a key is not in host memory: promote first."""
        device = torch.device(device)
        if arena is None:
            arena = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
        slab = arena.narrow(0, 0, self.nbytes)
        sources = [self._host[key] for key in self.keys]
        spans = [(e.offset, e.offset + e.nbytes) for e in self.layout.entries]
        rebuild = Rebuild(self.layout, self.skeleton, self._spares)
        return restore_sliced(sources, spans, slab, rebuild, device, paths)

    def evict(self, resident: Resident) -> torch.Tensor:
        """Release a resident (nothing is written back); its model is kept for the next restore."""
        self._spares.append(_rebound_meta(resident.model, self.layout))
        return resident.arena

    def release(self, resident: Resident) -> torch.Tensor:
        """``HostCopy.release``: the resident's model let go, its state on ``meta``; the arena."""
        _rebound_meta(resident.model, self.layout)
        return resident.arena
