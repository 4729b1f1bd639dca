"""Pytree arithmetic over ``torch.utils._pytree``: the vector space the solvers work in.

A *pytree* here is any nesting of dicts, lists and tuples whose leaves are tensors, e.g.
``{"w": tensor(d, k), "b": tensor(k)}``. Two trees are compatible when they have the same
structure (same keys, same nesting) and matching leaf shapes. All binary operations check
the structure and raise a ``ValueError`` that names both structures when they differ.

Hot loops (CG, unrolling) work on the flat leaf lists directly (``flatten`` once, the
``*_list`` helpers, ``unflatten`` once) so that no tree walk happens per iteration.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

PyTree = Any
"""Any pytree of tensors torch.utils._pytree flattens (tensor, tuple, list, dict, ...)."""
TreeSpec = pytree.TreeSpec
_HALF = (torch.float16, torch.bfloat16)

__all__ = [
    "PyTree",
    "add",
    "axpy",
    "check_same_structure",
    "clone",
    "detach",
    "dot",
    "flatten",
    "leaves",
    "norm",
    "numel",
    "rebuilder",
    "scale",
    "sq_norm",
    "sub",
    "tree_map",
    "unflatten",
    "zeros_like",
]


def flatten(tree: PyTree, *, name: str = "tree") -> tuple[list[torch.Tensor], TreeSpec]:
    """Leaves (a list of tensors) and the structure of ``tree``.

    Raises ``TypeError`` naming the path of the first leaf that is not a tensor, because a
    Python float or ``None`` leaf would otherwise fail much later inside autograd.
    """
    out, spec = pytree.tree_flatten(tree)
    if all(isinstance(leaf, torch.Tensor) for leaf in out):
        return out, spec
    # Only now the key paths (generating them costs more than the flattening itself, once
    # per solver step): the message names the first offending leaf by its path.
    for path, leaf in pytree.tree_flatten_with_path(tree)[0]:
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"{name}: every leaf must be a torch.Tensor, but {name}{pytree.keystr(path)} "
                f"is {type(leaf).__name__}"
            )
    raise AssertionError("unreachable: a non-tensor leaf was found above")  # pragma: no cover


def unflatten(leaves_: Sequence[torch.Tensor], spec: TreeSpec) -> PyTree:
    """Inverse of :func:`flatten`."""
    return pytree.tree_unflatten(list(leaves_), spec)


def rebuilder(spec: TreeSpec) -> Callable[[Sequence[torch.Tensor]], PyTree]:
    """A function equal to ``lambda leaves: unflatten(leaves, spec)``, built once per spec.

    The solvers rebuild the caller's trees around fresh leaves once per objective call (every
    unrolled step, every inner step); ``pytree.tree_unflatten`` walks the spec each time
    (about ten Python calls for a flat dict). α and θ are nearly always a lone tensor or a
    flat ``list``/``tuple``/``dict`` of tensors, which are rebuilt here directly
    (``dict(zip(keys, leaves))`` is what torch's dict unflatten does); any other structure
    (nested, ``OrderedDict``, namedtuple, custom nodes) goes through ``unflatten``.
    """
    if spec.is_leaf():
        return lambda leaves_: leaves_[0]
    flat = all(spec.child(i).is_leaf() for i in range(spec.num_children))
    if flat and spec.type is list:
        return list
    if flat and spec.type is tuple:
        return tuple
    if flat and spec.type is dict:
        keys = list(spec.context)
        return lambda leaves_: dict(zip(keys, leaves_))
    return lambda leaves_: pytree.tree_unflatten(list(leaves_), spec)


def leaves(tree: PyTree, *, name: str = "tree") -> list[torch.Tensor]:
    """The tensor leaves of ``tree`` in flattening order."""
    return flatten(tree, name=name)[0]


def check_same_structure(a: PyTree, b: PyTree, names: tuple[str, str] = ("a", "b")) -> None:
    """Raise ``ValueError`` if ``a`` and ``b`` differ in structure or in leaf shapes."""
    la, sa = flatten(a, name=names[0])
    lb, sb = flatten(b, name=names[1])
    if sa != sb:
        raise ValueError(
            f"pytree structures differ: {names[0]} is {pytree.treespec_pprint(sa)} but "
            f"{names[1]} is {pytree.treespec_pprint(sb)}"
        )
    for i, (x, y) in enumerate(zip(la, lb)):
        if x.shape != y.shape:
            raise ValueError(
                f"leaf {i} has shape {tuple(x.shape)} in {names[0]} but {tuple(y.shape)} in "
                f"{names[1]}"
            )


def _zip(a: PyTree, b: PyTree) -> tuple[list[torch.Tensor], list[torch.Tensor], TreeSpec]:
    la, sa = flatten(a, name="a")
    lb, sb = flatten(b, name="b")
    # Leaf shapes too: (3, 1) + (1, 3) would broadcast to (3, 3) and a dot of (3, 2) with
    # (2, 3) would silently pair the wrong entries.
    if sa != sb or any(x.shape != y.shape for x, y in zip(la, lb)):
        check_same_structure(a, b)  # raises with a readable message
    return la, lb, sa


def tree_map(fn: Callable[..., torch.Tensor], tree: PyTree, *rest: PyTree) -> PyTree:
    """Apply ``fn`` leaf-wise over ``tree`` and the same-structured trees ``rest``."""
    la, spec = flatten(tree)
    others = []
    for r in rest:
        lr, sr = flatten(r)
        if sr != spec or any(x.shape != y.shape for x, y in zip(la, lr)):
            check_same_structure(tree, r, ("tree", "other tree"))
        others.append(lr)
    return unflatten([fn(*xs) for xs in zip(la, *others)], spec)


# --- list-level helpers (no tree walk; used in hot loops) ------------------------------


def dot_list(xs: Sequence[torch.Tensor], ys: Sequence[torch.Tensor]) -> torch.Tensor:
    """Σ_i <x_i, y_i> as a 0-dim tensor (half-precision leaves accumulate in float32)."""
    if len(xs) == 0:
        return torch.zeros(())
    # torch.dot on flattened views: one kernel per leaf, no temporaries of leaf size.
    # Half-precision leaves (e.g. bf16 LoRA adapters) are accumulated in float32: a bf16
    # sum over 1e6 entries would lose most of its digits (and BOME's λ with them).
    parts = [
        torch.dot(x.reshape(-1).float(), y.reshape(-1).float())
        if x.dtype in _HALF
        else torch.dot(x.reshape(-1), y.reshape(-1))
        for x, y in zip(xs, ys)
    ]
    if len(parts) == 1:
        return parts[0]
    dtype = parts[0].dtype
    for p in parts[1:]:
        dtype = torch.promote_types(dtype, p.dtype)
    return torch.stack([p.to(dtype) for p in parts]).sum()


def sq_norm_list(xs: Sequence[torch.Tensor]) -> torch.Tensor:
    """Σ_i ‖x_i‖² as a 0-dim tensor."""
    return dot_list(xs, xs)


def zeros_like_list(xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.zeros_like(x) for x in xs]


def numel_list(xs: Sequence[torch.Tensor]) -> int:
    return sum(x.numel() for x in xs)


# --- tree-level API ----------------------------------------------------------------


def dot(a: PyTree, b: PyTree) -> torch.Tensor:
    """Inner product Σ_leaves <a_i, b_i> of two same-structured trees (0-dim tensor)."""
    la, lb, _ = _zip(a, b)
    return dot_list(la, lb)


def sq_norm(a: PyTree) -> torch.Tensor:
    """Squared Euclidean norm ‖a‖² = Σ_leaves ‖a_i‖² (0-dim tensor)."""
    return sq_norm_list(leaves(a))


def norm(a: PyTree) -> torch.Tensor:
    """Euclidean norm ‖a‖ of all leaves taken as one vector (0-dim tensor)."""
    return torch.sqrt(sq_norm(a))


def add(a: PyTree, b: PyTree) -> PyTree:
    """Leaf-wise a + b."""
    la, lb, spec = _zip(a, b)
    return unflatten([x + y for x, y in zip(la, lb)], spec)


def sub(a: PyTree, b: PyTree) -> PyTree:
    """Leaf-wise a − b."""
    la, lb, spec = _zip(a, b)
    return unflatten([x - y for x, y in zip(la, lb)], spec)


def scale(s: float | torch.Tensor, a: PyTree) -> PyTree:
    """Leaf-wise s · a for a scalar s."""
    la, spec = flatten(a)
    return unflatten([s * x for x in la], spec)


def axpy(alpha: float | torch.Tensor, x: PyTree, y: PyTree) -> PyTree:
    """Leaf-wise α·x + y (BLAS naming)."""
    lx, ly, spec = _zip(x, y)
    if isinstance(alpha, (int, float)):
        return unflatten([torch.add(b, a, alpha=alpha) for a, b in zip(lx, ly)], spec)
    return unflatten([alpha * a + b for a, b in zip(lx, ly)], spec)


def zeros_like(a: PyTree) -> PyTree:
    """A tree of zeros shaped like ``a``."""
    la, spec = flatten(a)
    return unflatten(zeros_like_list(la), spec)


def clone(a: PyTree) -> PyTree:
    """Detached copies of every leaf (new storage; safe to modify in place)."""
    la, spec = flatten(a)
    return unflatten([x.detach().clone() for x in la], spec)


def detach(a: PyTree) -> PyTree:
    """Detached views of every leaf (shared storage, no autograd history)."""
    la, spec = flatten(a)
    return unflatten([x.detach() for x in la], spec)


def numel(a: PyTree) -> int:
    """Total number of scalar entries over all leaves."""
    return numel_list(leaves(a))
