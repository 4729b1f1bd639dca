"""``nn.Module``s as inner (or outer) variables: ``bilevel.functional(module)``.

    f = bilevel.functional(model)       # f.params: {name: tensor}, the pytree the solvers take
    y = f(params, x)                    # = torch.func.functional_call(model, (params, buffers), (x,))

``f.params`` holds the module's trainable parameters (``requires_grad=True``, or the names in
``trainable=``) as detached aliases: new leaf tensors that share storage with the module's
parameters, so an optimizer stepping them (``bilevel.fit``) trains the module in place, while
the solvers themselves never write to them. ``f(params, *args)`` runs the module with
``params`` in place of those parameters; the module's other parameters are constants
(detached), its buffers are ``f.buffers`` (aliases of the module's) unless ``buffers=`` says
otherwise.

Buffers and normalization statistics (the contract; docs/bilevel.md, "Modules"):

* buffers are never part of the differentiated pytree;
* a call never writes to any buffer (``update_buffers=False``, the default): a normalization
  layer in train mode (``BatchNorm*``, ``InstanceNorm*``, ``SyncBatchNorm``) normalizes with
  the batch's own statistics, as it always does in train mode, and its running statistics are
  neither read nor updated (they are handed to it as ``None``, what
  ``torch.func.replace_all_batch_norm_modules_`` does to the module itself, here for the one
  call only); every other buffer is given to the forward as a fresh copy, so what the forward
  writes into it is dropped. The objective is then a function of (params, buffers, args, the
  module's train/eval mode) only: a solver may evaluate it once or a hundred times (ITD's
  unrolled steps, AID's Hessian-vector products, MAML over tasks) with the same result, and
  the module's buffers are the same after a solver step as before it. In eval mode a
  normalization layer uses the stored running statistics, unchanged.
* ``update_buffers=True`` gives the forward the buffers themselves, so train-mode running
  statistics are updated in place (in ``f.buffers``, i.e. in the module, or in the
  ``buffers=`` dict given): for a deliberate pass outside the solvers, e.g. recomputing
  BatchNorm statistics with the learned parameters before evaluating in eval mode. Inside an
  objective it would make the statistics depend on how many times a solver evaluates it.

Under ``torch.func.vmap`` (MAML over a leading task dimension, :func:`bilevel.task_copies`)
the default call works in train and eval mode: no unbatched buffer is written.

Build it once the module is final (after ``.to(dtype)``, ``.double()``, moving devices or
replacing submodules): the aliases and the list of normalization layers are taken then.
``buffers`` and ``update_buffers`` are keywords of the call, not passed to the forward.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["FunctionalModule", "functional"]

Trainable = Iterable[str] | Callable[[str], bool] | None

# Every normalization layer with running statistics subclasses the private _NormBase
# (BatchNorm1d/2d/3d, their Lazy versions, SyncBatchNorm, InstanceNorm1d/2d/3d); torch.func's
# own patch (replace_all_batch_norm_modules_) keys on the private _BatchNorm below it.
_NORM = nn.modules.batchnorm._NormBase
_STATS = ("running_mean", "running_var", "num_batches_tracked")


class FunctionalModule:
    """An ``nn.Module`` as a function of its parameters: see :func:`functional`.

    Attributes:
        module: the wrapped module (its train/eval mode is read at every call).
        params: ``{name: tensor}``, the trainable parameters, detached leaf aliases sharing
            storage with the module's (``requires_grad=True``), in ``named_parameters`` order.
        buffers: ``{name: tensor}``, the module's buffers, detached aliases.
    """

    def __init__(self, module: nn.Module, trainable: Trainable = None) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(
                f"bilevel.functional: expected an nn.Module, got {type(module).__name__}"
            )
        self.module = module
        named = dict(module.named_parameters())
        chosen = _select(named, trainable)
        self.params = {k: v.detach().requires_grad_(True) for k, v in named.items() if k in chosen}
        self._constants = {k: v.detach() for k, v in named.items() if k not in chosen}
        self.buffers = {k: v.detach() for k, v in module.named_buffers()}
        self._norms = [
            (name, m) for name, m in module.named_modules()
            if isinstance(m, _NORM) and m.track_running_stats
        ]

    def __call__(
        self,
        params: Mapping[str, torch.Tensor],
        /,
        *args: Any,
        buffers: Mapping[str, torch.Tensor] | None = None,
        update_buffers: bool = False,
        **kwargs: Any,
    ) -> Any:
        """``module(*args, **kwargs)`` with ``params`` as its trainable parameters.

        Args:
            params: ``{name: tensor}`` with exactly the names and shapes of ``self.params``
                (under ``torch.func.vmap``, the shapes of one task).
            *args: the module's positional inputs.
            buffers: ``{name: tensor}`` replacing some or all of ``self.buffers`` (e.g. a
                task dimension of running statistics under vmap); None: ``self.buffers``.
            update_buffers: False (default): nothing is written to any buffer (module
                docstring); True: the forward updates the buffers in place.
            **kwargs: the module's keyword inputs.

        Returns:
            whatever the module's forward returns.
        """
        _check_names("params", params, self.params, exact=True)
        merged = dict(self.buffers)
        if buffers is not None:
            _check_names("buffers", buffers, self.buffers, exact=False)
            merged.update(buffers)
        if not update_buffers:
            merged = self._read_only(merged)
        tensors = {**self._constants, **params, **merged}
        return torch.func.functional_call(self.module, tensors, args, kwargs)

    def _read_only(self, buffers: dict[str, Any]) -> dict[str, Any]:
        """Buffers no forward can write to: train-mode running statistics as None (batch
        statistics are used; nothing is updated), every other buffer a fresh copy."""
        stats = {
            f"{name}.{stat}" if name else stat
            for name, norm in self._norms
            if norm.training
            for stat in _STATS
        }
        return {k: None if k in stats else v.clone() for k, v in buffers.items()}

    def __repr__(self) -> str:
        n = sum(p.numel() for p in self.params.values())
        return (
            f"FunctionalModule({type(self.module).__name__}, {len(self.params)} parameter "
            f"tensors ({n} entries), {len(self.buffers)} buffers)"
        )


def functional(module: nn.Module, *, trainable: Trainable = None) -> FunctionalModule:
    """``module`` as a pure function of a pytree of its parameters, buffers included.

        f = bilevel.functional(model)
        f.params                     # {name: (shape of that parameter)}: pass as inner/outer
        f(params, *args, **kwargs)   # = torch.func.functional_call(model, (params, buffers), args)

    Args:
        module: any ``nn.Module``.
        trainable: which parameters form ``params``: None (default) every parameter with
            ``requires_grad=True``; a collection of names; or a predicate ``name -> bool``.
            The others are constants of the function (detached).

    Returns:
        A :class:`FunctionalModule` (module docstring: aliasing, buffers, BatchNorm, vmap).

    Cost per call: one forward of the module, plus a copy of its non-normalization buffers.
    """
    return FunctionalModule(module, trainable)


def _select(named: Mapping[str, torch.Tensor], trainable: Trainable) -> set[str]:
    """The names of the trainable parameters (unknown names are an error that lists them)."""
    if trainable is None:
        return {k for k, v in named.items() if v.requires_grad}
    if callable(trainable):
        return {k for k in named if trainable(k)}
    if isinstance(trainable, str):
        raise TypeError("bilevel.functional: trainable must be a collection of names, not a str")
    chosen = set(trainable)
    unknown = sorted(chosen - set(named))
    if unknown:
        raise ValueError(
            f"bilevel.functional: trainable names {unknown} are not parameters of the module; "
            f"its parameters: {list(named)}"
        )
    return chosen


def _check_names(
    what: str, given: Any, expected: dict[str, torch.Tensor], *, exact: bool
) -> None:
    """``given`` is a mapping of tensors with ``expected``'s names (all of them when
    ``exact``) and shapes; the error names the missing, extra or misshapen entries."""
    if not isinstance(given, Mapping):
        raise TypeError(
            f"FunctionalModule: {what} must be a dict name -> tensor (e.g. f.{what}), "
            f"got {type(given).__name__}"
        )
    missing = [k for k in expected if k not in given] if exact else []
    extra = [k for k in given if k not in expected]
    if missing or extra:
        raise ValueError(
            f"FunctionalModule: {what} does not match the module: missing {missing}, "
            f"unknown {extra}; expected the names {list(expected)}"
        )
    for k, v in given.items():
        if not isinstance(v, torch.Tensor):
            raise TypeError(f"FunctionalModule: {what}[{k!r}] is a {type(v).__name__}, not a tensor")
        if v.shape != expected[k].shape:
            raise ValueError(
                f"FunctionalModule: {what}[{k!r}] has shape {tuple(v.shape)}, the module's is "
                f"{tuple(expected[k].shape)} (a leading task dimension needs torch.func.vmap, "
                f"docs/bilevel.md, 'Modules')"
            )
