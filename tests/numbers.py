"""One comparison for recomputed numbers against published or stored ones.

A study's published JSON is recomputed by the tests from its raw files. The same code on
another CPU (another SIMD width, another BLAS kernel) sums in another order, so floats may
differ in the last bits (2.1e-15 relative was seen on an AVX-512 machine); everything else —
keys, strings, integers, booleans, None, list lengths — must be identical.

    assert_same_numbers(recomputed, published)

Floats a, b are equal when |a − b| ≤ REL · max(|a|, |b|) + ABS, with REL = 1e-12 (a thousand
times float64's round-off after long sums, a million times below any digit a report shows) and
ABS = 1e-300 (only so that two values that underflow differently still match); NaN equals NaN
(an undefined AUROC is NaN in both). An int compared with a float is a difference: a count
that became a mean is a change of meaning, not of rounding.
"""

from __future__ import annotations

import math
from typing import Any

REL = 1e-12
ABS = 1e-300


def differences(actual: Any, expected: Any, path: str = "$") -> list[str]:
    """Every place where ``actual`` and ``expected`` differ beyond the tolerance, as
    ``"path: actual != expected"`` lines (empty when they agree)."""
    if isinstance(expected, bool) or isinstance(actual, bool) or expected is None or actual is None:
        return [] if type(actual) is type(expected) and actual == expected else [
            f"{path}: {actual!r} != {expected!r}"]
    if isinstance(expected, float) and isinstance(actual, float):
        if math.isnan(expected) and math.isnan(actual):
            return []
        if actual == expected or abs(actual - expected) <= REL * max(abs(actual), abs(expected)) + ABS:
            return []
        return [f"{path}: {actual!r} != {expected!r} (relative difference "
                f"{abs(actual - expected) / max(abs(actual), abs(expected)):.3g} > {REL:g})"]
    if _kind(actual) is not _kind(expected):
        return [f"{path}: {type(actual).__name__} {actual!r} != {type(expected).__name__} {expected!r}"]
    if isinstance(expected, dict):
        if list(actual) != list(expected):
            return [f"{path}: keys {list(actual)} != {list(expected)}"]
        return [d for k in expected for d in differences(actual[k], expected[k], f"{path}.{k}")]
    if _kind(expected) is list:
        if len(actual) != len(expected):
            return [f"{path}: length {len(actual)} != {len(expected)}"]
        return [d for i, (a, e) in enumerate(zip(actual, expected))
                for d in differences(a, e, f"{path}[{i}]")]
    return [] if actual == expected else [f"{path}: {actual!r} != {expected!r}"]


def _kind(x: Any) -> type:
    """JSON's kinds: a tuple is a list and a numpy float64 a float, as once written to JSON."""
    if isinstance(x, (list, tuple)):
        return list
    if isinstance(x, float):
        return float
    return type(x)


def assert_same_numbers(actual: Any, expected: Any) -> None:
    """Fail, naming the first few differing paths, unless ``actual`` equals ``expected`` with
    floats within the stated tolerance (see the module docstring)."""
    found = differences(actual, expected)
    assert not found, f"{len(found)} difference(s):\n" + "\n".join(found[:10])
