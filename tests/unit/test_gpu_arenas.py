"""The pool of freed CPU arenas (services/gpu_manager/arenas.py): exact sizes, the most
recently freed first, bounded, and never memory that something still views."""

from __future__ import annotations

import torch

from services.gpu_manager.arenas import Arenas, unshared


def arena(n: int) -> torch.Tensor:
    return torch.empty(n, dtype=torch.uint8)


def test_an_arena_comes_back_for_a_restore_of_exactly_its_size() -> None:
    pool = Arenas(limit=1000)
    a, b = arena(100), arena(200)
    assert pool.give(a)
    assert pool.give(b)
    assert pool.take("cpu", 150) is None  # no arena of another size stands in
    assert pool.take("cpu", 200) is b
    assert pool.take("cpu", 200) is None
    assert pool.take("cpu", 100) is a
    assert (len(pool), pool.kept_bytes, pool.reused) == (0, 0, 2)


def test_the_most_recently_freed_goes_first_and_the_oldest_past_the_limit_is_let_go() -> None:
    pool = Arenas(limit=250)
    first, second, third = arena(100), arena(100), arena(100)
    for a in (first, second, third):
        assert pool.give(a)
    assert pool.kept_bytes == 200  # the first let go
    assert pool.take("cpu", 100) is third
    assert pool.take("cpu", 100) is second
    assert pool.take("cpu", 100) is None
    assert not pool.give(arena(300))  # larger than the whole pool


def test_memory_something_still_views_is_never_kept() -> None:
    pool = Arenas(limit=1000)
    a = arena(100)
    view = a.narrow(0, 12, 4).view(torch.float32)  # a handler's tensor on the copy's memory
    assert not unshared(a)
    assert not pool.give(a)
    del view
    assert unshared(a)
    slab = arena(200).narrow(0, 0, 100)  # a slab cut from a larger allocation
    assert not pool.give(slab)
    whole = arena(100).narrow(0, 0, 100)  # a slab that is its whole allocation
    assert pool.give(whole)


def test_only_cpu_bytes_are_kept() -> None:
    pool = Arenas(limit=1000)
    assert not pool.give(torch.empty(100, dtype=torch.uint8, device="meta"))
    assert not pool.give(torch.empty(25, dtype=torch.float32))
    assert len(pool) == 0
