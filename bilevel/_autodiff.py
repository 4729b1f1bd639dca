"""Gradient helpers shared by the hypergradient methods and the solvers.

All derivatives go through ``torch.autograd.grad`` on fresh leaf aliases of the caller's
tensors, never ``.backward()``: nothing is ever accumulated into a ``.grad`` field, neither the
caller's nor a model's frozen parameters (which may well have ``requires_grad=True``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["grad", "leaf_aliases", "reached", "vjp"]


def leaf_aliases(xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """New autograd leaves sharing storage with ``xs`` (no copy), requiring grad.

    The solvers never modify these in place, so sharing storage with the caller is safe and
    costs no memory (for LoRA-sized inner variables a copy would be 1e5–1e7 floats).
    """
    return [x.detach().requires_grad_(True) for x in xs]


def grad(
    output: torch.Tensor,
    inputs: Sequence[torch.Tensor],
    *,
    create_graph: bool = False,
    retain_graph: bool | None = None,
) -> list[torch.Tensor]:
    """∂output/∂inputs as a list; inputs the output does not depend on get zeros."""
    inputs = list(inputs)
    if not output.requires_grad:
        # The objective ignored every input (e.g. an upper level that only reads θ, asked
        # for ∂/∂α): the gradient is zero, not an error.
        return [torch.zeros_like(x) for x in inputs]
    out = torch.autograd.grad(
        output, inputs, create_graph=create_graph, retain_graph=retain_graph, allow_unused=True
    )
    # _materialize inlined: this runs once per unrolled step
    return [
        torch.zeros_like(x, requires_grad=create_graph) if g is None else g
        for g, x in zip(out, inputs)
    ]


def vjp(
    outputs: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
    cotangents: Sequence[torch.Tensor],
    *,
    retain_graph: bool,
) -> list[torch.Tensor]:
    """Σ_i cotangent_iᵀ ∂output_i/∂inputs, skipping outputs that are constants.

    An output without autograd history (e.g. the gradient of a lower objective that is
    linear in θ) contributes zero, which ``torch.autograd.grad`` would reject.
    """
    pairs = [(o, c) for o, c in zip(outputs, cotangents) if o.requires_grad]
    if not pairs:
        return [torch.zeros_like(x) for x in inputs]
    outs, cots = zip(*pairs)
    inputs = list(inputs)
    out = torch.autograd.grad(
        outs, inputs, grad_outputs=cots, retain_graph=retain_graph, allow_unused=True
    )
    return _materialize(out, inputs, False)


def _materialize(
    grads: Sequence[torch.Tensor | None], inputs: Sequence[torch.Tensor], create_graph: bool
) -> list[torch.Tensor]:
    """Zeros for the unused inputs, as ``materialize_grads=True`` gives, in one comprehension
    instead of its two generator passes per ``autograd.grad`` call (per-call overhead on
    every unrolled step; bench/overhead.py)."""
    return [
        torch.zeros_like(x, requires_grad=create_graph) if g is None else g
        for g, x in zip(grads, inputs)
    ]


def reached(value: torch.Tensor, targets: Sequence[torch.Tensor]) -> list[bool]:
    """Which ``targets`` (tensors that require grad, leaves or not) ``value`` depends on
    through its autograd graph: the structural dependence for which
    ``torch.autograd.grad(..., allow_unused=True)`` would return a tensor rather than None.

    Found by walking ``value.grad_fn``'s graph (no backward pass, no gradient computed): a
    leaf matches its ``AccumulateGrad`` node, a non-leaf the edge (its ``grad_fn``, its
    ``output_nr``) (a multi-output node such as a ``_foreach`` op has one edge per output).
    Behind a node every input counts as reached, whichever output the path came through:
    an over-approximation for multi-output nodes, so a dependence may be assumed where
    there is none (a missed warning), never the reverse. Stops as soon as every target is
    found. Cost: one visit per node of the graph.
    """
    found = [False] * len(targets)
    if value.grad_fn is None:
        return found
    leaves: dict[int, list[int]] = {}
    edges: dict[tuple, list[int]] = {}
    for i, x in enumerate(targets):
        if x.grad_fn is None:
            leaves.setdefault(id(x), []).append(i)
        else:
            edges.setdefault((x.grad_fn, x.output_nr), []).append(i)
    remaining, stack, seen = len(targets), [value.grad_fn], {value.grad_fn}
    while stack and remaining:
        for node, nr in stack.pop().next_functions:
            if node is None:
                continue
            hits = edges.pop((node, nr), [])
            variable = getattr(node, "variable", None)  # set on AccumulateGrad nodes only
            if variable is not None:
                hits = hits + leaves.pop(id(variable), [])
            for i in hits:
                found[i] = True
            remaining -= len(hits)
            if node not in seen:
                seen.add(node)
                stack.append(node)
    return found
