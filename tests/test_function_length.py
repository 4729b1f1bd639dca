"""Function length, docstrings excluded: at most 50 lines in bilevel/ and calibration/, 60 in
apps/ (it assembles the other two) and in bench/ (measurement scripts)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIMITS = {"bilevel": 50, "calibration": 50, "apps": 60, "bench": 60}


def function_lengths(source: str) -> list[tuple[str, int, int]]:
    """(name, first line, length without the docstring) of every function in ``source``."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        length = node.end_lineno - node.lineno + 1
        body = node.body
        if (
            body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            length -= body[0].end_lineno - body[0].lineno + 1
        out.append((node.name, node.lineno, length))
    return out


def test_the_checker_counts_lines_without_the_docstring():
    source = 'def f():\n    """doc\n    more doc\n    """\n    x = 1\n    return x\n'
    assert function_lengths(source) == [("f", 1, 3)]
    nested = "def outer():\n    def inner():\n        return 1\n    return inner\n"
    assert function_lengths(nested) == [("outer", 1, 4), ("inner", 2, 2)]


@pytest.mark.parametrize("package", sorted(LIMITS))
def test_no_function_is_longer_than_its_packages_limit(package):
    limit = LIMITS[package]
    too_long = [
        f"{path.relative_to(ROOT)}:{line} {name} ({n} lines)"
        for path in sorted((ROOT / package).rglob("*.py"))
        for name, line, n in function_lengths(path.read_text())
        if n > limit
    ]
    assert not too_long, f"functions over {limit} lines in {package}/: " + ", ".join(too_long)
