"""Post-hoc temperature and vector scaling against scipy's minimizers."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import minimize, minimize_scalar
from scipy.special import log_softmax

from calibration import alpha, posthoc


def synthetic(n: int, k: int, scale: float, seed: int):
    """Labels drawn from softmax(z*); the model reports scale·z* (scale > 1: overconfident)."""
    g = torch.Generator().manual_seed(seed)
    z_true = 1.5 * torch.randn(n, k, generator=g, dtype=torch.float64)
    labels = torch.multinomial(z_true.softmax(-1), 1, generator=g).squeeze(1)
    return scale * z_true, labels


def np_nll(z: np.ndarray, y: np.ndarray) -> float:
    return float(-log_softmax(z, axis=1)[np.arange(len(y)), y].mean())


@pytest.mark.parametrize("scale,seed", [(3.0, 0), (0.4, 1), (1.7, 2), (1.0, 3)])
def test_fitted_temperature_matches_scipy(scale, seed):
    z, y = synthetic(800, 4, scale, seed)
    fit = posthoc.fit_temperature(z, y)
    zn, yn = z.numpy(), y.numpy()
    ref = minimize_scalar(
        lambda s: np_nll(zn * math.exp(-s), yn), bounds=(-5, 5), method="bounded",
        options={"xatol": 1e-10},
    )
    assert fit.temperature == pytest.approx(math.exp(ref.x), abs=1e-4)
    assert fit.nll_after == pytest.approx(ref.fun, abs=1e-10)
    assert fit.nll_after <= fit.nll_before
    assert fit.nll_before == pytest.approx(np_nll(zn, yn))
    assert not fit.at_boundary
    # The synthetic model is scale·z*: the fitted T recovers the scale roughly.
    assert fit.temperature == pytest.approx(scale, rel=0.25)


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 60), st.integers(2, 6), st.integers(0, 10_000), st.floats(0.01, 20.0))
def test_nll_never_increases(n, k, seed, scale):
    g = torch.Generator().manual_seed(seed)
    z = scale * torch.randn(n, k, generator=g)
    y = torch.randint(0, k, (n,), generator=g)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # boundary optima are expected here
        fit = posthoc.fit_temperature(z, y)
        vec = posthoc.fit_vector_scaling(z, y, max_iter=50)
    assert fit.nll_after <= fit.nll_before + 1e-12
    assert vec.nll_after <= vec.nll_before + 1e-12


def test_model_at_chance_runs_to_the_bound_and_warns():
    # Logits carrying no label information: every row appears once with each label. Then
    # NLL(T) = mean_rows[logsumexp(z/T) − mean_j z_j/T], which falls monotonically to ln K.
    g = torch.Generator().manual_seed(4)
    z = (2.0 * torch.randn(100, 4, generator=g)).repeat_interleave(4, dim=0)
    y = torch.arange(4).repeat(100)
    with pytest.warns(UserWarning, match="bound"):
        fit = posthoc.fit_temperature(z, y, log_t_bounds=(-3.0, 4.0))
    assert fit.at_boundary
    assert fit.log_temperature == pytest.approx(4.0, abs=1e-6)
    assert math.log(4) < fit.nll_after < fit.nll_before


def test_narrow_bounds_use_the_bracketed_search():
    z, y = synthetic(400, 3, 3.0, 5)
    with pytest.warns(UserWarning):
        fit = posthoc.fit_temperature(z, y, log_t_bounds=(-0.5, 0.5))
    assert fit.log_temperature == pytest.approx(0.5, abs=1e-6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not posthoc.fit_temperature(z, y).at_boundary


@pytest.mark.parametrize("form", ["scale_shift", "shift_scale"])
def test_vector_scaling_matches_scipy_and_plugs_into_alpha(form):
    z, y = synthetic(600, 3, 2.5, 6)
    z = z + torch.tensor([1.0, -0.5, 0.0], dtype=torch.float64)  # a class bias to undo
    fit = posthoc.fit_vector_scaling(z, y, form=form, dtype=torch.float64)
    p = alpha.get("affine", form=form)
    zn, yn = z.numpy(), y.numpy()

    def objective(theta):
        tau, shift = np.exp(theta[:3]), theta[3:]
        zz = zn / tau + shift if form == "scale_shift" else (zn + shift) / tau
        return np_nll(zz, yn)

    ref = minimize(objective, np.zeros(6), method="L-BFGS-B", options={"ftol": 1e-15, "gtol": 1e-12})
    assert fit.nll_after == pytest.approx(ref.fun, abs=1e-7)
    assert fit.converged
    assert float(F.cross_entropy(p.apply(fit.params, z), y)) == pytest.approx(fit.nll_after)
    # More freedom than one temperature: never a worse fit.
    assert fit.nll_after <= posthoc.fit_temperature(z, y).nll_after + 1e-9


def test_fit_alpha_by_name_and_dtype():
    z, y = synthetic(300, 4, 2.0, 7)
    for name in ("temperature", "class_temperature", "shift", "identity"):
        fit = posthoc.fit_alpha(name, z.float(), y)
        assert fit.name == name
        assert fit.nll_after <= fit.nll_before
        assert all(v.dtype == torch.float32 for v in fit.params.values())
    t = posthoc.fit_alpha("temperature", z, y)
    assert math.exp(float(t.params["tau_raw"])) == pytest.approx(
        posthoc.fit_temperature(z, y).temperature, rel=1e-4
    )


def test_posthoc_errors_are_clear():
    z = torch.randn(4, 3)
    with pytest.raises(ValueError, match="shape"):
        posthoc.fit_temperature(z, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="lie in"):
        posthoc.fit_temperature(z, torch.tensor([0, 1, 2, 3]))
    with pytest.raises(ValueError, match="log_t_bounds"):
        posthoc.fit_temperature(z, torch.tensor([0, 1, 2, 0]), log_t_bounds=(0.5, 2.0))
    with pytest.raises(ValueError, match="NaN"):
        posthoc.fit_temperature(torch.full((2, 3), float("nan")), torch.tensor([0, 1]))
    with pytest.raises(TypeError, match="integer"):
        posthoc.fit_vector_scaling(z, torch.zeros(4))
