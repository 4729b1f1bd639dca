"""α parameterizations: plug-in logit transforms that CALM (and post-hoc scaling) learn.

Each parameterization is a pair of pure functions, as optax does for optimizers:

    params = p.init(K)                        # dict[str, Tensor]; identity transform at init
    z_new  = p.apply(params, logits)          # acts on the last axis of logits (..., K)
    z_new  = p.apply(params, logits, class_ids)   # logits (..., V); only columns class_ids (K,)
                                                  # change, the other V − K are passed through

Registry (``get(name, **options)``):

=====================  ==========================  =========================================
name                   params                      transform of the K selected logits z
=====================  ==========================  =========================================
``identity``           {}                          z
``temperature``        tau_raw: ()                 z / τ               (one scalar τ)
``class_temperature``  tau_raw: (K,)               z_j / τ_j
``shift``              shift: (K,)                 z_j + l_j
``affine``             tau_raw: (K,), shift: (K,)  z_j / τ_j + l_j     (form="scale_shift", default)
                                                   (z_j + l_j) / τ_j   (form="shift_scale")
=====================  ==========================  =========================================

τ = exp(tau_raw) (``positivity="log"``, default), softplus(tau_raw) (``positivity="softplus"``:
grows linearly, so no step size sends τ to 1e11 through exp) or exp(b·tanh(tau_raw / b)) with
b = log(tau_max) (``positivity="bounded"``: τ ∈ [1/tau_max, tau_max] whatever the optimizer does,
and ≈ exp(tau_raw) near identity); all start at τ = 1, l = 0. ``deviation(params)`` is
½‖params − identity‖², the prior that pulls α back to the identity transform. The default affine form z/τ + l is a reconstruction (the CALM paper
does not publish its form): it keeps the transform linear in (1/τ, l), so the NLL of post-hoc
fitting is convex in those, and the shift reads directly as a log-prior correction.

Dtype: the transform is computed in the promoted dtype of logits and params and cast back to
``logits.dtype``, so a bfloat16 model stays bfloat16. With ``class_ids`` the result is one
out-of-place ``index_copy`` of the logits (one full-vocabulary copy, needed for autograd).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F

__all__ = ["NAMES", "Parameterization", "get"]

Params = dict[str, torch.Tensor]
Form = Literal["scale_shift", "shift_scale"]
Positivity = Literal["log", "softplus", "bounded"]
POSITIVITIES: tuple[str, ...] = ("log", "softplus", "bounded")

# softplus(x) = 1  <=>  x = log(e − 1): the raw value that starts τ at exactly 1.
_SOFTPLUS_ONE = math.log(math.e - 1.0)


def _tau(raw: torch.Tensor, positivity: Positivity, tau_max: float = 20.0) -> torch.Tensor:
    if positivity == "log":
        return raw.exp()
    if positivity == "softplus":
        return F.softplus(raw)
    b = math.log(tau_max)  # log τ = b·tanh(raw / b): slope 1 at identity, |log τ| < b always
    return (b * torch.tanh(raw / b)).exp()


def _raw_one(positivity: Positivity) -> float:
    return _SOFTPLUS_ONE if positivity == "softplus" else 0.0


@dataclass(frozen=True)
class Parameterization:
    """A named logit transform: ``init(K, dtype=, device=) -> params`` and
    ``apply(params, logits, class_ids=None) -> logits``; ``constrained(params)`` returns the
    human-readable values (τ, l) for logging."""

    name: str
    form: Form = "scale_shift"
    positivity: Positivity = "log"
    has_tau: bool = False
    per_class_tau: bool = False
    has_shift: bool = False
    tau_max: float = 20.0
    _keys: tuple[str, ...] = field(default=(), repr=False)

    def init(
        self, K: int, *, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None
    ) -> Params:
        """Parameters of the identity transform for K classes (K ignored by scalar forms)."""
        if isinstance(K, bool) or not isinstance(K, int) or K < 1:
            raise ValueError(f"K must be a positive integer, got {K!r}")
        params: Params = {}
        if self.has_tau:
            shape = (K,) if self.per_class_tau else ()
            params["tau_raw"] = torch.full(shape, _raw_one(self.positivity), dtype=dtype, device=device)
        if self.has_shift:
            params["shift"] = torch.zeros(K, dtype=dtype, device=device)
        return params

    def constrained(self, params: Params) -> dict[str, torch.Tensor]:
        """{"tau": τ, "shift": l} for the entries this parameterization has."""
        self._check_keys(params)
        out = {}
        if self.has_tau:
            out["tau"] = _tau(params["tau_raw"], self.positivity, self.tau_max)
        if self.has_shift:
            out["shift"] = params["shift"]
        return out

    def deviation(self, params: Params) -> torch.Tensor:
        """½ Σ (params − identity)² over every entry: 0 at the identity transform.

        Added to an objective with weight δ it is a Gaussian prior centred on "no change"
        (an L2 decay towards identity rather than towards zero, which for τ = exp(0) = 1 is
        the same point in the log parameterization but not in the softplus one).
        """
        self._check_keys(params)
        total = None
        for key, value in params.items():
            centre = _raw_one(self.positivity) if key == "tau_raw" else 0.0
            term = 0.5 * (value - centre).square().sum()
            total = term if total is None else total + term
        if total is None:
            return torch.zeros(())
        return total

    def apply(
        self, params: Params, logits: torch.Tensor, class_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Transform the last axis of ``logits`` (..., V).

        class_ids=None: every column is transformed and per-class params must have shape (V,).
        class_ids (K,) int: only those columns are transformed (params of shape (K,), in the
        order of class_ids); the rest of the vocabulary is returned unchanged. Differentiable
        in params and logits.
        """
        if not logits.is_floating_point():
            # the result is cast back to logits.dtype: z / τ on int logits would be truncated
            raise TypeError(
                f"alpha {self.name!r}: logits must have a floating-point dtype, got {logits.dtype} "
                "(the transform is cast back to it, so integers would be truncated); pass "
                "logits.float()"
            )
        self._check_keys(params)
        if not self._keys:
            return logits
        if logits.ndim < 1:
            raise ValueError("logits must have at least one axis (the class axis)")
        v = logits.shape[-1]
        if class_ids is None:
            k = v
        else:
            class_ids = _check_class_ids(class_ids, v, logits.device)
            k = class_ids.numel()
        self._check_shapes(params, k)
        z = logits if class_ids is None else logits.index_select(-1, class_ids)
        out = self._transform(params, z).to(logits.dtype)
        if class_ids is None:
            return out
        return logits.index_copy(logits.ndim - 1, class_ids, out)

    def _transform(self, params: Params, z: torch.Tensor) -> torch.Tensor:
        tau = _tau(params["tau_raw"], self.positivity, self.tau_max) if self.has_tau else None
        shift = params["shift"] if self.has_shift else None
        if tau is not None and shift is not None and self.form == "shift_scale":
            return (z + shift) / tau
        if tau is not None:
            z = z / tau
        if shift is not None:
            z = z + shift
        return z

    def _check_keys(self, params: Params) -> None:
        if set(params) != set(self._keys):
            raise ValueError(
                f"alpha {self.name!r} expects params with keys {sorted(self._keys)}, "
                f"got {sorted(params)}"
            )

    def _check_shapes(self, params: Params, k: int) -> None:
        for key, value in params.items():
            expected = () if (key == "tau_raw" and not self.per_class_tau) else (k,)
            if tuple(value.shape) != expected:
                raise ValueError(
                    f"alpha {self.name!r}: params[{key!r}] has shape {tuple(value.shape)}, "
                    f"expected {expected} for {k} transformed classes"
                )


def _check_class_ids(class_ids: torch.Tensor, v: int, device: torch.device) -> torch.Tensor:
    ids = torch.as_tensor(class_ids, device=device)
    if ids.ndim != 1 or ids.numel() == 0:
        raise ValueError(f"class_ids must be a non-empty 1-D tensor, got shape {tuple(ids.shape)}")
    if ids.is_floating_point() or ids.dtype == torch.bool:
        raise TypeError(f"class_ids must have an integer dtype, got {ids.dtype}")
    ids = ids.long()
    if (ids < 0).any() or (ids >= v).any():
        raise ValueError(f"class_ids must lie in [0, {v}) (the logits' last axis)")
    if ids.unique().numel() != ids.numel():
        raise ValueError("class_ids must not repeat a class (index_copy would be ambiguous)")
    return ids


_FACTORIES: dict[str, Callable[..., Parameterization]] = {}
_OPTIONS: dict[str, set[str]] = {}


def _register(name: str, options: set[str]) -> Callable:
    def deco(fn: Callable[..., Parameterization]) -> Callable[..., Parameterization]:
        _FACTORIES[name] = fn
        _OPTIONS[name] = options
        return fn

    return deco


def _check_positivity(positivity: str, tau_max: float = 20.0) -> None:
    if positivity not in POSITIVITIES:
        raise ValueError(f"positivity must be one of {POSITIVITIES}, got {positivity!r}")
    if not (isinstance(tau_max, int | float) and math.isfinite(tau_max) and tau_max > 1.0):
        raise ValueError(f"tau_max must be a finite number > 1, got {tau_max!r}")


@_register("identity", set())
def _identity() -> Parameterization:
    return Parameterization(name="identity")


@_register("temperature", {"positivity", "tau_max"})
def _temperature(positivity: Positivity = "log", tau_max: float = 20.0) -> Parameterization:
    _check_positivity(positivity, tau_max)
    return Parameterization(
        name="temperature", positivity=positivity, has_tau=True, tau_max=float(tau_max),
        _keys=("tau_raw",),
    )


@_register("class_temperature", {"positivity", "tau_max"})
def _class_temperature(positivity: Positivity = "log", tau_max: float = 20.0) -> Parameterization:
    _check_positivity(positivity, tau_max)
    return Parameterization(
        name="class_temperature",
        positivity=positivity,
        tau_max=float(tau_max),
        has_tau=True,
        per_class_tau=True,
        _keys=("tau_raw",),
    )


@_register("shift", set())
def _shift() -> Parameterization:
    return Parameterization(name="shift", has_shift=True, _keys=("shift",))


@_register("affine", {"form", "positivity", "tau_max"})
def _affine(
    form: Form = "scale_shift", positivity: Positivity = "log", tau_max: float = 20.0
) -> Parameterization:
    _check_positivity(positivity, tau_max)
    if form not in ("scale_shift", "shift_scale"):
        raise ValueError(f"form must be 'scale_shift' (z/τ + l) or 'shift_scale' ((z + l)/τ), got {form!r}")
    return Parameterization(
        name="affine",
        form=form,
        positivity=positivity,
        tau_max=float(tau_max),
        has_tau=True,
        per_class_tau=True,
        has_shift=True,
        _keys=("tau_raw", "shift"),
    )


NAMES: tuple[str, ...] = tuple(_FACTORIES)


def get(name: str, **options: str | float) -> Parameterization:
    """The parameterization registered as ``name`` (see the module table), with ``options``
    (``form`` for "affine"; ``positivity`` and ``tau_max`` for those with a temperature)."""
    if name not in _FACTORIES:
        raise ValueError(f"unknown alpha parameterization {name!r}; choose one of {list(NAMES)}")
    unknown = set(options) - _OPTIONS[name]
    if unknown:
        raise ValueError(
            f"alpha {name!r} takes options {sorted(_OPTIONS[name]) or 'none'}; got {sorted(unknown)}"
        )
    return _FACTORIES[name](**options)
