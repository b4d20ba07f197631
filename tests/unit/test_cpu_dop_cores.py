"""Elastic DoP substitution and NUMA-first core choice (pure)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.cpu_manager.cores import (
    CoreLedger,
    choose_cores,
    format_cpulist,
    numa_nodes,
    parse_cpulist,
)
from services.cpu_manager.dop import substitute_dop, wants_dop


def test_substitute_dop_replaces_every_token() -> None:
    argv = ("pytest", "-n", "{dop}", "--x={dop}{dop}", "{other}", "{ dop }")
    assert substitute_dop(argv, 4) == ("pytest", "-n", "4", "--x=44", "{other}", "{ dop }")


def test_substitute_dop_inside_a_shell_string() -> None:
    assert substitute_dop(("sh", "-c", "make -j{dop} && echo ${HOME}"), 8) == (
        "sh",
        "-c",
        "make -j8 && echo ${HOME}",
    )


def test_dop_must_be_positive() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        substitute_dop(("x",), 0)


def test_wants_dop() -> None:
    assert wants_dop(("pytest", "-n", "{dop}"))
    assert not wants_dop(("pytest",))


@given(st.sets(st.integers(0, 300)))
def test_cpulist_round_trip(cores: set[int]) -> None:
    assert parse_cpulist(format_cpulist(cores)) == cores


def test_format_cpulist_is_compact() -> None:
    assert format_cpulist([3, 0, 1, 2, 8, 10, 11]) == "0-3,8,10-11"


NODES = [frozenset(range(0, 4)), frozenset(range(4, 8))]


def test_choose_cores_stays_on_one_numa_node() -> None:
    assert choose_cores({1, 2, 4, 5, 6}, 3, NODES) == (4, 5, 6)


def test_choose_cores_best_fit_keeps_the_big_hole() -> None:
    assert choose_cores({0, 1, 4, 5, 6, 7}, 2, NODES) == (0, 1)


def test_choose_cores_spills_across_nodes_when_it_must() -> None:
    chosen = choose_cores({2, 3, 5, 6, 7}, 4, NODES)
    assert chosen is not None
    assert set(chosen) >= {5, 6, 7}
    assert len(chosen) == 4


def test_choose_cores_none_when_not_enough() -> None:
    assert choose_cores({1}, 2, NODES) is None


@given(st.sets(st.integers(0, 7)), st.integers(1, 8))
def test_choose_cores_only_picks_free_cores(free: set[int], n: int) -> None:
    chosen = choose_cores(free, n, NODES)
    if len(free) < n:
        assert chosen is None
    else:
        assert chosen is not None
        assert len(set(chosen)) == n
        assert set(chosen) <= free


def test_numa_nodes_read_from_sysfs(tmp_path) -> None:
    for i, cpus in enumerate(("0-3", "4-7")):
        (tmp_path / f"node{i}").mkdir()
        (tmp_path / f"node{i}" / "cpulist").write_text(cpus + "\n")
    assert numa_nodes(tmp_path) == NODES


def test_ledger_refuses_shared_cores_and_releases() -> None:
    ledger = CoreLedger()
    assert ledger.claim("a", (0, 1)) == []
    assert ledger.claim("b", (1, 2)) == [1]
    assert ledger.busy() == {0, 1}
    ledger.release("a")
    ledger.release("a")
    assert ledger.claim("b", (1, 2)) == []
