"""Inputs the calibration package used to accept silently or reject wrongly: integer logits for
α, undefined rows in the entropy, bfloat16 probabilities, probabilities given as logits, and a
reliability PNG cut short by a full disk."""

from __future__ import annotations

import errno
import math
import os

import numpy as np
import pytest
import torch

from calibration import alpha, metrics, objectives, posthoc
from calibration._checks import ROW_SUM_ATOL, check_probs, row_sum_tolerance

NEG_INF = float("-inf")


# -- α on integer logits ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["identity", "temperature", "affine"])
def test_alpha_refuses_integer_logits_instead_of_truncating(name):
    p = alpha.get(name)
    params = p.init(2)
    if "tau_raw" in params:
        params["tau_raw"] = params["tau_raw"] + math.log(2.0)  # τ = 2: 3 / 2 would become 1
    with pytest.raises(TypeError, match=rf"alpha '{name}': logits must have a floating-point "
                                        r"dtype, got torch.int64 .* pass logits.float\(\)"):
        p.apply(params, torch.tensor([[3, 1]]))
    out = p.apply(params, torch.tensor([[3.0, 1.0]]))
    assert out.dtype == torch.float32


# -- entropy of rows with no defined softmax -------------------------------------------------------
@pytest.mark.parametrize(("bad", "what", "where"), [
    ([NEG_INF, NEG_INF, NEG_INF], "has no finite logit", "1"),
    ([0.0, float("nan"), 1.0], "contains NaN", "1"),
    ([0.0, float("inf"), 1.0], r"contains \+inf", "1"),
])
def test_entropy_refuses_a_row_with_no_defined_softmax_naming_it(bad, what, where):
    z = torch.tensor([[0.0, 1.0, 2.0], bad, [1.0, NEG_INF, 0.0]], dtype=torch.float64)
    with pytest.raises(ValueError, match=rf"entropy: logits row {where} {what}"):
        objectives.entropy(z)
    # a masked-out row may be anything (padding); a single -inf is a class of probability 0
    keep = torch.tensor([True, False, True])
    assert torch.isfinite(objectives.entropy(z, keep))


def test_entropy_names_the_row_of_a_batched_input_and_is_a_floating_point_error():
    z = torch.zeros(2, 3, 4)
    z[1, 2] = NEG_INF
    with pytest.raises(objectives.NonFiniteLogits, match=r"row \(1, 2\) has no finite logit") as e:
        objectives.entropy(z)
    # a training loop that stops on FloatingPointError (the app's NonFiniteLoss) stops on it too
    assert isinstance(e.value, FloatingPointError) and isinstance(e.value, ValueError)


# -- the row-sum tolerance follows the dtype -------------------------------------------------------
def test_bfloat16_probabilities_pass_the_row_sum_check():
    p = torch.tensor([[0.5, 0.3, 0.2024]], dtype=torch.float64).to(torch.bfloat16)
    assert abs(float(p.double().sum()) - 1) > ROW_SUM_ATOL  # what the old fixed tolerance refused
    check_probs(p)
    g = torch.Generator().manual_seed(0)
    z = 3 * torch.randn(500, 5, generator=g)
    probs = z.softmax(-1).to(torch.bfloat16)
    y = torch.randint(0, 5, (500,), generator=g)
    assert 0 <= metrics.conf_ece(probs, y) <= 1
    # the same sums in float32 are still refused, and unnormalized bf16 scores still are
    with pytest.raises(ValueError, match=r"tolerance 0.001\); row 0 sums to 1.00"):
        check_probs(p.float())
    with pytest.raises(ValueError, match=r"tolerance 0.0156\); row 0 sums to 1.1"):
        check_probs(torch.tensor([[0.6, 0.5]], dtype=torch.bfloat16))


def test_row_sum_tolerance_per_dtype():
    assert row_sum_tolerance(torch.bfloat16) == 2 * torch.finfo(torch.bfloat16).eps
    assert row_sum_tolerance(torch.float16) == row_sum_tolerance(np.float16) == 2 * 2.0**-10
    assert row_sum_tolerance(torch.float32) == row_sum_tolerance(np.float64) == ROW_SUM_ATOL
    assert row_sum_tolerance(torch.int64) == ROW_SUM_ATOL


# -- probabilities passed where logits belong ------------------------------------------------------
def test_fit_temperature_says_so_when_given_probabilities():
    g = torch.Generator().manual_seed(0)
    z = 2 * torch.randn(200, 4, generator=g, dtype=torch.float64)
    y = torch.multinomial(z.softmax(-1), 1, generator=g).squeeze(1)
    with pytest.raises(ValueError, match=r"fit_temperature: these look like probabilities, not "
                                         r"logits .* or log\(probs\)"):
        posthoc.fit_temperature(z.softmax(-1), y)
    with pytest.raises(ValueError, match="fit_alpha: these look like probabilities"):
        posthoc.fit_vector_scaling(z.softmax(-1), y)
    fit = posthoc.fit_temperature(z.softmax(-1).log(), y)  # log-probabilities are logits
    assert fit.temperature == pytest.approx(1.0, rel=0.2)


# -- a reliability PNG is written whole or not at all ----------------------------------------------
def test_a_full_disk_while_saving_a_plot_keeps_the_previous_png(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    from calibration import plots

    g = torch.Generator().manual_seed(0)
    z = 2 * torch.randn(100, 3, generator=g)
    curves = {"m": (z.softmax(-1), torch.randint(0, 3, (100,), generator=g))}
    out = plots.reliability_diagram(curves, tmp_path / "r.png")
    before = out.read_bytes()
    real = Figure.savefig

    def full_disk(self, fname, *args, **kwargs):
        real(self, fname, *args, **kwargs)  # the bytes go out, but only a part lands
        if hasattr(fname, "truncate"):
            fname.truncate(100)
        else:  # saved in place, to a path
            with open(fname, "r+b") as fh:
                fh.truncate(100)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", full_disk)
    with pytest.raises(OSError, match="No space left"):
        plots.reliability_diagram(curves, out, title="again")
    assert out.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["r.png"]  # the cut temporary file is gone
    monkeypatch.setattr(Figure, "savefig", real)
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o666 & ~umask  # what a plain savefig would give


@pytest.mark.parametrize("metric", ["conf_ece", "cw_ece", "mce"])
def test_a_huge_bin_count_is_refused_by_name_before_anything_is_allocated(metric):
    import calibration.metrics as M

    p = torch.softmax(torch.randn(8, 3, dtype=torch.float64), -1)
    y = torch.arange(8) % 3
    with pytest.raises(ValueError, match=r"n_bins=1000000000000 is above the bound of 1,000,000"):
        getattr(M, metric)(p, y, n_bins=10**12)
    getattr(M, metric)(p, y, n_bins=10**6)  # the bound itself is accepted
