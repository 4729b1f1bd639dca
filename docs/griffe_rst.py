"""Griffe extension of the rendered API reference (mkdocs.yml, ``extensions:``).

The docstrings of ``bilevel`` and ``calibration`` write cross-references as Sphinx roles
(``:class:`CG```, ``:func:`bilevel.fit```, ``:meth:`reset```), which Markdown would show as
the literal text ``:class:`` before the code. This rewrites each role, once the package is
loaded, into an optional mkdocs-autorefs link to the object it names: resolved in the
docstring's scope (the object, then its parents, then the names imported there), linked where
the reference renders that object and plain code where it does not (an optional reference
never warns, so the strict build stays strict about everything else).

Two more reStructuredText habits of those docstrings are translated the same way: a simple
table (columns between ``=====  =====`` rules) is shown as the preformatted block it is, and
a paragraph ending in ``::`` before an indented block ends in ``:``, as reST prints it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from functools import partial
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|data|exc|obj):`(~?)([^`]+)`")
_RULE = re.compile(r"^[ \t]*=+(?:[ \t]+=+)+[ \t]*$")
_LITERAL = re.compile(r"::\n([ \t]*\n)")


def _tables(text: str) -> str:
    """Each reST simple table (two or three ``===  ===`` rules) inside a fenced code block."""
    lines, out, i = text.split("\n"), [], 0
    while i < len(lines):
        if not _RULE.match(lines[i]):
            out.append(lines[i])
            i += 1
            continue
        rules = [j for j in range(i, len(lines)) if _RULE.match(lines[j])][:3]
        if len(rules) < 2:
            out.append(lines[i])
            i += 1
            continue
        # a header rule pair followed by a closing one, or a headerless table's two rules
        end = rules[2] if len(rules) == 3 and rules[1] - rules[0] <= 3 else rules[1]
        out += ["", "```text", *lines[i : end + 1], "```", ""]
        i = end + 1
    return "\n".join(out)


def _walk(obj: griffe.Object) -> Iterator[griffe.Object]:
    """``obj`` and every object defined inside it (not the names it imports)."""
    yield obj
    for member in obj.members.values():
        if isinstance(member, griffe.Object):
            yield from _walk(member)


def _target(name: str, scope: griffe.Object, collection: griffe.ModulesCollection) -> str | None:
    """The canonical path of what ``name`` means in ``scope``'s docstring, or None."""
    candidates = [name]
    try:
        candidates.append(scope.resolve(name.partition(".")[0]) + name[len(name.partition(".")[0]):])
    except (griffe.NameResolutionError, ValueError):
        pass
    at: griffe.Object | None = scope
    while at is not None:
        candidates.append(f"{at.path}.{name}")
        at = at.parent
    for path in candidates:
        try:
            return collection.get_member(path).canonical_path
        except (KeyError, ValueError, griffe.AliasResolutionError, griffe.CyclicAliasError):
            continue
    return None


def _link(match: re.Match[str], scope: griffe.Object, collection: griffe.ModulesCollection) -> str:
    short, written = match[1], match[2]
    name = written.removesuffix("()")
    title = written.rpartition(".")[2] if short else written
    target = _target(name, scope, collection)
    if target is None:
        return f"`{title}`"
    return f'<autoref identifier="{target}" optional><code>{title}</code></autoref>'


class RestToMarkdown(griffe.Extension):
    """The docstrings' reST roles, simple tables and ``::`` as Markdown (module docstring)."""

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        collection = loader.modules_collection
        for obj in _walk(pkg):
            if obj.docstring is not None and ":" in obj.docstring.value:
                link = partial(_link, scope=obj, collection=collection)
                obj.docstring.value = _ROLE.sub(link, obj.docstring.value)
            if obj.docstring is not None and "==" in obj.docstring.value:
                obj.docstring.value = _tables(obj.docstring.value)
            if obj.docstring is not None and "::" in obj.docstring.value:
                obj.docstring.value = _LITERAL.sub(r":\n\1", obj.docstring.value)
