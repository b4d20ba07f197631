"""A restore onto a chunk of ``k`` devices as ``k`` slices in parallel, slice ``i`` through
device ``i``'s own host link (the tensor-parallel variants of ARL-Tangram §6.1 load each GPU's
share through its own link, about ``k`` times less per link than one device loading it all).

The split is pure (:func:`split`, :func:`cut`): ``k`` contiguous byte ranges of the arena, each
boundary aligned, cut against the spans of host bytes that fill it, so every byte of the state
is copied exactly once. The copy (:func:`start`) then runs every slice at once:

- on CUDA, slice ``i`` goes host -> device ``i`` on a copy stream of device ``i`` (its own
  PCIe link), then device ``i`` -> the arena on the chunk's first device, where the model runs
  (a peer copy over NVLink or PCIe; the slice of the first device lands in the arena
  directly). NOT TESTED: this machine has no GPU. It is marked ``pragma: no cover`` and no
  test reaches it; on a machine without CUDA it is never taken (the arena is not a CUDA one).
- on the CPU stand-ins every "device" is torch's CPU device: slice ``i`` is copied into the
  arena by a thread of its own (torch releases the GIL while copying). They share one memory
  system -- one link -- and the agent reports so (``devices.py``), so the scheduler prices
  such a restore as the whole model through one link.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

ALIGN = 256  # bytes: CUDA's allocation granularity and a multiple of every dtype's size
CHUNK_BYTES = 64 << 20  # big enough to run at full bandwidth, small enough to overlap setup
OVERLAP_BYTES = 16 << 20  # below this a thread costs more than the rebuild it would hide

Span = tuple[int, int]  # [start, end) bytes of the arena
Wait = Callable[[], None]


@dataclass(frozen=True, slots=True)
class Cut:
    """Bytes ``[start, start + nbytes)`` of source span ``span``, at ``dst`` in the arena."""

    span: int
    start: int
    nbytes: int
    dst: int


@dataclass(frozen=True, slots=True)
class Piece:
    """Flat uint8 host bytes and where they go in the arena."""

    src: torch.Tensor
    dst: int


def split(nbytes: int, k: int, align: int = ALIGN) -> tuple[Span, ...]:
    """``k`` contiguous ranges covering ``[0, nbytes)``, as equal as ``align``-ed boundaries
    allow (the last ones empty when there are too few bytes to go round)."""
    if k < 1:
        raise ValueError(f"cannot split into {k} slices")
    step = -(-nbytes // k)
    step = -(-step // align) * align if step else 0
    return tuple((min(i * step, nbytes), min((i + 1) * step, nbytes)) for i in range(k))


def cut(spans: Sequence[Span], ranges: Sequence[Span]) -> tuple[tuple[Cut, ...], ...]:
    """Per range, the parts of ``spans`` (arena bytes filled from a source each; disjoint, in
    any order) that fall in it, by arena offset: together every byte of every span once."""
    out = []
    for lo, hi in ranges:
        parts = []
        for i, (a, b) in enumerate(spans):
            start, end = max(a, lo), min(b, hi)
            if start < end:
                parts.append(Cut(i, start - a, end - start, start))
        out.append(tuple(sorted(parts, key=lambda c: c.dst)))  # spans need not be in order
    return tuple(out)


def plan(
    sources: Sequence[torch.Tensor], spans: Sequence[Span], k: int, nbytes: int
) -> list[list[Piece]]:
    """``k`` slices of pieces: flat uint8 ``sources[i]`` fills ``spans[i]`` of an arena of
    ``nbytes``."""
    return [
        [Piece(sources[c.span].narrow(0, c.start, c.nbytes), c.dst) for c in part]
        for part in cut(spans, split(nbytes, k))
    ]


def copy_chunked(src: torch.Tensor, dst: torch.Tensor, chunk_bytes: int = CHUNK_BYTES) -> None:
    """Copy a byte slab in chunks (asynchronous on CUDA when ``src`` is pinned)."""
    non_blocking = dst.is_cuda and src.is_pinned()
    for start in range(0, src.numel(), chunk_bytes):
        n = min(chunk_bytes, src.numel() - start)
        dst.narrow(0, start, n).copy_(src.narrow(0, start, n), non_blocking=non_blocking)


def _copy_pieces(pieces: Sequence[Piece], arena: torch.Tensor) -> None:
    for p in pieces:
        copy_chunked(p.src, arena.narrow(0, p.dst, p.src.numel()))


def start(slices: Sequence[Sequence[Piece]], arena: torch.Tensor, paths: Sequence[str]) -> Wait:
    """Start copying every slice into ``arena``, slice ``i`` through device ``paths[i]``;
    returns the wait that finishes them all (and re-raises the first failure)."""
    if arena.is_cuda:  # pragma: no cover - needs a GPU
        return _start_cuda(slices, arena, [torch.device(p) for p in paths])
    busy = [s for s in slices if s]
    if sum(p.src.numel() for s in busy for p in s) < OVERLAP_BYTES:
        for s in busy:
            _copy_pieces(s, arena)
        return lambda: None
    failure: list[BaseException] = []
    threads = [
        threading.Thread(target=_run, args=(s, arena, failure), name=f"restore-slice-{i}")
        for i, s in enumerate(busy)
    ]
    started: list[threading.Thread] = []
    try:
        for t in threads:
            t.start()
            started.append(t)
    except BaseException:  # a thread that could not start: none left copying into the arena
        _join(started)
        raise

    def wait() -> None:
        _join(threads)
        if failure:
            raise failure[0]

    return wait


def _join(threads: Sequence[threading.Thread]) -> None:
    for t in threads:
        t.join()


def _run(pieces: Sequence[Piece], arena: torch.Tensor, failure: list[BaseException]) -> None:
    try:
        _copy_pieces(pieces, arena)
    except BaseException as exc:  # handed to the waiting thread, which re-raises it
        failure.append(exc)


def _start_cuda(
    slices: Sequence[Sequence[Piece]], arena: torch.Tensor, paths: Sequence[torch.device]
) -> Wait:  # pragma: no cover - needs a GPU (NOT TESTED: see the module docstring)
    """Slice ``i``: host -> device ``paths[i]`` on a copy stream of that device, then (when
    that is not the arena's device) device -> device into the arena on the same stream."""
    streams: list[torch.cuda.Stream] = []
    staged: list[torch.Tensor] = []  # kept alive until the streams are done
    try:
        for pieces, device in zip(slices, paths, strict=True):
            if pieces:
                streams.append(torch.cuda.Stream(device))  # type: ignore[no-untyped-call]
                _launch(pieces, device, arena, staged, streams[-1])
    except BaseException:  # a slice that could not start (a staging buffer out of memory):
        for stream in streams:  # the arena is freed next, so none may still be writing it
            stream.synchronize()
        raise

    def wait() -> None:
        for stream in streams:
            torch.cuda.current_stream(arena.device).wait_stream(stream)
            stream.synchronize()
        staged.clear()

    return wait


def _launch(
    pieces: Sequence[Piece],
    device: torch.device,
    arena: torch.Tensor,
    staged: list[torch.Tensor],
    stream: torch.cuda.Stream,
) -> None:  # pragma: no cover - needs a GPU (NOT TESTED: see the module docstring)
    """One slice on ``stream``, a copy stream of ``device``: straight into the arena on the
    arena's own device, else staged there and gathered into the arena (peer to peer)."""
    with torch.cuda.stream(stream):
        if device == arena.device:
            _copy_pieces(pieces, arena)
            return
        lo = min(p.dst for p in pieces)
        n = max(p.dst + p.src.numel() for p in pieces) - lo
        stage = torch.empty(n, dtype=torch.uint8, device=device)
        staged.append(stage)
        _copy_pieces([Piece(p.src, p.dst - lo) for p in pieces], stage)
        arena.narrow(0, lo, n).copy_(stage, non_blocking=True)  # the gather, peer to peer
