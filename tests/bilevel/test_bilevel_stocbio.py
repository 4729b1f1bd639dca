"""AID with a fresh lower batch per Neumann term (and per inner step): stocBiO (Ji, Yang & Liang,
ICML 2021). With the same batch every time it is plain AID bit for bit; over every equally
likely batch sequence of a finite sum its average is the full-batch Neumann estimate, exactly
(enumerated, not sampled), because each Neumann term and each inner step is a product of
independent factors. Problem: the finite-sum quadratic of test_bilevel_saba (closed forms)."""

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import bilevel
from bilevel import linalg
from tests.bilevel.test_bilevel_saba import DA, DT, F64, LOWER, PROBLEM, UPPER


def _point(seed):
    gen = torch.Generator().manual_seed(seed)
    return ({"a": torch.randn(DA, generator=gen, dtype=F64)},
            {"theta": torch.randn(DT, generator=gen, dtype=F64)})


@settings(max_examples=6, deadline=None)
@given(st.integers(0, 2**16), st.integers(0, 3), st.integers(0, 4), st.booleans())
def test_the_same_batch_every_term_is_plain_neumann_exactly(seed, inner_steps, terms, warm):
    a, t = _point(seed)
    neumann = linalg.Neumann(steps=terms, lr=0.2)
    batch = LOWER[seed % len(LOWER)]
    plain = bilevel.AID(inner_steps, 0.1, linear_solver=neumann, warm_start=warm)
    fresh = bilevel.AID(inner_steps, 0.1, linear_solver=neumann, warm_start=warm,
                        lower_batches=lambda: batch, fresh_inner_steps=True)
    for _ in range(2):  # the second step exercises the warm start (one matvec more)
        r1 = plain.step(PROBLEM, a, t, upper_batch=UPPER, lower_batch=batch)
        r2 = fresh.step(PROBLEM, a, t, upper_batch=UPPER, lower_batch=batch)
        for x, y in ((r1.outer_grad["a"], r2.outer_grad["a"]),
                     (r1.inner_grad["theta"], r2.inner_grad["theta"]),
                     (r1.inner_solution["theta"], r2.inner_solution["theta"])):
            assert torch.equal(x, y)
        assert r1.info == r2.info


@pytest.mark.parametrize("inner_steps, fresh_inner, terms", [(0, False, 3), (2, True, 2), (3, False, 2)])
def test_fresh_batches_average_to_the_full_batch_neumann_estimate(inner_steps, fresh_inner, terms):
    # n = 4 lower batches; every sequence of draws (4^(T + Q) of them, T only with fresh inner
    # steps) is equally likely, so their average is the expectation, computed exactly.
    a, t = _point(7)
    neumann = linalg.Neumann(steps=terms, lr=0.2)
    draws = (inner_steps if fresh_inner else 0) + terms
    total = torch.zeros(DA, dtype=F64)
    sequences = list(itertools.product(range(len(LOWER)), repeat=draws))
    for seq in sequences:
        source = iter(seq)
        solver = bilevel.AID(inner_steps, 0.1, linear_solver=neumann, fresh_inner_steps=fresh_inner,
                             lower_batches=lambda source=source: LOWER[next(source)])
        r = solver.step(PROBLEM, a, t, upper_batch=UPPER, lower_batch=LOWER)
        assert next(source, None) is None  # every draw was used: one per term (and step)
        total += r.outer_grad["a"]
    full = bilevel.AID(inner_steps, 0.1, linear_solver=neumann)
    expected = full.step(PROBLEM, a, t, upper_batch=UPPER, lower_batch=LOWER).outer_grad["a"]
    assert torch.allclose(total / len(sequences), expected, rtol=1e-11, atol=1e-13)
    # ... and a single sequence is not the full-batch estimate (the batches do differ)
    assert not torch.allclose(r.outer_grad["a"], expected, rtol=1e-3)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"lower_batches": [1, 2]}, TypeError, r"AID: lower_batches must be a callable \(\) -> batch"),
        ({"lower_batches": lambda: None}, ValueError,
         r"AID: lower_batches draws a fresh batch per Neumann term .* use linear_solver=bilevel.linalg.Neumann"),
        ({"fresh_inner_steps": True}, ValueError, r"AID: fresh_inner_steps=True needs lower_batches"),
        ({"fresh_inner_steps": 1, "linear_solver": linalg.Neumann(2, 0.1), "lower_batches": lambda: None},
         TypeError, r"AID: fresh_inner_steps must be a bool, got 1"),
    ],
)
def test_fresh_batch_options_are_checked_at_construction(kwargs, error, match):
    with pytest.raises(error, match=match):
        bilevel.AID(2, 0.1, **kwargs)


def test_an_exhausted_batch_source_is_a_clear_error():
    a, t = _point(0)
    source = iter(LOWER[:2])  # two batches for three Neumann terms
    aid = bilevel.AID(0, 0.1, linear_solver=linalg.Neumann(3, 0.2), lower_batches=lambda: next(source))
    with pytest.raises(RuntimeError, match=r"AID.step: lower_batches ran out of batches .* itertools.cycle"):
        aid.step(PROBLEM, a, t, upper_batch=UPPER, lower_batch=LOWER)
