"""BOAT (``boat-torch`` 1.1.1 on PyPI) on the classic problems of bench/peers.py, through its own
``boat_torch.Problem`` API: ``gm_op=["NGD"]`` (T differentiable steps of the lower-level
optimizer, wrapped by ``higher``: SGD, or Adam for ITD-Adam) with ``na_op=["RAD"]`` (reverse
mode through them: ITD) or
``na_op=["CG"]`` (implicit differentiation with K CG iterations on the fixed-point map), and
its first-order ``fo_op="PGDO"`` (V-PBGD, Shen & Chen 2023) beside ``bilevel.VPBGD``. PGDO
keeps its ŷ (the T-step estimate of θ*(α)) as a separate model carried across outer steps;
``bilevel.VPBGD`` restarts θ^(T) from θ at every step: the same first step, then a different
warm start.

boat-torch declares ``torch``, ``torchvision`` and ``numpy<=1.26.4``: installing it with its
dependencies replaces the project's torch (pip resolved torch 2.14.1 with CUDA wheels here). It
runs with ``--no-deps`` next to the installed torch (it imports neither torchvision nor numpy
in these code paths); point ``BOAT_PATH`` at a ``pip install --no-deps --target DIR
boat-torch`` folder, or install it with ``--no-deps``.

BOAT loads the losses by import path from a config, with the signature
``(feed_dict, ul_model, ll_model, params=None)``; :func:`lower_loss` and :func:`upper_loss`
adapt that to a ``bilevel.Problem`` carried in the feed dict. ``return_grad=True`` makes
``run_iter`` return dF/dα instead of stepping its upper optimizer, so the outer Adam step is
the one every library shares; ``copy_last_param=True`` writes θ^(T) back (the warm start).
BOAT logs both losses to a JSON file after every iteration (two more forward passes and a file
write per outer step): that is part of its cost per step as shipped.
"""

from __future__ import annotations

import os
import sys
import tempfile
from typing import Any

import torch
from torch import nn

from ..peer_steps import Grads, Holder, Hypergrad, Spec, State

_OPS = {"ITD-SGD": ["RAD"], "ITD-Adam": ["RAD"], "AID-CG": ["CG"]}  # V-PBGD: "PGDO" (fo_op)


def unavailable() -> str | None:
    """None if boat_torch imports (from ``$BOAT_PATH`` when set), else the reason."""
    path = os.environ.get("BOAT_PATH")
    if path and path not in sys.path:
        sys.path.append(path)
    try:
        import boat_torch  # noqa: F401
    except Exception as err:
        return (f"boat_torch not importable ({type(err).__name__}: {err}); "
                "pip install --no-deps boat-torch (see bench/libs/boat_lib.py)")
    return None


def _trees(feed: dict, ul_model: nn.Module, ll_model: nn.Module, params: Any) -> tuple[dict, dict]:
    theta = params if params is not None else list(ll_model.parameters())
    return (dict(zip(feed["alpha_names"], ul_model.parameters())),
            dict(zip(feed["theta_names"], theta)))


def lower_loss(feed: dict, ul_model: nn.Module, ll_model: nn.Module, params: Any = None) -> torch.Tensor:
    """g(α, θ) in BOAT's loss signature (θ: ``params`` if given, else the model's current ones)."""
    alpha, theta = _trees(feed, ul_model, ll_model, params)
    return feed["spec"].problem.lower(alpha, theta, feed["batch"])


def upper_loss(feed: dict, ul_model: nn.Module, ll_model: nn.Module, params: Any = None) -> torch.Tensor:
    """f(α, θ) in BOAT's loss signature."""
    alpha, theta = _trees(feed, ul_model, ll_model, params)
    return feed["spec"].problem.upper(alpha, theta, feed["batch"])


def _config(spec: Spec, method: str, ul: Holder, ll: Holder, log: str) -> dict[str, Any]:
    penalty = method == "V-PBGD"
    return {
        "fo_op": "PGDO" if penalty else None, "gm_op": None if penalty else ["NGD"],
        "na_op": None if penalty else _OPS[method],
        # PGDO = V-PBGD (Shen & Chen 2023): ŷ by T SGD steps of size β, γ constant ("difference")
        "PGDO": {"y_hat_lr": spec.inner_lr, "gamma_init": spec.gamma, "gamma_max": spec.gamma,
                 "gamma_argmax_step": 1, "update_y_ahead": False, "penalty": "difference"},
        "lower_level_model": ll, "upper_level_model": ul,
        "lower_level_var": list(ll.parameters()), "upper_level_var": list(ul.parameters()),
        # NGD unrolls this optimizer through higher (ITD-Adam: higher's differentiable Adam)
        "lower_level_opt": (torch.optim.Adam(ll.parameters(), lr=spec.inner_lr)
                            if method == "ITD-Adam" else
                            torch.optim.SGD(ll.parameters(), lr=spec.inner_lr)),
        # unused with return_grad=True: the shared outer Adam step is applied instead
        "upper_level_opt": torch.optim.Adam(ul.parameters(), lr=spec.outer_lr),
        "lower_iters": spec.inner_steps, "device": "cpu",
        "GDA": {"alpha_init": 0.0, "alpha_decay": 1.0}, "RGT": {"truncate_iter": 0},
        # the same stopping rule as bilevel.linalg.CG's default and torchopt's rtol here
        "CG": {"k": spec.cg_iters, "tolerance": 1e-6},
        "loss_log_path": log, "return_grad": True, "accumulate_grad": False,
        "copy_last_param": True, "fo_ol_batch_input": False,
    }


def boat_hypergrad(spec: Spec, method: str) -> Hypergrad:
    """BOAT's RAD (ITD-SGD) or CG (AID-CG). Its upper model shares storage with the run's α
    (the shared Adam step updates it in place); θ^(T) is handed back like every library's."""
    why = unavailable()
    if why is not None:
        raise ImportError(why)
    import boat_torch

    losses = {"lower_level_loss": {"function": f"{__name__}.lower_loss"},
              "upper_level_loss": {"function": f"{__name__}.upper_loss"}}
    log = os.path.join(tempfile.mkdtemp(prefix="boat_"), "losses.json")
    built: dict[int, Any] = {}

    def run(state: State) -> Grads:
        if id(state) not in built:  # BOAT binds its models to the variables once
            ul, ll = Holder(state.alpha), Holder(state.theta)
            problem = boat_torch.Problem(_config(spec, method, ul, ll, log), losses)
            built[id(state)] = (problem.build_ll_solver().build_ul_solver(), ul, ll)
        problem, ul, ll = built[id(state)]
        feeds = [{"spec": spec, "batch": b, "alpha_names": list(state.alpha),
                  "theta_names": list(state.theta)} for b in spec.batches]
        for p in ul.parameters():
            p.grad = None
        grads, _ = problem.run_iter(feeds[1], feeds[0], current_iter=0)
        if method == "V-PBGD":
            # PGDO multiplies its whole loss by min(1/γ, 1) (so θ's SGD step is β/γ, as in
            # bilevel's setup); the α direction is scaled back for the comparison
            grads = [g * max(spec.gamma, 1.0) for g in grads]
        # copy_last_param wrote θ^(T) into ll's parameters (replacing their .data, so no
        # longer state.theta's storage): handed back for the shared θ update
        return [g.detach().clone() for g in grads], [p.detach() for p in ll.parameters()]

    return run
