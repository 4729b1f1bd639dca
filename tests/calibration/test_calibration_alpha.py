"""α parameterizations: identity at init, formulas, subsets of a vocabulary, gradients."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from calibration import alpha

CONFIGS = [
    ("identity", {}),
    ("temperature", {}),
    ("temperature", {"positivity": "softplus"}),
    ("class_temperature", {}),
    ("class_temperature", {"positivity": "softplus"}),
    ("shift", {}),
    *[
        ("affine", {"form": f, "positivity": p})
        for f, p in itertools.product(["scale_shift", "shift_scale"], ["log", "softplus"])
    ],
]


def randn(*shape, seed=0, dtype=torch.float64):
    return torch.randn(tuple(shape), generator=torch.Generator().manual_seed(seed), dtype=dtype)


def random_params(p: alpha.Parameterization, k: int, seed: int) -> dict[str, torch.Tensor]:
    return {key: 0.5 * randn(*v.shape, seed=seed + i) for i, (key, v) in enumerate(p.init(k, dtype=torch.float64).items())}


def manual(p: alpha.Parameterization, params, z):
    """The module table, written out independently."""
    tau = None
    if "tau_raw" in params:
        raw = params["tau_raw"]
        tau = raw.exp() if p.positivity == "log" else torch.log1p(raw.exp())
    shift = params.get("shift")
    if tau is not None and shift is not None:
        return z / tau + shift if p.form == "scale_shift" else (z + shift) / tau
    if tau is not None:
        return z / tau
    if shift is not None:
        return z + shift
    return z


def test_registry_lists_the_required_names():
    assert set(alpha.NAMES) >= {"identity", "temperature", "class_temperature", "shift", "affine"}


@pytest.mark.parametrize("name,opts", CONFIGS)
def test_identity_at_init_with_and_without_class_ids(name, opts):
    p = alpha.get(name, **opts)
    z = randn(3, 5)
    params = p.init(5, dtype=torch.float64)
    torch.testing.assert_close(p.apply(params, z), z, rtol=1e-15, atol=1e-15)
    big = randn(2, 3, 50, seed=1)
    ids = torch.tensor([7, 3, 41, 0, 12])
    torch.testing.assert_close(p.apply(params, big, ids), big, rtol=1e-15, atol=1e-15)
    for value in p.constrained(params).values():
        assert torch.allclose(value, torch.ones_like(value)) or torch.all(value == 0)


@pytest.mark.parametrize("name,opts", CONFIGS)
def test_apply_matches_the_formula(name, opts):
    p = alpha.get(name, **opts)
    params = random_params(p, 4, seed=2)
    z = randn(6, 4, seed=3)
    torch.testing.assert_close(p.apply(params, z), manual(p, params, z))


@pytest.mark.parametrize("name,opts", CONFIGS)
def test_class_ids_change_only_the_selected_columns(name, opts):
    p = alpha.get(name, **opts)
    params = random_params(p, 3, seed=4)
    z = randn(2, 5, 20, seed=5)
    ids = torch.tensor([9, 2, 17])
    out = p.apply(params, z, ids)
    others = torch.ones(20, dtype=torch.bool)
    others[ids] = False
    assert torch.equal(out[..., others], z[..., others])
    torch.testing.assert_close(out[..., ids], manual(p, params, z[..., ids]))


@pytest.mark.parametrize("name,opts", [c for c in CONFIGS if c[0] != "identity"])
def test_gradcheck_params_and_logits_with_class_ids(name, opts):
    p = alpha.get(name, **opts)
    base = random_params(p, 3, seed=6)
    keys = sorted(base)
    z = randn(2, 8, seed=7).requires_grad_()
    ids = torch.tensor([5, 1, 6])

    def f(z, *values):
        return p.apply(dict(zip(keys, values)), z, ids)

    inputs = (z, *[base[k].clone().requires_grad_() for k in keys])
    assert torch.autograd.gradcheck(f, inputs)


def test_full_vocabulary_subset_trains_the_params():
    # A 49k vocabulary with 4 option letters: the loss over the letters reaches the params.
    p = alpha.get("affine")
    params = {k: v.requires_grad_() for k, v in p.init(4).items()}
    logits = torch.randn(3, 49152)
    ids = torch.tensor([330, 331, 332, 333])
    out = p.apply(params, logits, ids)
    F.cross_entropy(out[:, ids], torch.tensor([0, 1, 2])).backward()
    assert all(v.grad is not None and v.grad.abs().sum() > 0 for v in params.values())


def test_dtype_of_logits_is_kept():
    p = alpha.get("affine")
    z = torch.randn(2, 10, dtype=torch.bfloat16)
    assert p.apply(p.init(10), z).dtype == torch.bfloat16
    assert p.apply(p.init(3), z, torch.tensor([0, 4, 9])).dtype == torch.bfloat16


def test_scalar_temperature_scales_every_selected_column():
    p = alpha.get("temperature")
    params = {"tau_raw": torch.tensor(torch.log(torch.tensor(2.0)).item())}
    z = torch.tensor([[2.0, 4.0, 6.0]])
    torch.testing.assert_close(p.apply(params, z), torch.tensor([[1.0, 2.0, 3.0]]))
    assert p.init(7)["tau_raw"].shape == ()


def test_errors_are_clear():
    with pytest.raises(ValueError, match="unknown alpha"):
        alpha.get("vector")
    with pytest.raises(ValueError, match="takes options"):
        alpha.get("temperature", form="scale_shift")
    with pytest.raises(ValueError, match="form"):
        alpha.get("affine", form="both")
    with pytest.raises(ValueError, match="positivity"):
        alpha.get("affine", positivity="abs")
    p = alpha.get("affine")
    with pytest.raises(ValueError, match="keys"):
        p.apply({"shift": torch.zeros(3)}, torch.zeros(2, 3))
    with pytest.raises(ValueError, match="shape"):
        p.apply(p.init(4), torch.zeros(2, 3))
    with pytest.raises(ValueError, match="lie in"):
        p.apply(p.init(2), torch.zeros(2, 3), torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="repeat"):
        p.apply(p.init(2), torch.zeros(2, 3), torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="positive integer"):
        p.init(0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_alpha_and_objectives_stay_on_the_gpu():
    from calibration import objectives

    dev = torch.device("cuda")
    p = alpha.get("affine")
    params = {k: v.requires_grad_() for k, v in p.init(4, device=dev).items()}
    logits = torch.randn(2, 3, 1000, device=dev, dtype=torch.bfloat16)
    ids = torch.tensor([10, 20, 30, 40], device=dev)
    out = p.apply(params, logits, ids)
    assert out.device.type == "cuda" and out.dtype == torch.bfloat16
    letters = out[..., ids].float()
    loss = objectives.entropy(letters) + objectives.cross_entropy(letters, torch.zeros(2, 3, dtype=torch.long, device=dev))
    probs = letters.reshape(-1, 4).softmax(-1)
    acc = objectives.estimate_bin_accuracy(probs, torch.zeros(6, dtype=torch.long, device=dev))
    loss = loss + objectives.ece_regularizer(probs, acc)
    loss.backward()
    assert all(v.grad is not None and torch.isfinite(v.grad).all() for v in params.values())


@given(raw=st.floats(-1e6, 1e6, allow_nan=False), tau_max=st.floats(1.01, 1e3))
@settings(max_examples=200, deadline=None)
def test_bounded_tau_stays_inside_its_range(raw, tau_max):
    p = alpha.get("temperature", positivity="bounded", tau_max=tau_max)
    tau = float(p.constrained({"tau_raw": torch.tensor(raw, dtype=torch.float64)})["tau"])
    assert 1.0 / tau_max * (1 - 1e-12) <= tau <= tau_max * (1 + 1e-12)


def test_bounded_tau_survives_adversarial_gradients():
    """SGD with a huge step on a loss that wants τ → ∞ (log) reaches 1e11 at once; bounded stays
    below tau_max whatever the optimizer does, and starts like the log form."""
    z = randn(64, 5, dtype=torch.float32)
    for positivity, stays in (("log", False), ("bounded", True)):
        p = alpha.get("affine", positivity=positivity, tau_max=20.0)
        params = {k: v.requires_grad_(True) for k, v in p.init(5).items()}
        opt = torch.optim.SGD(list(params.values()), lr=1e4)
        for _ in range(20):
            opt.zero_grad()
            # maximizing entropy pushes every τ up without limit
            logp = F.log_softmax(p.apply(params, z), -1)
            (logp.exp() * logp).sum(-1).mean().backward()
            opt.step()
        tau = p.constrained(params)["tau"].detach()
        if stays:
            # tanh saturates to ±1 in float32: the bounds are reached, never passed
            assert bool((tau <= 20.0).all() and (tau >= 1 / 20.0).all() and torch.isfinite(tau).all())
        else:
            assert not bool((tau < 20.0).all())
    # near identity the bounded form is the log form to second order
    b = alpha.get("temperature", positivity="bounded", tau_max=20.0)
    lg = alpha.get("temperature")
    r = {"tau_raw": torch.tensor(0.01, dtype=torch.float64)}
    assert float(b.constrained(r)["tau"]) == pytest.approx(float(lg.constrained(r)["tau"]), rel=1e-6)


@pytest.mark.parametrize("positivity", ["log", "softplus", "bounded"])
def test_deviation_is_zero_at_identity_and_half_squared_distance_away(positivity):
    p = alpha.get("affine", positivity=positivity)
    params = p.init(4, dtype=torch.float64)
    assert float(p.deviation(params)) == 0.0
    moved = {k: v + 0.5 for k, v in params.items()}
    assert float(p.deviation(moved)) == pytest.approx(0.5 * 0.25 * 8)
