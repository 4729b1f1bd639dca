"""bilevel.tree: pytree arithmetic against the same operations on one concatenated vector."""

import pytest
import torch

from bilevel import tree


def _pair():
    g = torch.Generator().manual_seed(0)
    a = {
        "w": torch.randn(3, 2, generator=g, dtype=torch.float64),
        "b": [
            torch.randn(4, generator=g, dtype=torch.float64),
            torch.randn((), generator=g, dtype=torch.float64),
        ],
    }
    b = {
        "w": torch.randn(3, 2, generator=g, dtype=torch.float64),
        "b": [
            torch.randn(4, generator=g, dtype=torch.float64),
            torch.randn((), generator=g, dtype=torch.float64),
        ],
    }
    return a, b


def _vec(t):
    return torch.cat([x.reshape(-1) for x in tree.leaves(t)])


def test_arithmetic_matches_flat_vector():
    a, b = _pair()
    va, vb = _vec(a), _vec(b)
    assert torch.allclose(tree.dot(a, b), va @ vb)
    assert torch.allclose(tree.sq_norm(a), va @ va)
    assert torch.allclose(tree.norm(a), va.norm())
    assert torch.allclose(_vec(tree.add(a, b)), va + vb)
    assert torch.allclose(_vec(tree.sub(a, b)), va - vb)
    assert torch.allclose(_vec(tree.scale(2.5, a)), 2.5 * va)
    assert torch.allclose(_vec(tree.axpy(-0.5, a, b)), -0.5 * va + vb)
    assert torch.allclose(
        _vec(tree.axpy(torch.tensor(3.0, dtype=torch.float64), a, b)), 3 * va + vb
    )
    assert torch.equal(_vec(tree.zeros_like(a)), torch.zeros_like(va))
    assert tree.numel(a) == va.numel() == 11
    assert torch.allclose(_vec(tree.tree_map(lambda x, y: x * y, a, b)), va * vb)


def test_clone_copies_and_detach_shares_storage():
    a = {"w": torch.ones(3, requires_grad=True)}
    c, d = tree.clone(a), tree.detach(a)
    assert not c["w"].requires_grad and not d["w"].requires_grad
    assert c["w"].data_ptr() != a["w"].data_ptr()
    assert d["w"].data_ptr() == a["w"].data_ptr()


def test_structure_mismatch_names_both_structures():
    a, _ = _pair()
    with pytest.raises(ValueError, match="pytree structures differ"):
        tree.dot(a, {"w": a["w"], "c": a["b"]})
    with pytest.raises(ValueError, match=r"leaf 0 has shape \(3, 2\)"):
        tree.check_same_structure({"w": torch.zeros(3, 2)}, {"w": torch.zeros(2, 3)})
    # Same structure, different leaf shapes: no silent broadcasting or reshaping.
    x, y = {"w": torch.zeros(3, 1)}, {"w": torch.zeros(1, 3)}
    for op in (tree.add, tree.sub, tree.dot, lambda u, v: tree.axpy(2.0, u, v)):
        with pytest.raises(ValueError, match=r"leaf 0 has shape \(3, 1\) in a but \(1, 3\)"):
            op(x, y)
    with pytest.raises(ValueError, match=r"leaf 0 has shape"):
        tree.tree_map(torch.add, x, y)


def test_non_tensor_leaf_is_named():
    with pytest.raises(TypeError, match=r"tree\['b'\]\[1\] is float"):
        tree.flatten({"a": torch.zeros(1), "b": [torch.zeros(1), 1.0]})


def test_mixed_and_half_precision_dot_accumulates_in_float32():
    # 4096 · (1/64)² = 1 exactly; accumulating in bf16 would stall far below that.
    x = {"h": torch.full((4096,), 1 / 64, dtype=torch.bfloat16), "f": torch.ones(2)}
    d = tree.dot(x, x)
    assert d.dtype == torch.float32
    assert d.item() == 3.0


@pytest.mark.parametrize(
    "structure",
    [
        torch.ones(2),
        [torch.ones(2), torch.zeros(3)],
        (torch.ones(2), torch.zeros(1, 2)),
        {"b": torch.ones(2), "a": torch.zeros(3)},  # insertion order, not sorted
        {"w": [torch.ones(2), torch.ones(1)], "b": torch.zeros(1)},  # nested: the general path
        __import__("collections").OrderedDict(x=torch.ones(1), y=torch.ones(2)),
        [torch.ones(1)],
    ],
    ids=["leaf", "list", "tuple", "dict", "nested", "OrderedDict", "one-leaf list"],
)
def test_rebuilder_equals_unflatten(structure):
    # the solvers' fast rebuild of α and θ around new leaves must give exactly what the
    # generic unflatten gives: same container types, keys, order and leaf objects
    leaves, spec = tree.flatten(structure)
    fresh = [torch.randn(x.shape) for x in leaves]
    fast, slow = tree.rebuilder(spec)(fresh), tree.unflatten(fresh, spec)
    assert tree.flatten(fast)[1] == spec and type(fast) is type(slow)
    assert [id(x) for x in tree.leaves(fast)] == [id(x) for x in tree.leaves(slow)] == [id(x) for x in fresh]
    if isinstance(slow, dict):
        assert list(fast) == list(slow)
