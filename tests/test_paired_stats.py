"""Paired comparisons over seeds, their bootstrap intervals, and the figures of an accuracy-time curve."""

from __future__ import annotations

import numpy as np
import pytest

from src.findings.paired_stats import (
    area_under_curve,
    bootstrap_ci,
    estimate,
    first_reaching,
    paired,
    paired_by_seed,
    paired_values,
)


def test_the_bootstrap_interval_covers_the_true_mean_about_95_times_in_100():
    rng = np.random.default_rng(7)
    covered = 0
    for trial in range(200):
        sample = rng.normal(1.0, 0.5, size=12)
        low, high = bootstrap_ci(sample, resamples=2000, seed=trial)
        assert low < sample.mean() < high
        covered += low <= 1.0 <= high
    assert 0.85 <= covered / 200 <= 0.99  # percentile bootstrap at n = 12 runs a little narrow


def test_the_interval_is_seeded_narrows_with_more_data_and_is_a_point_for_constant_data():
    values = [0.9, 1.1, 1.3, 0.7, 1.0, 1.2, 0.8, 1.05]
    assert bootstrap_ci(values, seed=3) == bootstrap_ci(values, seed=3)
    narrow = bootstrap_ci(values * 16)
    wide = bootstrap_ci(values)
    assert narrow[1] - narrow[0] < wide[1] - wide[0]
    assert bootstrap_ci([2.5] * 8) == (2.5, 2.5)


def test_bad_values_are_refused():
    with pytest.raises(ValueError, match="no values"):
        bootstrap_ci([])
    with pytest.raises(ValueError, match="finite"):
        bootstrap_ci([1.0, float("nan")])
    with pytest.raises(ValueError, match="confidence"):
        bootstrap_ci([1.0, 2.0], confidence=1.0)
    with pytest.raises(ValueError, match="kind"):
        paired({0: 1.0}, {0: 2.0}, "sum")


def test_paired_differences_and_ratios_match_seeds_and_skip_missing_values():
    a = {0: 1.0, 1: 2.0, 2: 4.0, 3: None, 5: 1.0}
    b = {0: 1.5, 1: 2.0, 2: 5.0, 3: 3.0, 4: 9.0}
    assert paired_values(a, b) == [0.5, 0.0, 1.0]  # seeds 0, 1, 2: 3 has no a, 4 and 5 only one side
    assert paired_by_seed(a, b, "ratio") == {0: 1.5, 1: 1.0, 2: 1.25}
    difference = paired(a, b)
    assert difference.mean == pytest.approx(0.5) and difference.n == 3
    assert difference.low <= 0.5 <= difference.high and difference.excludes(-0.1) and not difference.excludes(0.2)
    assert paired({0: 0.0}, {0: 1.0}, "ratio").n == 0  # no ratio to a zero


def test_a_paired_comparison_separates_what_unpaired_spreads_hide():
    rng = np.random.default_rng(0)
    seed_effect = rng.normal(0.0, 1.0, size=10)  # large differences between seeds, shared by both arms
    a = dict(enumerate(seed_effect))
    b = dict(enumerate(seed_effect + 0.1 + rng.normal(0.0, 0.01, size=10)))
    assert paired(a, b).excludes(0.0)
    unpaired_a, unpaired_b = estimate(list(a.values())), estimate(list(b.values()))
    assert unpaired_a.high > unpaired_b.low  # the per-arm intervals overlap


def test_estimate_leaves_out_none_and_has_no_interval_without_values():
    assert estimate([None, 2.0, 4.0]).n == 2
    empty = estimate([None])
    assert (empty.mean, empty.low, empty.high, empty.n) == (None, None, None, 0)
    assert not empty.excludes(0.0)


def test_first_reaching_is_the_first_point_at_or_above_the_threshold():
    points = [(3.0, 0.7), (1.0, 0.5), (2.0, 0.9), (4.0, 0.95)]
    assert first_reaching(points, 0.9) == 2.0
    assert first_reaching(points, 0.5) == 1.0
    assert first_reaching(points, 0.99) is None


def test_area_under_the_step_curve_holds_each_accuracy_until_the_next_evaluation():
    points = [(1.0, 0.5), (3.0, 0.9)]
    # 0 on [0, 1), 0.5 on [1, 3), 0.9 on [3, 5]: (0 + 1.0 + 1.8) / 5
    assert area_under_curve(points, 5.0) == pytest.approx(2.8 / 5)
    assert area_under_curve(points, 2.0) == pytest.approx(0.5 / 2)  # points past the horizon do not count
    sooner = area_under_curve([(0.5, 0.5), (1.5, 0.9)], 5.0)
    assert sooner > area_under_curve(points, 5.0)
    with pytest.raises(ValueError, match="horizon"):
        area_under_curve(points, 0.0)
