"""The rendered API reference (mkdocs.yml, docs/reference/) covers every public name of
``bilevel`` and ``calibration``.

CI builds the site with ``mkdocs build --strict`` (.ci/run); this test reads the reference pages'
``::: name`` directives instead, so it runs in a second. A name is covered by its own directive,
or by a directive of its module that renders members: mkdocstrings then shows the module's
public members (``filters: public``: its ``__all__``, or without one every name without a
leading underscore) that have a docstring, so each such name must have one. The members and
docstrings are read with griffe, the loader mkdocstrings itself uses.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
import re
from pathlib import Path
from types import ModuleType

import griffe

import bilevel
import calibration

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "docs" / "reference"
_DIRECTIVE = re.compile(r"^::: (\S+)\n((?:[ \t]+\S.*\n)*)", re.MULTILINE)


def _directives() -> dict[str, bool]:
    """Each ``::: name`` of the reference pages in mkdocs.yml's nav, mapped to whether it
    renders the object's members (False for ``members: false``)."""
    config = (ROOT / "mkdocs.yml").read_text()
    pages = re.findall(r"\breference/[\w./-]+\.md\b", config)
    assert pages, "mkdocs.yml's nav lists no page under docs/reference/"
    out: dict[str, bool] = {}
    for page in pages:
        text = (ROOT / "docs" / page).read_text() + "\n"
        for name, options in _DIRECTIVE.findall(text):
            with_members = re.search(r"^\s+members:\s*(false|no|\[\])\s*$", options, re.M) is None
            out[name] = out.get(name, False) or with_members
    return out


def _public_modules(package: ModuleType) -> list[str]:
    """The submodules of ``package`` whose names have no leading underscore."""
    return [f"{package.__name__}.{m.name}" for m in pkgutil.iter_modules(package.__path__)
            if not m.name.startswith("_")]


@functools.cache
def _loaded() -> dict[str, griffe.Module]:
    """Both packages as griffe reads them (statically, as mkdocstrings does)."""
    return {p: griffe.load(p, search_paths=[str(ROOT)]) for p in ("bilevel", "calibration")}


def _griffe(path: str, loaded: dict[str, griffe.Module]) -> griffe.Module:
    package, _, rest = path.partition(".")
    return loaded[package][rest] if rest else loaded[package]


def _public_names(module: griffe.Module) -> list[str]:
    if module.exports is not None:
        return [str(n) for n in module.exports]
    return [n for n, member in module.members.items() if member.is_public and not member.is_alias]


def _uncovered(name: str, directives: dict[str, bool], loaded: dict[str, griffe.Module]) -> str:
    """Why ``name`` (a dotted path) does not appear in the reference, or '' when it does."""
    if name in directives:
        return ""
    parent, _, leaf = name.rpartition(".")
    if not directives.get(parent, False):
        return f"{name}: no directive ::: {name}, and ::: {parent} (with members) is not there"
    obj = _griffe(parent, loaded)
    member = obj[leaf]
    if leaf not in _public_names(obj):
        return f"{name}: ::: {parent} is there but {leaf} is not among its public members"
    if member.is_module:
        return f"{name}: a module; rendered only by its own directive ::: {name}"
    if not member.docstring:
        return f"{name}: ::: {parent} skips it, it has no docstring (show_if_no_docstring is off)"
    return ""


def test_mkdocstrings_renders_public_members_only():
    config = (ROOT / "mkdocs.yml").read_text()
    assert re.search(r"^\s+filters: public$", config, re.M), "the coverage rule assumes it"
    assert "show_if_no_docstring" not in config, "the docstring rule assumes the default"


def test_reference_covers_every_public_name():
    directives = _directives()
    loaded = _loaded()
    wanted = [f"bilevel.{n}" for n in bilevel.__all__]
    # every public submodule: bilevel's submodules in its __all__ (the rest of bilevel is
    # re-exported at the top), all of calibration's (binning and smooth_ece are public modules
    # outside calibration.__all__)
    modules = [f"bilevel.{n}" for n in bilevel.__all__
               if isinstance(getattr(bilevel, n), ModuleType)]
    modules += _public_modules(calibration)
    assert set(modules) >= {f"calibration.{n}" for n in calibration.__all__ if n != "__version__"}
    wanted += ["calibration.__version__"] + modules
    for mod in modules:
        names = _public_names(_griffe(mod, loaded))
        assert set(names) <= set(dir(importlib.import_module(mod))), mod  # griffe read it right
        wanted += [f"{mod}.{n}" for n in names]
    assert len(wanted) > 150  # the reading above found the ~190 names there are
    problems = [why for name in wanted if (why := _uncovered(name, directives, loaded))]
    assert not problems, "\n".join(problems)


def test_reference_directives_name_real_objects():
    # a directive of a removed or misspelt name would otherwise fail only the strict build
    loaded = _loaded()
    missing = []
    for name in _directives():
        try:
            _griffe(name, loaded)
        except KeyError:
            missing.append(name)
    assert not missing, f"directives of names that do not exist: {missing}"


def test_rst_in_docstrings_is_translated():
    # docs/griffe_rst.py: what the site shows for :class:`X`, tables and literal blocks
    extensions = griffe.load_extensions(str(ROOT / "docs" / "griffe_rst.py") + ":RestToMarkdown")
    pkg = griffe.load("bilevel", search_paths=[str(ROOT)], extensions=extensions)
    text = pkg["hypergrad"].docstring.value
    assert ":class:" not in text
    assert ('<autoref identifier="bilevel._hypergrad.HypergradMethod" optional>'
            "<code>HypergradMethod</code></autoref>") in text
    assert ('<autoref identifier="bilevel.errors.UnusedLeafWarning" optional>'
            "<code>bilevel.UnusedLeafWarning</code></autoref>") in text
    role = re.compile(r":(class|func|meth|mod|attr|data|exc|obj):`")
    left = [o.path for o in _walk_all(pkg) if o.docstring and role.search(o.docstring.value)]
    assert not left, left
    # the reST table of bilevel.linalg is preformatted; "Public API::" reads "Public API:"
    table = pkg["linalg"].docstring.value
    start = table.index("```text\n==========  ===")
    assert "\nNormalCG    CG on" in table[start : table.index("\n```\n", start)]
    assert "Public API:\n\n    problem = bilevel.Problem(" in pkg.docstring.value


def _walk_all(obj):
    yield obj
    for member in obj.members.values():
        if not member.is_alias:
            yield from _walk_all(member)
