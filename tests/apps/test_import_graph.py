"""No import circle anywhere in apps/ (issue 27), and no two-way dependency between packages
(issue 38): the imports of every apps module form a graph without cycles; collapsed to
packages (``apps.calm_llm.config``, ``apps.calm_llm.runner``, ...; a top-level module is its own
node), they still do; and the torch-free modules import alone, without torch, in a fresh
interpreter.

An import made inside a function is deferred, not absent: it is counted too, so a circle
cannot hide behind one (the old ``config._methods()`` did), nor behind a lazy module
``__getattr__`` (``methods.__getattr__`` importing ``methods.base``, which imported ``config``:
``config`` ↔ ``methods``). Imports under ``if TYPE_CHECKING:`` never run and are not counted.
The study package is included."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MODULES = sorted(
    ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
    for p in (ROOT / "apps").rglob("*.py")
)


def _path(module: str) -> Path:
    base = ROOT.joinpath(*module.split("."))
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


def _imports(module: str) -> set[str]:
    """The apps modules `module` imports (anywhere in it), resolved to modules that exist."""
    path = _path(module)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):  # drop the bodies of `if TYPE_CHECKING:` (never run)
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING"):
            node.body = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parent = ".".join(parts[: len(parts) - node.level + 1])
                base = f"{parent}.{base}" if base else parent
            # `from pkg import sub` names a submodule when one exists, else an attribute of pkg
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base
                     for a in node.names]
        else:
            continue
        out |= {n for n in names if n in MODULES and n != module}
    return out


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_the_import_graph_of_apps_has_no_cycle():
    graph = {m: _imports(m) for m in MODULES}
    # a package's __init__ re-exporting its submodules is not a circle; a submodule importing
    # its own package's __init__ back would be, so the package edge is kept only that way
    for m in MODULES:
        if _path(m).name == "__init__.py":
            graph[m] = {n for n in graph[m] if not n.startswith(m + ".")}
    assert _cycle(graph) is None, f"import circle: {' -> '.join(_cycle(graph))}"


def package_of(module: str) -> str:
    """The node of `module` in the package graph: its package right below ``apps.calm_llm``
    (``apps.calm_llm.config.schema`` -> ``apps.calm_llm.config``), else the module itself
    (``apps.calm_llm.model``, ``apps.study.summary``, ``apps.lock``)."""
    return ".".join(module.split(".")[:3])


def package_graph(modules: list[str]) -> dict[str, set[str]]:
    """Package -> the packages its modules import (lazy imports included), self-edges dropped."""
    graph: dict[str, set[str]] = {package_of(m): set() for m in modules}
    for m in modules:
        graph[package_of(m)] |= {package_of(n) for n in _imports(m)} - {package_of(m)}
    return graph


def test_no_two_packages_of_apps_import_each_other():
    graph = package_graph(MODULES)
    assert "apps.calm_llm.tasks" in graph and "apps.calm_llm.config" in graph
    assert _cycle(graph) is None, f"package circle: {' -> '.join(_cycle(graph))}"


def test_a_lazy_getattr_import_is_an_edge():
    """The circle config ↔ methods hid behind ``methods.__getattr__`` (its ``from . import
    base``, base importing config): collapsed to packages, such an edge closes the circle."""
    assert "apps.calm_llm.methods.base" in _imports("apps.calm_llm.methods")  # the lazy import
    graph = package_graph(MODULES)
    assert "apps.calm_llm.methods" in graph["apps.calm_llm.config"]  # config reads the table
    assert "apps.calm_llm.config" not in graph["apps.calm_llm.methods"]
    graph["apps.calm_llm.methods"].add("apps.calm_llm.config")  # what methods.base used to do
    assert _cycle(graph) is not None


def test_the_cycle_finder_finds_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("module", [m for m in MODULES if m.startswith("apps.calm_llm.config")
                                    or m in ("apps.errors", "apps.calm_llm.methods",
                                             "apps.calm_llm.data.sources",
                                             "apps.calm_llm.data.open_qa",
                                             "apps.calm_llm.solvers")])
def test_the_torch_free_modules_import_alone_without_torch(module):
    code = f"import sys, {module}; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
