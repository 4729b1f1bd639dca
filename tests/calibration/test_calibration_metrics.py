"""Metrics against torchmetrics, brute-force loops, closed forms and invariants."""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from calibration import metrics

torchmetrics = pytest.importorskip("torchmetrics")


def random_probs(n: int, k: int, seed: int, sharpness: float = 3.0):
    g = torch.Generator().manual_seed(seed)
    logits = sharpness * torch.randn(n, k, generator=g, dtype=torch.float64)
    probs = logits.softmax(-1)
    # Labels drawn from a tempered version of the model: miscalibrated on purpose.
    labels = torch.multinomial((logits / 2).softmax(-1), 1, generator=g).squeeze(1)
    return probs, labels


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("n_bins", [10, 15])
@pytest.mark.parametrize("k", [2, 4, 7])
def test_conf_ece_and_mce_match_torchmetrics(seed, n_bins, k):
    from torchmetrics.classification import MulticlassCalibrationError

    probs, labels = random_probs(500, k, seed)
    for norm, ours in (("l1", metrics.conf_ece), ("max", metrics.mce)):
        oracle = MulticlassCalibrationError(num_classes=k, n_bins=n_bins, norm=norm)
        expected = float(oracle(probs.float(), labels))
        # torchmetrics works in float32: agree to float32 precision.
        assert ours(probs, labels, n_bins=n_bins) == pytest.approx(expected, abs=2e-6)


def brute_force_cw_ece(probs: np.ndarray, labels: np.ndarray, n_bins: int) -> float:
    """The CFT definition written as plain loops, bins [k/n, (k+1)/n), last one closed."""
    n, k = probs.shape
    total = 0.0
    for j in range(k):
        for b in range(n_bins):
            lo, hi = b / n_bins, (b + 1) / n_bins
            members = [
                i
                for i in range(n)
                if (lo <= probs[i, j] < hi) or (b == n_bins - 1 and probs[i, j] == 1.0)
            ]
            if not members:
                continue
            freq = sum(1.0 for i in members if labels[i] == j) / len(members)
            conf = sum(probs[i, j] for i in members) / len(members)
            total += len(members) / n * abs(freq - conf)
    return total / k


@pytest.mark.parametrize("seed,k,n_bins", [(0, 2, 10), (1, 4, 10), (2, 5, 7), (3, 10, 15)])
def test_cw_ece_matches_brute_force(seed, k, n_bins):
    probs, labels = random_probs(200, k, seed)
    expected = brute_force_cw_ece(probs.numpy(), labels.numpy(), n_bins)
    assert metrics.cw_ece(probs, labels, n_bins=n_bins) == pytest.approx(expected, abs=1e-12)


def test_cw_ece_counts_probabilities_of_exactly_zero_and_one():
    # One-hot predictions: p = 0 goes in the first bin, p = 1 in the last, none are dropped.
    probs = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])
    labels = np.array([0, 0, 0])
    expected = brute_force_cw_ece(probs, labels, 10)
    assert expected > 0
    assert metrics.cw_ece(probs, labels) == pytest.approx(expected)


def test_brier_nll_accuracy_closed_forms():
    probs = np.array([[0.7, 0.2, 0.1], [0.1, 0.3, 0.6], [0.25, 0.5, 0.25]])
    labels = np.array([0, 1, 1])
    assert metrics.accuracy(probs, labels) == pytest.approx(2 / 3)
    brier = ((0.3**2 + 0.2**2 + 0.1**2) + (0.1**2 + 0.7**2 + 0.6**2) + (0.25**2 + 0.5**2 + 0.25**2)) / 3
    assert metrics.brier(probs, labels) == pytest.approx(brier)
    assert metrics.nll(probs, labels) == pytest.approx(-(math.log(0.7) + math.log(0.3) + math.log(0.5)) / 3)
    assert metrics.mean_confidence(probs) == pytest.approx((0.7 + 0.6 + 0.5) / 3)


def test_nll_caps_zero_probability_labels():
    probs = np.array([[1.0, 0.0]])
    assert metrics.nll(probs, np.array([1])) == pytest.approx(-math.log(1e-12))


def test_conf_ece_hand_computed_two_bins():
    # Bin [0.6, 0.7): two samples at 0.65, one right -> |0.5 - 0.65|; bin [0.9, 1]: one at 0.95, right.
    probs = np.array([[0.65, 0.35], [0.65, 0.35], [0.95, 0.05]])
    labels = np.array([0, 1, 0])
    assert metrics.conf_ece(probs, labels) == pytest.approx(2 / 3 * 0.15 + 1 / 3 * 0.05)
    assert metrics.mce(probs, labels) == pytest.approx(0.15)


def test_numpy_and_torch_inputs_agree():
    probs, labels = random_probs(300, 4, 5)
    for name in ("conf_ece", "cw_ece", "mce", "brier", "nll", "accuracy"):
        fn = getattr(metrics, name)
        assert fn(probs, labels) == fn(probs.numpy(), labels.numpy())
    assert metrics.conf_ece(probs.float(), labels.int()) == pytest.approx(
        metrics.conf_ece(probs, labels), abs=1e-6
    )


def test_mass_binning_one_bin_is_the_global_gap():
    probs, labels = random_probs(300, 3, 6)
    gap = abs(metrics.accuracy(probs, labels) - metrics.mean_confidence(probs))
    assert metrics.conf_ece(probs, labels, n_bins=1, binning="mass") == pytest.approx(gap)
    assert metrics.conf_ece(probs, labels, n_bins=1) == pytest.approx(gap)


def test_mass_binning_gives_equal_counts():
    probs, labels = random_probs(400, 3, 7)
    data = metrics.reliability_data(probs, labels, n_bins=8, binning="mass")
    assert data.count.sum() == 400
    assert np.abs(data.count - 50).max() <= 1


# --- hypothesis invariants --------------------------------------------------------------

prob_matrices = st.tuples(
    st.integers(1, 40), st.integers(2, 6), st.integers(0, 2**31 - 1), st.floats(0.1, 8.0)
).map(lambda t: random_probs(t[0], t[1], t[2], sharpness=t[3]))


@settings(max_examples=40, deadline=None)
@given(prob_matrices, st.integers(1, 20))
def test_ece_values_lie_in_unit_interval(data, n_bins):
    probs, labels = data
    for fn in (metrics.conf_ece, metrics.mce, metrics.cw_ece):
        assert 0.0 <= fn(probs, labels, n_bins=n_bins) <= 1.0


@settings(max_examples=40, deadline=None)
@given(prob_matrices, st.randoms(use_true_random=False))
def test_metrics_invariant_to_permuting_samples(data, rnd):
    probs, labels = data
    perm = list(range(len(labels)))
    rnd.shuffle(perm)
    perm = torch.tensor(perm)
    for name in ("conf_ece", "mce", "cw_ece", "brier", "nll", "accuracy"):
        fn = getattr(metrics, name)
        assert fn(probs[perm], labels[perm]) == pytest.approx(fn(probs, labels), abs=1e-12)
    assert metrics.conf_ece(probs[perm], labels[perm], binning="mass") == pytest.approx(
        metrics.conf_ece(probs, labels, binning="mass"), abs=1e-12
    )


@settings(max_examples=40, deadline=None)
@given(prob_matrices, st.randoms(use_true_random=False))
def test_cw_ece_invariant_to_permuting_classes_consistently(data, rnd):
    probs, labels = data
    k = probs.shape[1]
    perm = list(range(k))
    rnd.shuffle(perm)
    inverse = torch.argsort(torch.tensor(perm))
    # Column c of the new matrix is old class perm[c]; an old label j becomes inverse[j].
    assert metrics.cw_ece(probs[:, perm], inverse[labels]) == pytest.approx(
        metrics.cw_ece(probs, labels), abs=1e-12
    )


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 60), st.data())
def test_perfectly_calibrated_construction_has_zero_ece(n, data):
    # n samples all at confidence c = m/n with exactly m correct: every bin is calibrated.
    m = data.draw(st.integers(math.ceil(n / 2), n))
    c = m / n
    probs = torch.tensor([[c, 1 - c]] * n, dtype=torch.float64)
    labels = torch.tensor([0] * m + [1] * (n - m))
    assert metrics.conf_ece(probs, labels) == pytest.approx(0.0, abs=1e-12)
    assert metrics.mce(probs, labels) == pytest.approx(0.0, abs=1e-12)
    assert metrics.cw_ece(probs, labels) == pytest.approx(0.0, abs=1e-12)


# --- bootstrap, reliability data, summary ---------------------------------------------


def test_bootstrap_accuracy_interval_matches_normal_approximation():
    g = torch.Generator().manual_seed(0)
    n = 2000
    probs = torch.tensor([[0.6, 0.4]], dtype=torch.float64).expand(n, 2)  # always class 0
    labels = (torch.rand(n, generator=g) < 0.3).long()  # accuracy ≈ 0.7
    ci = metrics.bootstrap(metrics.accuracy, probs, labels, n=400, seed=1)
    acc = metrics.accuracy(probs, labels)
    half = 1.96 * math.sqrt(acc * (1 - acc) / n)
    assert ci.estimate == pytest.approx(acc)
    assert ci.low < acc < ci.high
    assert (ci.high - ci.low) / 2 == pytest.approx(half, rel=0.2)


def test_bootstrap_is_reproducible_and_accepts_metric_options():
    probs, labels = random_probs(150, 4, 9)
    metric = functools.partial(metrics.conf_ece, n_bins=15)
    a = metrics.bootstrap(metric, probs, labels, n=50, seed=3)
    b = metrics.bootstrap(metric, probs.numpy(), labels.numpy(), n=50, seed=3)
    assert a == b
    assert a.low <= a.high
    assert a.estimate == metrics.conf_ece(probs, labels, n_bins=15)
    with pytest.raises(ValueError, match="level"):
        metrics.bootstrap(metrics.accuracy, probs, labels, level=1.5)


@pytest.mark.parametrize("mode", ["top", "classwise"])
def test_reliability_data_reproduces_ece(mode):
    probs, labels = random_probs(300, 4, 11)
    data = metrics.reliability_data(probs, labels, n_bins=10, mode=mode)
    n_points = 300 if mode == "top" else 1200
    assert data.count.sum() == n_points
    nonempty = data.count > 0
    assert np.isnan(data.confidence[~nonempty]).all()
    assert (data.confidence[nonempty] >= data.bin_lower[nonempty]).all()
    assert (data.confidence[nonempty] <= data.bin_upper[nonempty]).all()
    gap = np.nansum(data.count * np.abs(data.accuracy - data.confidence)) / n_points
    if mode == "top":
        assert gap == pytest.approx(metrics.conf_ece(probs, labels))
    else:
        # Pooling classes inside a bin can only cancel gaps (triangle inequality), so the pooled
        # gap, normalized by N·K, bounds cw-ECE from below.
        assert 0 < gap <= metrics.cw_ece(probs, labels) + 1e-12


def test_summary_has_every_headline_metric():
    probs, labels = random_probs(200, 4, 12)
    s = metrics.summary(probs, labels)
    assert set(s) == {
        "accuracy", "conf_ece", "cw_ece", "mce", "brier", "nll", "mean_confidence", "smooth_ece",
    }
    assert s["conf_ece"] == metrics.conf_ece(probs, labels)
    assert all(isinstance(v, float) for v in s.values())


# --- errors -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "probs,labels,match",
    [
        (np.ones(3) / 3, np.array([0]), "shape"),
        (np.full((2, 2), 0.5), np.array([[0], [1]]), "labels must have shape"),
        (np.full((2, 2), 0.5), np.array([0, 1, 1]), "disagree on N"),
        (np.array([[0.6, 0.6]]), np.array([0]), "sum to 1"),
        (np.array([[2.0, -1.0]]), np.array([0]), r"\[0, 1\]"),
        (np.full((2, 2), 0.5), np.array([0, 2]), "labels must lie"),
        (np.full((2, 2), 0.5), np.array([-1, 0]), "labels must lie"),
        (np.zeros((0, 3)), np.zeros(0, dtype=int), "empty"),
        (np.array([[np.nan, 0.5]]), np.array([0]), "NaN"),
        (np.ones((2, 1)), np.array([0, 0]), "K >= 2"),
    ],
)
def test_clear_errors(probs, labels, match):
    for fn in (metrics.conf_ece, metrics.cw_ece, metrics.brier, metrics.nll):
        with pytest.raises(ValueError, match=match):
            fn(probs, labels)


def test_float_labels_and_bad_options_are_refused():
    probs = np.full((2, 2), 0.5)
    with pytest.raises(TypeError, match="integer dtype"):
        metrics.conf_ece(probs, np.array([0.0, 1.0]))
    with pytest.raises(ValueError, match="n_bins"):
        metrics.conf_ece(probs, np.array([0, 1]), n_bins=0)
    with pytest.raises(ValueError, match="binning"):
        metrics.conf_ece(probs, np.array([0, 1]), binning="quantile")
    with pytest.raises(ValueError, match="mode"):
        metrics.reliability_data(probs, np.array([0, 1]), mode="all")


@pytest.mark.parametrize("n_bins", [7, 10, 15, 20])
def test_a_confidence_exactly_on_an_edge_opens_its_bin(n_bins):
    # Bins are [k/n, (k+1)/n): the value k/n belongs to bin k for every k (linspace edges put
    # 0.3 in [0.2, 0.3) for n = 10, because linspace(0, 1, 11)[3] = 0.30000000000000004).
    from calibration.binning import bin_index

    values = torch.tensor([k / n_bins for k in range(n_bins + 1)], dtype=torch.float64)
    expected = torch.tensor([*range(n_bins), n_bins - 1])
    assert torch.equal(bin_index(values, n_bins), expected)
    # The same through a metric: classwise, p = 0.3 for class 1 belongs to bin [0.3, 0.4).
    data = metrics.reliability_data(np.array([[0.7, 0.3]]), np.array([0]), mode="classwise")
    assert data.count[3] == 1 and data.count[7] == 1 and data.count.sum() == 2


METRICS_WITH_LABELS = [
    metrics.accuracy, metrics.conf_ece, metrics.mce, metrics.cw_ece, metrics.brier, metrics.nll,
]


@pytest.mark.parametrize("metric", METRICS_WITH_LABELS, ids=lambda m: m.__name__)
def test_from_logits_equals_metric_of_the_softmax(metric):
    g = torch.Generator().manual_seed(3)
    logits = 4 * torch.randn(300, 5, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 5, (300,), generator=g)
    expected = metric(logits.softmax(-1), labels)
    assert metric(logits, labels, from_logits=True) == pytest.approx(expected, rel=1e-12)
    # float32 logits and numpy input go through the same float64 softmax
    assert metric(logits.float().numpy(), labels.numpy(), from_logits=True) == pytest.approx(
        expected, rel=1e-5, abs=1e-6
    )


def test_from_logits_allows_absent_classes_and_rejects_bad_rows():
    logits = torch.tensor([[2.0, 0.0, -math.inf], [0.0, 1.0, -math.inf]])
    labels = torch.tensor([0, 1])
    assert metrics.accuracy(logits, labels, from_logits=True) == 1.0
    assert metrics.mean_confidence(logits, from_logits=True) == pytest.approx(
        float(logits.softmax(-1).max(-1).values.double().mean()), rel=1e-6
    )
    iv = metrics.bootstrap(metrics.conf_ece, logits, labels, n=20, from_logits=True)
    assert iv.estimate == pytest.approx(metrics.conf_ece(logits.softmax(-1), labels), rel=1e-6)
    with pytest.raises(ValueError, match="entirely -inf"):
        metrics.accuracy(torch.full((2, 3), -math.inf), labels, from_logits=True)
    with pytest.raises(ValueError, match="NaN"):
        metrics.accuracy(torch.tensor([[math.nan, 0.0], [0.0, 0.0]]), labels, from_logits=True)
    # without the flag, logits are still refused as probabilities (with the usual message)
    with pytest.raises(ValueError):
        metrics.accuracy(torch.tensor([[2.0, -1.0], [0.5, 3.0]]), labels)
