"""Two-sample tests behind ``lightning-perf compare``: Mann-Whitney U, the bootstrap interval and the verdict."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from lightning_perf.profiling.significance import (
    FASTER,
    NO_CLEAR_DIFFERENCE,
    SLOWER,
    compare_samples,
    mann_whitney_p_value,
    mann_whitney_u,
    ratio_of_medians_ci,
    verdict,
)


def _step_times(seed: int, n: int = 40, median: float = 0.1) -> list[float]:
    """Skewed, step-time-like samples: a lognormal body and an occasional disturbed step."""
    rng = np.random.default_rng(seed)
    body = median * np.exp(rng.normal(0.0, 0.05, n))
    spikes = rng.random(n) < 0.05
    return (body * np.where(spikes, 1.8, 1.0)).tolist()


def _exact_two_sided_p(a: list[float], b: list[float]) -> float:
    """The exact permutation p-value of the rank-sum (no ties), by enumerating every split."""
    pooled = sorted(a + b)
    rank = {v: i + 1 for i, v in enumerate(pooled)}
    observed = sum(rank[v] for v in a)
    n = len(pooled)
    mean = len(a) * (n + 1) / 2.0
    sums = [sum(c) for c in itertools.combinations(range(1, n + 1), len(a))]
    extreme = sum(1 for s in sums if abs(s - mean) >= abs(observed - mean) - 1e-9)
    return extreme / len(sums)


# ----------------------------------------------------------------------------------------------- Mann-Whitney U


def test_u_counts_the_pairs_won_with_ties_as_halves() -> None:
    result = mann_whitney_u([1.0, 2.0, 3.0], [2.0, 4.0])
    # pairs where old > new: (3, 2); the tie (2, 2) counts one half
    assert result.u == pytest.approx(1.5)
    assert (result.n_old, result.n_new) == (3, 2)


def test_identical_samples_give_p_one() -> None:
    sample = _step_times(0)
    result = mann_whitney_u(sample, sample)
    assert result.u == pytest.approx(len(sample) ** 2 / 2)
    assert result.p_value == pytest.approx(1.0)


def test_all_values_tied_gives_p_one_not_a_division_by_zero() -> None:
    result = mann_whitney_u([5.0] * 10, [5.0] * 12)
    assert result.p_value == 1.0
    assert result.z == 0.0


def test_separated_samples_are_significant_in_both_directions() -> None:
    low, high = list(range(1, 11)), list(range(21, 31))
    assert mann_whitney_u(low, high).p_value < 1e-3
    assert mann_whitney_u(high, low).p_value < 1e-3
    assert mann_whitney_u(low, high).z < 0 < mann_whitney_u(high, low).z


@pytest.mark.parametrize("shift", [0.0, 0.3, 0.8, 1.5])
def test_normal_approximation_is_close_to_the_exact_test_at_eight_a_side(shift: float) -> None:
    rng = np.random.default_rng(int(shift * 10))
    a = rng.normal(0.0, 1.0, 8).tolist()
    b = (rng.normal(0.0, 1.0, 8) + shift).tolist()
    assert abs(mann_whitney_u(a, b).p_value - _exact_two_sided_p(a, b)) < 0.01


def test_ties_shrink_the_variance() -> None:
    a, b = [1, 1, 1, 2, 2, 2, 3, 3], [2, 2, 3, 3, 3, 4, 4, 4]
    with_ties = mann_whitney_u(a, b)
    z_untied, _ = mann_whitney_p_value(with_ties.u, 8, 8, tie_term=0.0)
    assert abs(with_ties.z) > abs(z_untied)


def test_p_value_from_an_ordering_alone() -> None:
    z, p = mann_whitney_p_value(0.0, 10, 10)
    assert z < 0 and p < 1e-3
    assert mann_whitney_p_value(50.0, 10, 10) == (0.0, 1.0)


@pytest.mark.parametrize(
    ("old", "new", "error"),
    [
        ([], [1.0], ValueError),
        ([1.0], [], ValueError),
        ([1.0, float("nan")], [1.0], ValueError),
        ([1.0, float("inf")], [1.0], ValueError),
        (["a"], [1.0], TypeError),
        ([None], [1.0], TypeError),
    ],
)
def test_bad_samples_are_refused(old: list, new: list, error: type) -> None:
    with pytest.raises(error, match=r"old|new"):
        mann_whitney_u(old, new)


def test_bad_counts_are_refused() -> None:
    with pytest.raises(ValueError, match="n_old=0"):
        mann_whitney_p_value(0.0, 0, 3)
    with pytest.raises(ValueError, match="n_new=True"):
        mann_whitney_p_value(0.0, 3, True)


# ---------------------------------------------------------------------------------------------- bootstrap interval


def test_interval_contains_the_ratio_and_is_reproducible() -> None:
    old, new = _step_times(1), _step_times(2, median=0.12)
    first = ratio_of_medians_ci(old, new, seed=3)
    assert first == ratio_of_medians_ci(old, new, seed=3)
    ratio, low, high = first
    assert low <= ratio <= high
    assert ratio == pytest.approx(np.median(new) / np.median(old))
    assert low < 1.2 < high


def test_interval_of_identical_samples_brackets_one() -> None:
    sample = _step_times(4)
    ratio, low, high = ratio_of_medians_ci(sample, sample)
    assert ratio == 1.0
    assert low <= 1.0 <= high
    assert high / low < 1.1


def test_interval_narrows_with_more_samples() -> None:
    _, low_small, high_small = ratio_of_medians_ci(_step_times(5, n=10), _step_times(6, n=10))
    _, low_big, high_big = ratio_of_medians_ci(_step_times(5, n=400), _step_times(6, n=400))
    assert high_big - low_big < high_small - low_small


def test_large_samples_are_resampled_in_blocks() -> None:
    ratio, low, high = ratio_of_medians_ci(_step_times(7, n=5000), _step_times(8, n=5000), resamples=200)
    assert low <= ratio <= high


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"confidence": 1.0}, "confidence"),
        ({"confidence": True}, "confidence"),
        ({"resamples": 10}, "resamples"),
        ({"resamples": 1000.0}, "resamples"),
        ({"seed": -1}, "seed"),
    ],
)
def test_bad_settings_are_refused(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ratio_of_medians_ci([1.0, 2.0], [1.0, 2.0], **kwargs)


def test_interval_needs_two_positive_values_a_side() -> None:
    with pytest.raises(ValueError, match="at least 2"):
        ratio_of_medians_ci([1.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="<= 0"):
        ratio_of_medians_ci([0.0, 1.0], [1.0, 2.0])


# --------------------------------------------------------------------------------------------------------- verdict


def test_identical_samples_show_no_difference() -> None:
    sample = _step_times(10)
    result = compare_samples(sample, list(sample), 0.05)
    assert result.verdict == NO_CLEAR_DIFFERENCE
    assert not result.regression
    assert result.ratio == 1.0


def test_doubled_times_are_slower() -> None:
    old = _step_times(11)
    result = compare_samples(old, [2 * t for t in old], 0.05)
    assert result.verdict == SLOWER
    assert result.regression
    assert result.ratio == pytest.approx(2.0)
    assert result.p_value is not None and result.p_value < 1e-6
    assert result.ratio_ci95 is not None and result.ratio_ci95[0] > 1.05


def test_halved_times_are_faster() -> None:
    old = _step_times(12)
    result = compare_samples(old, [t / 2 for t in old], 0.05)
    assert result.verdict == FASTER
    assert not result.regression


def test_a_significant_shift_inside_the_threshold_is_no_clear_difference() -> None:
    old = _step_times(13, n=400)
    new = [t * 1.02 for t in _step_times(14, n=400)]
    result = compare_samples(old, new, 0.05)
    assert result.p_value is not None and result.p_value < 0.01  # real, but smaller than what we care about
    assert result.verdict == NO_CLEAR_DIFFERENCE


@pytest.mark.parametrize("seed", range(5))
def test_noise_alone_is_no_clear_difference(seed: int) -> None:
    result = compare_samples(_step_times(100 + seed), _step_times(200 + seed), 0.05)
    assert result.verdict == NO_CLEAR_DIFFERENCE


def test_speed_reads_the_ratio_the_other_way() -> None:
    old = [100.0 + i for i in range(10)]
    half = [v / 2 for v in old]
    assert compare_samples(old, half, 0.05, higher_is_better=True).verdict == SLOWER
    assert compare_samples(old, half, 0.05).verdict == FASTER


def test_one_value_a_side_gives_a_ratio_but_no_verdict() -> None:
    result = compare_samples([1.0], [2.0], 0.05)
    assert result.ratio == 2.0
    assert result.ratio_ci95 is None and result.p_value is None
    assert result.verdict == NO_CLEAR_DIFFERENCE


def test_three_values_a_side_need_the_interval_above_the_threshold() -> None:
    # Mann-Whitney cannot reach p < 0.01 with 3 + 3 values: the interval decides.
    clear = compare_samples([1.0, 1.01, 0.99], [2.0, 2.02, 1.98], 0.05)
    assert clear.p_value is not None and clear.p_value > 0.01
    assert clear.verdict == SLOWER
    overlapping = compare_samples([1.0, 1.5, 0.9], [1.2, 1.1, 1.6], 0.05)
    assert overlapping.verdict == NO_CLEAR_DIFFERENCE


@pytest.mark.parametrize(
    ("ratio", "interval", "p", "expected"),
    [
        (1.10, (1.06, 1.14), 0.5, SLOWER),  # interval wholly above 1.05
        (1.10, (1.01, 1.30), 0.001, SLOWER),  # significant test, interval excludes 1
        (1.10, (0.95, 1.30), 0.001, NO_CLEAR_DIFFERENCE),  # significant test, but the interval holds no change
        (1.10, (0.95, 1.30), 0.05, NO_CLEAR_DIFFERENCE),  # neither
        (1.10, None, 0.001, SLOWER),  # statistics only: the test alone
        (1.04, (1.03, 1.05), 1e-9, NO_CLEAR_DIFFERENCE),  # inside the threshold
        (0.90, (0.88, 0.92), 0.5, FASTER),
        (0.90, (0.80, 0.99), 0.001, FASTER),
        (0.90, (0.80, 1.01), 0.001, NO_CLEAR_DIFFERENCE),
        (0.96, (0.95, 0.97), 1e-9, NO_CLEAR_DIFFERENCE),  # 1/1.05 = 0.952: inside the threshold
        (1.10, None, None, NO_CLEAR_DIFFERENCE),
    ],
)
def test_verdict_table(ratio: float, interval: tuple | None, p: float | None, expected: str) -> None:
    assert verdict(ratio, interval, p, 0.05) == expected


def test_verdict_of_a_speed_swaps_the_interval() -> None:
    assert verdict(0.5, (0.45, 0.55), 0.5, 0.05, higher_is_better=True) == SLOWER
    assert verdict(2.0, (1.8, 2.2), 0.5, 0.05, higher_is_better=True) == FASTER


def test_zero_threshold_calls_any_significant_change() -> None:
    assert verdict(1.001, (1.0005, 1.002), 0.5, 0.0) == SLOWER


@pytest.mark.parametrize("threshold", [-0.1, math.nan, math.inf, True, "5%"])
def test_bad_threshold_is_refused(threshold: object) -> None:
    with pytest.raises(ValueError, match="threshold"):
        verdict(1.0, None, None, threshold)  # type: ignore[arg-type]


@pytest.mark.parametrize("ratio", [0.0, -1.0, math.nan, math.inf])
def test_bad_ratio_is_refused(ratio: float) -> None:
    with pytest.raises(ValueError, match="ratio"):
        verdict(ratio, None, None, 0.05)


# ------------------------------------------------------------------------------------------------- grouped samples


def test_groups_widen_the_interval_by_the_variation_between_repeats() -> None:
    # Three repeats a side whose levels differ by 30%: step noise alone would give a narrow interval.
    old = [_step_times(20 + i, n=30, median=level) for i, level in enumerate((0.1, 0.13, 0.1))]
    new = [_step_times(30 + i, n=30, median=level) for i, level in enumerate((0.1, 0.1, 0.13))]
    flat_old, flat_new = [t for g in old for t in g], [t for g in new for t in g]
    _, low_flat, high_flat = ratio_of_medians_ci(flat_old, flat_new)
    ratio, low, high = ratio_of_medians_ci(old, new)
    assert ratio == pytest.approx(np.median(flat_new) / np.median(flat_old))
    assert low <= ratio <= high
    assert high - low > 2 * (high_flat - low_flat)


def test_grouped_samples_are_compared_on_their_pooled_values() -> None:
    old = [_step_times(40 + i, n=20) for i in range(3)]
    doubled = [[2 * t for t in group] for group in old]
    result = compare_samples(old, doubled, 0.05)
    assert result.verdict == SLOWER
    assert (result.n_old, result.n_new) == (60, 60)
    assert compare_samples(old, [list(g) for g in old], 0.05).verdict == NO_CLEAR_DIFFERENCE


def test_empty_groups_are_dropped_but_not_all_of_them() -> None:
    ratio, low, high = ratio_of_medians_ci([[1.0, 1.1], []], [[1.0, 1.2], [1.1]])
    assert low <= ratio <= high
    with pytest.raises(ValueError, match="old"):
        ratio_of_medians_ci([[], []], [[1.0, 1.2]])
