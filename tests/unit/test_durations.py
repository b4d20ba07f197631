"""Duration models and their online learning."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.scheduler.policies.durations import Amdahl, Constant, DurationLearner, Table, resolve


def test_amdahl_is_eq_1() -> None:
    m = np.array([1, 2, 4])
    p = 0.9
    e = 1.0 / (m * (1 - p) + p)
    assert np.allclose(Amdahl(10.0, p).durations(m), 10.0 / (e * m))


def test_table_interpolates_in_one_over_m_and_clamps() -> None:
    t = Table(((1, 100.0), (4, 30.0)))
    assert t.durations(np.array([1, 4, 8])).tolist() == [100.0, 30.0, 30.0]
    assert 30.0 < t.durations(np.array([2]))[0] < 100.0


@settings(max_examples=60, deadline=None)
@given(st.floats(1, 1000), st.floats(0, 1), st.lists(st.integers(1, 32), min_size=2, max_size=10))
def test_learner_recovers_an_amdahl_curve(t_ori: float, p: float, units: list[int]) -> None:
    truth = Amdahl(t_ori, p)
    learner = DurationLearner()
    for u in units:
        learner.observe("k", u, float(truth.durations(np.array([u]))[0]))
    model = learner.model("k")
    assert model is not None
    probe = np.array(sorted(set(units)))
    assert np.allclose(model.durations(probe), truth.durations(probe), rtol=1e-6, atol=1e-6)


def test_one_unit_count_seen_means_unknown_elasticity() -> None:
    learner = DurationLearner()
    learner.observe("tool", 1, 2.0)
    learner.observe("tool", 1, 4.0)
    assert learner.model("tool") == Constant(3.0)
    assert learner.model("other") is None


def test_resolve_prefers_the_hint() -> None:
    learner = DurationLearner()
    for u in (1, 2):
        learner.observe("k", u, 10.0 / u)
    assert resolve("k", 5.0, 0.5, learner) == Amdahl(5.0, 0.5)
    model = resolve("k", 5.0, None, learner)
    assert isinstance(model, Amdahl)
    assert model.t_ori_s == 5.0
    assert resolve("", None, None, learner) is None


def test_bad_inputs_are_rejected() -> None:
    with pytest.raises(ValueError, match="decay"):
        DurationLearner(decay=0)
    with pytest.raises(ValueError, match="positive"):
        Table(((0, 1.0),))


def test_the_learner_forgets_the_least_recently_observed_profile_past_its_bound() -> None:
    # A profile is a client's string: kept without bound, 100k distinct ones held 69 MB of
    # the scheduler (review R3).
    learner = DurationLearner(max_profiles=3)
    for name in ("a", "b", "c"):
        learner.observe(name, 1, 1.0)
    learner.observe("a", 2, 0.5)  # observed again: now the most recent
    learner.observe("d", 1, 4.0)
    assert learner.profiles() == ["a", "c", "d"]
    assert learner.model("b") is None
    assert learner.model("a") is not None
    for i in range(1000):
        learner.observe(f"p{i}", 1, 1.0)
    assert len(learner.profiles()) == 3


@settings(max_examples=100, deadline=None)
@given(
    st.floats(1e-6, 1e6),
    st.floats(0, 1),
    st.floats(1e-6, 1e6),
    st.lists(st.tuples(st.integers(1, 64), st.floats(1e-3, 1e3)), min_size=1, max_size=5),
    st.integers(1, 64),
)
def test_one_unit_count_is_bit_exact_with_the_array_form(
    t_ori: float, p: float, seconds: float, points: list[tuple[int, float]], units: int
) -> None:
    """A pass asks ``at`` where the policy's rows use ``durations``: they must agree to the
    bit, or a pass could decide otherwise than the rows it weighs."""
    for model in (Amdahl(t_ori, p), Constant(seconds), Table(tuple(dict(points).items()))):
        assert model.at(units) == float(model.durations(np.array([units]))[0])


def test_a_learned_model_is_refitted_after_each_observation() -> None:
    learner = DurationLearner()
    learner.observe("p", 1, 4.0)
    first = learner.model("p")
    assert first == Constant(4.0)
    assert learner.model("p") is first  # kept until the profile learns more
    learner.observe("p", 4, 1.0)
    assert isinstance(learner.model("p"), Amdahl)
