"""calibration.stats: the hierarchical bootstrap covers a known difference, Holm by hand."""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from calibration import metrics
from calibration.stats import Resampler, holm, p_value, percentile_interval, reject


def _coverage(n_seeds: int, sd_seed: float, *, hierarchical: bool, reps: int = 300) -> float:
    """Share of ``reps`` simulated studies whose 95 % interval holds the true difference.

    Each study: a paired difference d[s, q] = δ + a_s + b_q + e_sq over S seeds and 200 shared
    questions, a_s ~ N(0, sd_seed²) (seed effect), b_q ~ N(0, 0.2²) (question effect, the same
    questions under every seed), e_sq ~ N(0, 0.2²); the statistic is the mean over seeds and
    questions, whose sampling variance is sd_seed²/S + 0.2²/200 + 0.2²/(200 S).
    """
    rng = np.random.default_rng(0)
    delta, n_q, covered = 0.03, 200, 0
    for r in range(reps):
        d = (delta + rng.normal(0, sd_seed, (n_seeds, 1)) + rng.normal(0, 0.2, (1, n_q))
             + rng.normal(0, 0.2, (n_seeds, n_q)))
        draws = Resampler(n_q, n=300, seed=r)
        if hierarchical:
            values = draws.values(lambda s, q, d=d: d[s][:, q].mean(), labels=tuple(range(n_seeds)))
        else:  # the seeds held fixed: only the questions resampled
            values = draws.values(lambda s, q, d=d: d[:, q].mean())
        low, high = percentile_interval(values)
        covered += low <= delta <= high
    return covered / reps


@pytest.mark.slow
def test_hierarchical_interval_covers_the_true_difference_and_the_question_only_one_does_not():
    # seed SE 0.03/√5 = 0.013 ≈ question SE 0.2/√200 = 0.014 (the laptop study's proportions)
    hierarchical = _coverage(5, 0.03, hierarchical=True)
    questions_only = _coverage(5, 0.03, hierarchical=False)
    assert 0.91 <= hierarchical <= 0.99  # 300 studies: binomial SE of a 95 % rate is 0.013
    assert questions_only <= 0.88 and hierarchical - questions_only >= 0.06
    # without seed variance the two agree in coverage (the seed level adds nothing to find)
    assert abs(_coverage(5, 0.0, hierarchical=True, reps=150)
               - _coverage(5, 0.0, hierarchical=False, reps=150)) <= 0.05


def test_one_seed_draws_are_the_single_run_bootstrap():
    g = torch.Generator().manual_seed(0)
    probs = torch.rand(137, 4, generator=g, dtype=torch.float64)
    probs = probs / probs.sum(1, keepdim=True)
    labels = torch.randint(0, 4, (137,), generator=g)
    rng = np.random.default_rng(5)  # the per-run bootstrap's own loop, written out
    old = [metrics.conf_ece(probs[i], labels[i])
           for i in (torch.from_numpy(rng.integers(0, 137, size=137)) for _ in range(60))]
    draws = Resampler(137, n=60, seed=5)
    new = draws.values(lambda s, q: metrics.conf_ece(probs[q], labels[q]))
    assert np.array_equal(new, old)
    iv = metrics.bootstrap(metrics.conf_ece, probs, labels, n=60, seed=5)
    tail = (1 - 0.95) / 2  # as the one-run bootstrap computed its quantiles
    assert (iv.low, iv.high) == tuple(np.quantile(old, [tail, 1 - tail]))
    assert draws.seeds((7,)).tolist() == [[0]] * 60  # one seed: nothing drawn


def test_rows_with_the_same_seeds_share_draws_and_a_row_minus_itself_is_zero():
    draws = Resampler(50, n=40, seed=1)
    a, b = draws.seeds((0, 1, 2)), draws.seeds([0, 1, 2])
    assert a is b and a.shape == (40, 3) and a.min() >= 0 and a.max() <= 2
    assert not np.array_equal(draws.seeds((3, 4, 5)), a)  # other seeds: independent draws
    assert draws.questions().shape == (40, 50)
    x = np.random.default_rng(0).normal(size=(3, 50))
    diff = draws.values(lambda s, q: x[s][:, q].mean() - x[s][:, q].mean(), (0, 1, 2))
    assert np.array_equal(diff, np.zeros(40)) and p_value(diff) == 1.0
    with pytest.raises(ValueError, match="n_questions"):
        Resampler(0)
    with pytest.raises(ValueError, match="number of resamples"):
        Resampler(5, n=0)
    with pytest.raises(ValueError, match="empty"):
        draws.seeds(())


def test_p_value_and_interval_agree_on_excluding_zero():
    v = np.arange(1, 1000) / 1000.0 - 0.01  # 10 of 999 at or below 0 (one exactly 0)
    assert p_value(v) == pytest.approx(2 * (10 + 1) / (999 + 1))
    low, _ = percentile_interval(v)
    assert low > 0 and p_value(v) < 0.05
    assert p_value(-v) == p_value(v)
    assert percentile_interval(np.array([1.0, np.nan]), skip_nan=True) == (1.0, 1.0)
    assert all(np.isnan(percentile_interval(np.array([np.nan]), skip_nan=True)))
    with pytest.raises(ValueError, match="level"):
        percentile_interval(v, level=1.5)
    with pytest.raises(ValueError, match="NaN"):
        p_value(np.array([0.1, np.nan]))


def test_holm_against_a_hand_computed_family():
    # sorted 0.005, 0.01, 0.03, 0.04 times 4, 3, 2, 1 = 0.02, 0.03, 0.06, 0.04; running max
    # 0.02, 0.03, 0.06, 0.06: the 0.04 comparison is not rejected although 1 × 0.04 < 0.05
    p = [0.01, 0.04, 0.03, 0.005]
    assert holm(p) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert reject(p) == [True, False, False, True]
    assert holm([0.2]) == pytest.approx([0.2]) and holm([0.6, 0.7]) == pytest.approx([1.0, 1.0])
    with pytest.raises(ValueError, match="p_values"):
        holm([1.5])
    with pytest.raises(ValueError, match="alpha"):
        reject(p, alpha=0.0)


@given(st.lists(st.floats(0.0, 1.0), min_size=1, max_size=12))
def test_holm_is_between_the_raw_p_and_bonferroni_and_keeps_the_order(p):
    adj = holm(p)
    raw = np.asarray(p)
    assert np.all(adj >= raw - 1e-15) and np.all(adj <= np.minimum(1.0, len(p) * raw) + 1e-15)
    order = np.argsort(raw, kind="stable")
    assert np.all(np.diff(adj[order]) >= -1e-15)  # a smaller p never gets a larger adjusted p


def test_holm_agrees_with_statsmodels():
    from statsmodels.stats import multitest  # the reference implementation (dev extra)

    p = np.random.default_rng(3).uniform(0, 0.2, 9)
    assert holm(p) == pytest.approx(multitest.multipletests(p, method="holm")[1])
