"""The invariant host copy of a service's state, and its restore onto a device.

Every parameter and buffer of the model is packed into one preallocated host slab (pinned when
CUDA is present) holding one contiguous, aligned region per dtype. The layout remembers where
each tensor lives and which module attributes point at it (tied weights share one entry). The
model itself is kept as a skeleton on the ``meta`` device, so the host slab is the only copy.

A restore copies the slab into a device arena (chunked; on side streams on CUDA, threads on
the CPU, so rebuilding the model overlaps it) and binds a copy of the skeleton to views of
that arena. Onto a chunk of ``k`` devices it copies ``k`` slices at once, slice ``i`` through
device ``i``'s own link (``slices.py``). The host slab is never written after capture: a
handle that mutates its model (running stats, in-place ops) changes only the arena, so eviction
just drops the arena — no write-back.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from services.gpu_manager import slices
from services.gpu_manager.slices import ALIGN as ALIGN
from services.gpu_manager.slices import CHUNK_BYTES as CHUNK_BYTES
from services.gpu_manager.slices import OVERLAP_BYTES as OVERLAP_BYTES
from services.gpu_manager.slices import copy_chunked as copy_chunked


@dataclass(frozen=True, slots=True)
class Entry:
    """One distinct tensor of the model's state and where it lives in the slab."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    is_param: bool
    requires_grad: bool


@dataclass(frozen=True, slots=True)
class Binding:
    """A module attribute (``module`` is its dotted path) that holds entry ``entry``."""

    module: str
    attr: str
    entry: int


@dataclass(frozen=True, slots=True)
class Layout:
    """Where every tensor lives in the slab; ``regions`` maps a dtype to (offset, nbytes)."""

    entries: tuple[Entry, ...]
    bindings: tuple[Binding, ...]
    regions: dict[torch.dtype, tuple[int, int]]
    nbytes: int


@dataclass(slots=True)
class Resident:
    """A service restored onto a device: its model, whose state are views of ``arena``."""

    model: torch.nn.Module
    arena: torch.Tensor
    device: torch.device


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _state(model: torch.nn.Module) -> Iterator[tuple[str, str, torch.Tensor, bool]]:
    """Every (module path, attribute, tensor, is_param), shared tensors once per holder."""
    for path, module in model.named_modules(remove_duplicate=False):
        for attr, param in module._parameters.items():
            if param is not None:
                yield path, attr, param, True
        for attr, buf in module._buffers.items():
            if buf is not None:
                yield path, attr, buf, False


Collected = tuple[list[tuple[str, torch.Tensor, bool]], tuple[Binding, ...]]


def _collect(model: torch.nn.Module) -> Collected:
    """The distinct tensors (name, tensor, is_param) in first-seen order, and their holders."""
    index: dict[int, int] = {}
    tensors: list[tuple[str, torch.Tensor, bool]] = []
    bindings: list[Binding] = []
    for path, attr, tensor, is_param in _state(model):
        if id(tensor) not in index:
            index[id(tensor)] = len(tensors)
            tensors.append((f"{path}.{attr}" if path else attr, tensor, is_param))
        bindings.append(Binding(path, attr, index[id(tensor)]))
    return tensors, tuple(bindings)


def plan_layout(model: torch.nn.Module) -> Layout:
    """The slab layout of ``model``'s state, grouped by dtype in first-seen order."""
    return _place(*_collect(model))


def _place(tensors: list[tuple[str, torch.Tensor, bool]], bindings: tuple[Binding, ...]) -> Layout:
    dtypes = list(dict.fromkeys(t.dtype for _, t, _ in tensors))
    entries: list[Entry | None] = [None] * len(tensors)
    regions: dict[torch.dtype, tuple[int, int]] = {}
    offset = 0
    for dtype in dtypes:
        start = offset
        for i, (name, t, is_param) in enumerate(tensors):
            if t.dtype == dtype:
                nbytes = t.numel() * t.element_size()
                entries[i] = Entry(
                    name, dtype, tuple(t.shape), offset, nbytes, is_param, t.requires_grad
                )
                offset += _align(nbytes)
        regions[dtype] = (start, offset - start)
    placed = tuple(e for e in entries if e is not None)
    return Layout(placed, bindings, regions, offset)


def _views(slab: torch.Tensor, layout: Layout) -> list[torch.Tensor]:
    return [slab.narrow(0, e.offset, e.nbytes).view(e.dtype).view(e.shape) for e in layout.entries]


def _bind(model: torch.nn.Module, layout: Layout, tensors: list[torch.Tensor]) -> None:
    modules = dict(model.named_modules(remove_duplicate=False))
    for b in layout.bindings:
        entry, module = layout.entries[b.entry], modules[b.module]
        if entry.is_param:
            module._parameters[b.attr] = tensors[b.entry]
        else:
            module._buffers[b.attr] = tensors[b.entry]


def _as_state(layout: Layout, views: list[torch.Tensor]) -> list[torch.Tensor]:
    """Views wrapped as Parameters where the original was one (one object per entry: ties hold)."""
    return [
        torch.nn.Parameter(v, requires_grad=e.requires_grad) if e.is_param else v
        for e, v in zip(layout.entries, views, strict=True)
    ]


class HostCopy:
    """A service's state packed once into a host slab; restores it onto any device."""

    def __init__(self, model: torch.nn.Module, *, pin: bool | None = None) -> None:
        """Capture ``model``'s state; its tensors move to ``meta`` (the slab is the copy)."""
        tensors, bindings = _collect(model)
        self.layout = _place(tensors, bindings)
        pin = torch.cuda.is_available() if pin is None else pin
        self.host = torch.empty(self.layout.nbytes, dtype=torch.uint8, pin_memory=pin)
        with torch.no_grad():
            for view, (_, tensor, _) in zip(_views(self.host, self.layout), tensors, strict=True):
                view.copy_(tensor)
        self.skeleton = _rebound_meta(model, self.layout)
        self._spares: list[torch.nn.Module] = []

    @property
    def nbytes(self) -> int:
        """Device bytes the state needs (the slab, alignment included)."""
        return self.layout.nbytes

    def restore(
        self,
        device: torch.device | str,
        arena: torch.Tensor | None = None,
        paths: Sequence[str] = (),
    ) -> Resident:
        """A fresh model on ``device`` whose state is a copy of the host slab, copied as one
        slice per device of ``paths`` (the chunk's devices, ``device`` first), each through
        that device's link; through ``device`` alone when ``paths`` is empty."""
        device = torch.device(device)
        slab = self._arena(device, arena)
        rebuild = Rebuild(self.layout, self.skeleton, self._spares)
        return restore_sliced([self.host], [(0, self.nbytes)], slab, rebuild, device, paths)

    def evict(self, resident: Resident) -> torch.Tensor:
        """Release a resident: its model is kept (on ``meta``) for the next restore; nothing is
        written back. Returns the arena, which the caller may reuse or drop."""
        self._spares.append(_rebound_meta(resident.model, self.layout))
        return resident.arena

    def release(self, resident: Resident) -> torch.Tensor:
        """Let a resident go, its model not kept: its state is pointed at ``meta`` tensors, so
        nothing of the model views the arena any more (even while the model itself lives on,
        in a reference cycle or a handler's closure). Returns the arena."""
        _rebound_meta(resident.model, self.layout)
        return resident.arena

    def _arena(self, device: torch.device, arena: torch.Tensor | None) -> torch.Tensor:
        if arena is None:
            return torch.empty(self.nbytes, dtype=torch.uint8, device=device)
        if arena.dtype != torch.uint8 or arena.device != device or arena.numel() < self.nbytes:
            raise ValueError(f"arena must be ≥ {self.nbytes} uint8 bytes on {device}")
        return arena.narrow(0, 0, self.nbytes)


@dataclass(frozen=True, slots=True)
class Rebuild:
    """How a copy makes a model of its state: the layout, the skeleton, the spares kept."""

    layout: Layout
    skeleton: torch.nn.Module
    spares: list[torch.nn.Module]


def restore_sliced(
    sources: Sequence[torch.Tensor],
    spans: Sequence[tuple[int, int]],
    slab: torch.Tensor,
    rebuild: Rebuild,
    device: torch.device,
    paths: Sequence[str],
) -> Resident:
    """``sources`` (filling ``spans`` of ``slab``) copied as one slice per device of ``paths``
    (``device`` alone when empty), a model rebuilt on the slab meanwhile (a spare if any)."""
    parts = slices.plan(sources, spans, max(1, len(paths)), rebuild.layout.nbytes)
    wait = slices.start(parts, slab, paths or [str(device)])
    try:  # the model is rebuilt while the slices copy
        spares = rebuild.spares
        model = spares.pop() if spares else copy.deepcopy(rebuild.skeleton)
        layout = rebuild.layout
        _bind(model, layout, _as_state(layout, _views(slab, layout)))
    finally:  # every slice joined, even when the rebuild failed: none outlives the restore
        wait()
    return Resident(model, slab, device)


def _rebound_meta(model: torch.nn.Module, layout: Layout) -> torch.nn.Module:
    """Point the model's state at ``meta`` tensors, freeing its own storage (ties kept)."""
    metas = [torch.empty(e.shape, dtype=e.dtype, device="meta") for e in layout.entries]
    _bind(model, layout, _as_state(layout, metas))
    return model


def held_bytes(resident: Resident) -> int:
    """Device bytes the resident model's state holds now: its arena, and any tensor its handler
    has added to its parameters or buffers since (a cache built on first use), each once."""
    arena = resident.arena.untyped_storage()
    lo, size = arena.data_ptr(), arena.nbytes()
    added: dict[int, int] = {}
    for t in itertools.chain(resident.model.parameters(), resident.model.buffers()):
        outside = not lo <= t.data_ptr() < lo + size  # not a view of the arena: the handler's
        if outside and t.device == resident.device:
            storage = t.untyped_storage()
            added.setdefault(storage.data_ptr(), storage.nbytes())
    return size + sum(added.values())


def measure_headroom(
    resident: Resident, handle: Callable[[torch.nn.Module, list[Any]], list[Any]], sample: list[Any]
) -> int:
    """Peak activation bytes of one call on ``sample`` (CUDA only; 0 where unmeasurable)."""
    if resident.device.type != "cuda":
        return 0
    torch.cuda.synchronize(resident.device)  # pragma: no cover - needs a GPU
    base = torch.cuda.memory_allocated(resident.device)
    torch.cuda.reset_peak_memory_stats(resident.device)
    handle(resident.model, sample)
    torch.cuda.synchronize(resident.device)
    return max(0, torch.cuda.max_memory_allocated(resident.device) - base)
