"""Elastic DoP substitution, the core-list format and the NUMA layout (pure)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.cpu_manager.cpulist import format_cpulist, parse_cpulist
from services.cpu_manager.dop import substitute_dop, wants_dop
from services.cpu_manager.numa import numa_layout


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


def test_parse_cpulist_takes_ranges_singles_and_blanks() -> None:
    assert parse_cpulist(" 0-2, 5,,7-7\n") == {0, 1, 2, 5, 7}
    assert parse_cpulist("") == frozenset()


def _sysfs(tmp_path, *cpulists: str):
    for i, cpus in enumerate(cpulists):
        (tmp_path / f"node{i}").mkdir()
        (tmp_path / f"node{i}" / "cpulist").write_text(cpus + "\n")
    return tmp_path


def test_numa_layout_read_from_sysfs(tmp_path) -> None:
    sysfs = _sysfs(tmp_path, "0-3", "4-7")
    assert numa_layout({1, 2, 5}, sysfs) == {0: (1, 2), 1: (5,)}


def test_numa_layout_is_one_node_when_sysfs_says_nothing(tmp_path) -> None:
    assert numa_layout({3, 1}, tmp_path) == {0: (1, 3)}


def test_numa_layout_is_one_node_when_a_core_is_on_no_listed_node(tmp_path) -> None:
    assert numa_layout({0, 1, 9}, _sysfs(tmp_path, "0-1")) == {0: (0, 1, 9)}
