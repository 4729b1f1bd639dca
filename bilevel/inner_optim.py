"""Differentiable inner optimizers for unrolled differentiation (``Unrolled``/``ITD``'s
``inner_optimizer``): the update rules of ``torch.optim.SGD`` and ``torch.optim.Adam``
written out of place in plain torch operations, so that reverse mode runs through them.

These are the optimizers *unrolled inside the hypergradient* (the peers are torchopt's
``MetaSGD``/``MetaAdam``, whose functional ``sgd``/``adam`` follow the same rules); they are
not the ``torch.optim`` optimizers that ``bilevel.fit`` uses to apply a step's directions.
The learning rate is the method's ``inner_lr``. Each step is

    SGD(momentum=μ, dampening=τ, nesterov):  b₁ = g₁,  b_t = μ b_{t−1} + (1 − τ) g_t,
        d_t = g_t + μ b_t (nesterov) or b_t,   θ_t = θ_{t−1} − lr · d_t     (μ = 0: d_t = g_t)
    Adam(betas=(β₁, β₂), eps=ε, eps_root=ε_r):  m_t = β₁ m_{t−1} + (1 − β₁) g_t,
        v_t = β₂ v_{t−1} + (1 − β₂) g_t²,  θ_t = θ_{t−1} − lr · m̂_t / (√(v̂_t + ε_r) + ε),
        m̂_t = m_t / (1 − β₁^t),  v̂_t = v_t / (1 − β₂^t)           (Kingma & Ba, ICLR 2015)

with g_t = ∇_θ g(α, θ_{t−1}). For ε_r = 0 this is ``torch.optim.Adam``'s rule (checked in
``tests/bilevel/test_bilevel_inner_optim.py``); ε_r is torchopt's ``eps_root``. Where a
gradient entry is exactly 0 (v̂ = 0), the derivative of √v̂ is taken as 0, not autograd's
1/(2·0) = ∞ times a zero cotangent = NaN (see ``_sqrt0``): the step's true derivative there
comes through m alone, and the hypergradient stays finite with ε_r = 0.
Memory per differentiated step: θ plus the optimizer state (SGD with momentum: one buffer;
Adam: two), all kept in the unrolled graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ._checks import check_nonnegative

__all__ = ["SGD", "Adam", "InnerOptimizer"]

State = Any


@dataclass(frozen=True)
class SGD:
    """Gradient descent with optional heavy-ball or Nesterov momentum (``torch.optim.SGD``'s
    rule, module docstring). ``SGD()`` is plain gradient descent, the default of
    ``Unrolled``/``ITD``."""

    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False

    def __post_init__(self) -> None:
        check_nonnegative("SGD", "momentum", self.momentum)
        check_nonnegative("SGD", "dampening", self.dampening)
        if not isinstance(self.nesterov, bool):
            raise TypeError(f"SGD: nesterov must be a bool, got {self.nesterov!r}")
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ValueError(
                "SGD: nesterov=True needs momentum > 0 and dampening = 0 (as torch.optim.SGD), "
                f"got momentum={self.momentum}, dampening={self.dampening}"
            )

    @property
    def plain(self) -> bool:
        """True for plain gradient descent (no state)."""
        return self.momentum == 0

    def init(self, theta: list[torch.Tensor]) -> State:
        """No buffer until the first step (``torch.optim.SGD`` sets b₁ = g₁)."""
        return None

    def step(
        self, theta: list[torch.Tensor], grads: list[torch.Tensor], state: State, lr: float
    ) -> tuple[list[torch.Tensor], State]:
        """θ_t and the new momentum buffer, out of place (differentiable)."""
        if self.momentum == 0:  # self.plain, inlined: this runs once per unrolled step
            return [th - lr * g for th, g in zip(theta, grads)], None
        if state is None:
            buf = list(grads)
        else:
            buf = [self.momentum * b + (1 - self.dampening) * g for b, g in zip(state, grads)]
        if self.nesterov:
            direction = [g + self.momentum * b for g, b in zip(grads, buf)]
        else:
            direction = buf
        return [th - lr * d for th, d in zip(theta, direction)], buf


@dataclass(frozen=True)
class Adam:
    """Adam (``torch.optim.Adam``'s rule for ``eps_root = 0``; torchopt's ``eps_root``
    otherwise; module docstring)."""

    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    eps_root: float = 0.0

    def __post_init__(self) -> None:
        if not (isinstance(self.betas, tuple) and len(self.betas) == 2):
            raise TypeError(f"Adam: betas must be a tuple (β₁, β₂), got {self.betas!r}")
        for i, b in enumerate(self.betas):
            if isinstance(b, bool) or not isinstance(b, (int, float)) or not 0 <= b < 1:
                raise ValueError(f"Adam: betas[{i}] must be a number in [0, 1), got {b!r}")
        check_nonnegative("Adam", "eps", self.eps)
        check_nonnegative("Adam", "eps_root", self.eps_root)
        if self.eps == 0 and self.eps_root == 0:
            raise ValueError(
                "Adam: eps and eps_root are both 0, so an all-zero gradient entry divides 0 by "
                "0; set eps > 0 (torch.optim.Adam: 1e-8)"
            )

    plain = False  # a class attribute, not a field: Adam always has state

    def init(self, theta: list[torch.Tensor]) -> State:
        """(t, m, v) with zero moments."""
        return 0, [torch.zeros_like(x) for x in theta], [torch.zeros_like(x) for x in theta]

    def step(
        self, theta: list[torch.Tensor], grads: list[torch.Tensor], state: State, lr: float
    ) -> tuple[list[torch.Tensor], State]:
        """θ_t and (t, m_t, v_t), out of place (differentiable)."""
        t, m, v = state
        t += 1
        b1, b2 = self.betas
        m = [b1 * mi + (1 - b1) * g for mi, g in zip(m, grads)]
        v = [b2 * vi + (1 - b2) * g * g for vi, g in zip(v, grads)]
        c1, c2 = 1 - b1**t, 1 - b2**t
        # lr·m̂/(√(v̂ + ε_r) + ε) with the bias corrections as Python floats
        out = [
            th - (lr / c1) * mi / (_sqrt0(vi / c2 + self.eps_root) + self.eps)
            for th, mi, vi in zip(theta, m, v)
        ]
        return out, (t, m, v)


def _sqrt0(x: torch.Tensor) -> torch.Tensor:
    """√x with derivative 0 instead of ∞ where x = 0 (the forward value is exactly √x).

    Where a gradient entry is exactly 0, v = 0 and autograd's derivative of √v is
    1/(2·0) = ∞, multiplied by a zero cotangent: NaN, which then poisons the whole
    hypergradient. The derivative of the step through v there is truly 0 (v = Σ(1 − β₂)g²
    has derivative 2(1 − β₂)g = 0 at g = 0, and the product's limit is 0), so the "double
    where" gives the correct total derivative, 1/ε per unit of g through m."""
    positive = x > 0
    return torch.where(positive, torch.where(positive, x, torch.ones_like(x)).sqrt(), torch.zeros_like(x))


InnerOptimizer = SGD | Adam
"""The inner optimizers ``ITD`` and ``Unrolled`` can differentiate through."""


def detach_state(state: State) -> State:
    """The optimizer state with every tensor detached (the start of a truncation window)."""
    if isinstance(state, torch.Tensor):
        return state.detach()
    if isinstance(state, (list, tuple)):
        return type(state)(detach_state(s) for s in state)
    return state


def check_inner_optimizer(owner: str, value: object) -> None:
    """TypeError naming ``owner`` unless ``value`` is ``bilevel.SGD`` or ``bilevel.Adam``."""
    if not isinstance(value, (SGD, Adam)):
        raise TypeError(
            f"{owner}: inner_optimizer must be bilevel.SGD(...) or bilevel.Adam(...) (the "
            f"differentiable update unrolled inside the hypergradient), got "
            f"{type(value).__name__}; a torch.optim optimizer is what bilevel.fit takes instead"
        )
