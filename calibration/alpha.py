"""α parameterizations: plug-in logit transforms that CALM (and post-hoc scaling) learn.

Each parameterization is one small object with pure functions, as optax does for optimizers
(the `Parameterization` protocol):

    p      = get("affine", form="scale_shift")    # or Affine(form="scale_shift")
    params = p.init(K)                        # dict[str, Tensor]; identity transform at init
    z_new  = p.apply(params, logits)          # acts on the last axis of logits (..., K)
    z_new  = p.apply(params, logits, class_ids)   # logits (..., V); only columns class_ids (K,)
                                                  # change, the other V − K are passed through
    z      = p.invert(params, z_new)          # the logits that apply maps to z_new
    p.options()                               # {"form": ..., "positivity": ..., "tau_max": ...}

``invert`` is defined for every parameterization below (τ > 0 makes each one a bijection of
the logits); a user's parameterization that is not invertible leaves `Transform.inverse`
unimplemented, and its ``invert`` raises NotImplementedError.

Registry (``get(name, **options)``; the names and options live in `calibration.alpha_table`,
torch-free, so a CLI can list them; `register` adds one):

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
½‖params − identity‖², the prior that pulls α back to the identity transform. The default
affine form z/τ + l is a reconstruction (the CALM paper does not publish its form): it keeps
the transform linear in (1/τ, l), so the NLL of post-hoc fitting is convex in those, and the
shift reads directly as a log-prior correction.

Dtype: the transform is computed in the promoted dtype of logits and params and cast back to
``logits.dtype``, so a bfloat16 model stays bfloat16. With ``class_ids`` the result is one
out-of-place ``index_copy`` of the logits (one full-vocabulary copy, needed for autograd).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Literal, Protocol, runtime_checkable

import torch
import torch.nn.functional as F

from calibration import alpha_table
from calibration.alpha_table import NAMES, POSITIVITIES, TEMPERATURE_OPTIONS, Option

__all__ = [
    "NAMES",
    "POSITIVITIES",
    "TEMPERATURE_OPTIONS",
    "Affine",
    "ClassTemperature",
    "Identity",
    "Option",
    "Parameterization",
    "Shift",
    "Temperature",
    "Transform",
    "get",
    "register",
]

Params = dict[str, torch.Tensor]
Form = Literal["scale_shift", "shift_scale"]
Positivity = Literal["log", "softplus", "bounded"]

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


@runtime_checkable
class Parameterization(Protocol):
    """What the apps (and `calibration.posthoc`) need of an α parameterization.

    ``init(K, dtype=, device=) -> params`` the identity transform for K classes;
    ``apply(params, logits, class_ids=None) -> logits`` the transform of the last axis;
    ``invert(params, logits, class_ids=None) -> logits`` its inverse (NotImplementedError
    where it has none); ``constrained(params)`` the human-readable values (τ, l) for logging;
    ``deviation(params)`` ½‖params − identity‖²; ``options()`` the options it was built with
    (``get(name, **p.options())`` rebuilds it, which is how an export records it).
    """

    name: str

    def init(self, K: int, *, dtype: torch.dtype = ..., device: Any = ...) -> Params: ...

    def apply(self, params: Params, logits: torch.Tensor,
              class_ids: torch.Tensor | None = None) -> torch.Tensor: ...

    def invert(self, params: Params, logits: torch.Tensor,
               class_ids: torch.Tensor | None = None) -> torch.Tensor: ...

    def constrained(self, params: Params) -> dict[str, torch.Tensor]: ...

    def deviation(self, params: Params) -> torch.Tensor: ...

    def options(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class Transform:
    """The shared machinery of a parameterization; a subclass (a frozen dataclass whose fields
    are its options) defines only

    ``layout(K) -> {key: (shape, identity value of the raw entry)}``,
    ``forward(params, z) -> z'`` on the K selected columns z (..., K), and optionally
    ``inverse(params, z') -> z`` and ``constrained(params)``.

    `Transform` checks the keys and shapes, selects ``class_ids`` and writes them back with
    one ``index_copy``, casts to the logits' dtype, and provides ``deviation`` and ``options``.
    The options of a registered name are normalized by its `alpha_table` entry on
    construction (aliases mapped, values checked).

    ``name`` is read from the table (`alpha_table.name_of`): the name is given once, at
    registration, so a subclass cannot export itself under its parent's name.
    """

    @property
    def name(self) -> str:
        """The name this class is registered under (what an export records and reloads)."""
        registered = alpha_table.name_of(type(self))
        return registered if registered is not None else f"<unregistered {type(self).__name__}>"

    def __post_init__(self) -> None:
        if self.name in alpha_table.SPECS:
            for key, value in alpha_table.resolve(self.name, self.options()).items():
                object.__setattr__(self, key, value)

    # -- what a subclass defines ------------------------------------------------------------
    def layout(self, K: int) -> dict[str, tuple[tuple[int, ...], float]]:
        """{key: (shape, raw value at identity)} of the params for K classes."""
        return {}

    def forward(self, params: Params, z: torch.Tensor) -> torch.Tensor:
        """The transform of the selected logits z (..., K)."""
        return z

    def inverse(self, params: Params, z: torch.Tensor) -> torch.Tensor:
        """The z that ``forward`` maps to the given logits (NotImplementedError: none)."""
        raise NotImplementedError(f"alpha {self.name!r} defines no inverse")

    def constrained(self, params: Params) -> dict[str, torch.Tensor]:
        """The params as a human reads them (the raw ones unless a subclass says otherwise)."""
        self._check_keys(params)
        return dict(params)

    # -- shared -----------------------------------------------------------------------------
    def options(self) -> dict[str, Any]:
        """The options this parameterization was built with (its dataclass fields)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def init(
        self, K: int, *, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None
    ) -> Params:
        """Parameters of the identity transform for K classes (K ignored by scalar forms)."""
        if isinstance(K, bool) or not isinstance(K, int) or K < 1:
            raise ValueError(f"K must be a positive integer, got {K!r}")
        return {
            key: torch.full(shape, value, dtype=dtype, device=device)
            for key, (shape, value) in self.layout(K).items()
        }

    def deviation(self, params: Params) -> torch.Tensor:
        """½ Σ (params − identity)² over every entry: 0 at the identity transform.

        Added to an objective with weight δ it is a Gaussian prior centred on "no change"
        (an L2 decay towards identity rather than towards zero, which for τ = exp(0) = 1 is
        the same point in the log parameterization but not in the softplus one).
        """
        self._check_keys(params)
        centres = {key: value for key, (_, value) in self.layout(1).items()}
        total = None
        for key, value in params.items():
            term = 0.5 * (value - centres[key]).square().sum()
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
        return self._on_columns(self.forward, params, logits, class_ids)

    def invert(
        self, params: Params, logits: torch.Tensor, class_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The logits that ``apply(params, ·, class_ids)`` maps to ``logits`` (same shapes)."""
        return self._on_columns(self.inverse, params, logits, class_ids)

    def _on_columns(
        self,
        fn: Callable[[Params, torch.Tensor], torch.Tensor],
        params: Params,
        logits: torch.Tensor,
        class_ids: torch.Tensor | None,
    ) -> torch.Tensor:
        if not logits.is_floating_point():
            # the result is cast back to logits.dtype: z / τ on int logits would be truncated
            raise TypeError(
                f"alpha {self.name!r}: logits must have a floating-point dtype, got {logits.dtype} "
                "(the transform is cast back to it, so integers would be truncated); pass "
                "logits.float()"
            )
        self._check_keys(params)
        if not params:
            return logits
        if logits.ndim < 1:
            raise ValueError("logits must have at least one axis (the class axis)")
        v = logits.shape[-1]
        if class_ids is not None:
            class_ids = _check_class_ids(class_ids, v, logits.device)
        self._check_shapes(params, v if class_ids is None else class_ids.numel())
        z = logits if class_ids is None else logits.index_select(-1, class_ids)
        out = fn(params, z).to(logits.dtype)
        if class_ids is None:
            return out
        return logits.index_copy(logits.ndim - 1, class_ids, out)

    def _check_keys(self, params: Mapping[str, torch.Tensor]) -> None:
        keys = self.layout(1)
        if set(params) != set(keys):
            raise ValueError(
                f"alpha {self.name!r} expects params with keys {sorted(keys)}, "
                f"got {sorted(params)}"
            )

    def _check_shapes(self, params: Params, k: int) -> None:
        layout = self.layout(k)
        for key, value in params.items():
            expected = layout[key][0]
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


# ---- the parameterizations ------------------------------------------------------------------
@dataclass(frozen=True)
class Identity(Transform):
    """z: no parameters (the baseline of a comparison)."""


    def inverse(self, params: Params, z: torch.Tensor) -> torch.Tensor:
        return z


@dataclass(frozen=True)
class Temperature(Transform):
    """z / τ with one scalar τ = positivity(tau_raw)."""

    positivity: Positivity = "log"
    tau_max: float = 20.0
    per_class: ClassVar[bool] = False

    def layout(self, K: int) -> dict[str, tuple[tuple[int, ...], float]]:
        return {"tau_raw": ((K,) if self.per_class else (), _raw_one(self.positivity))}

    def tau(self, params: Params) -> torch.Tensor:
        """τ from its raw parameter."""
        return _tau(params["tau_raw"], self.positivity, self.tau_max)

    def forward(self, params: Params, z: torch.Tensor) -> torch.Tensor:
        return z / self.tau(params)

    def inverse(self, params: Params, z: torch.Tensor) -> torch.Tensor:
        return z * self.tau(params)

    def constrained(self, params: Params) -> dict[str, torch.Tensor]:
        """{"tau": τ}."""
        self._check_keys(params)
        return {"tau": self.tau(params)}


@dataclass(frozen=True)
class ClassTemperature(Temperature):
    """z_j / τ_j, one τ per class."""

    per_class: ClassVar[bool] = True


@dataclass(frozen=True)
class Shift(Transform):
    """z_j + l_j, one shift per class (a log-prior correction)."""


    def layout(self, K: int) -> dict[str, tuple[tuple[int, ...], float]]:
        return {"shift": ((K,), 0.0)}

    def forward(self, params: Params, z: torch.Tensor) -> torch.Tensor:
        return z + params["shift"]

    def inverse(self, params: Params, z: torch.Tensor) -> torch.Tensor:
        return z - params["shift"]


@dataclass(frozen=True)
class Affine(ClassTemperature):
    """z_j / τ_j + l_j (``form="scale_shift"``) or (z_j + l_j) / τ_j (``form="shift_scale"``)."""

    form: Form = "scale_shift"

    def layout(self, K: int) -> dict[str, tuple[tuple[int, ...], float]]:
        return {"tau_raw": ((K,), _raw_one(self.positivity)), "shift": ((K,), 0.0)}

    def forward(self, params: Params, z: torch.Tensor) -> torch.Tensor:
        tau, shift = self.tau(params), params["shift"]
        if self.form == "shift_scale":
            return (z + shift) / tau
        return z / tau + shift

    def inverse(self, params: Params, z: torch.Tensor) -> torch.Tensor:
        tau, shift = self.tau(params), params["shift"]
        if self.form == "shift_scale":
            return z * tau - shift
        return (z - shift) * tau

    def constrained(self, params: Params) -> dict[str, torch.Tensor]:
        """{"tau": τ, "shift": l}."""
        self._check_keys(params)
        return {"tau": self.tau(params), "shift": params["shift"]}


# ---- the registry ---------------------------------------------------------------------------
def register(
    name: str,
    factory: Callable[..., Parameterization] | None = None,
    *,
    options: Mapping[str, Option] | None = None,
    learns: bool = True,
    replace: bool = False,
) -> Any:
    """Add the parameterization ``factory(**options) -> Parameterization`` under ``name``
    (usable as a class decorator): `get`, `NAMES` and `alpha_table` (hence a CLI's choices)
    see it at once. ``options`` declares each option (`Option`: default, choices, aliases,
    check); ``learns=False`` for one without parameters. A taken name is refused unless
    ``replace``. A `Transform` subclass needs no name of its own: it reads this one."""

    def add(f: Callable[..., Parameterization]) -> Callable[..., Parameterization]:
        if not callable(f):
            raise TypeError(f"alpha {name!r}: the factory must be callable, got {f!r}")
        alpha_table.add(alpha_table.Spec(name, dict(options or {}), learns, f), replace=replace)
        return f

    return add if factory is None else add(factory)


def get(name: str, **options: Any) -> Parameterization:
    """The parameterization registered as ``name`` (see the module table), with ``options``
    (``form`` for "affine"; ``positivity`` and ``tau_max`` for those with a temperature).
    Raises ValueError for an unknown name or option, and TypeError when what the factory
    made reports another name (it would be exported, and reloaded, as that one)."""
    resolved = alpha_table.resolve(name, options)
    p = alpha_table.SPECS.get(name).load()(**resolved)
    if getattr(p, "name", None) != name:
        raise TypeError(f"alpha {name!r}: its factory made {type(p).__name__} named "
                        f"{getattr(p, 'name', None)!r}; a parameterization must report the name "
                        "it is registered under (a Transform subclass does so by itself)")
    return p
