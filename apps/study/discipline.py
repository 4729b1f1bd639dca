"""Development and final-test questions kept apart across studies (issue 28).

Every study declares, per kind of split, what role its questions play (``Study.roles``):

- ``training``: fitted on (the training split; a final study's calibration split, which TS and
  CALM's upper level fit, but no choice reads);
- ``development``: a choice reads it (defaults, η, which sets to keep, which study to run next):
  every split a study evaluates on, unless it declares otherwise;
- ``test``: a final test that no choice reads.

A question a study used for development must never count as a final test question, in any
study; and a development study must not read a final study's test questions. Before any cell of
a study runs, ``check`` builds the registry of the other catalogued studies' questions by role
and refuses (``DisciplineError``) when this study's test questions meet another study's
development questions, or the reverse, naming both studies, the two splits, the number of shared
questions and the fix. Questions are compared by ``data.splits.question_digest`` (the text up to
case, spacing and punctuation, with the set of options), so a copy under another id or with its
options reordered is still the same question; and by `near_digest`, the same with every word's
plural ending folded (``adaptations`` = ``adaptation``, ``species`` = ``specy`` on both sides), so
a copy whose options differ only in inflection is the same question too (one such pair of
ARC-Challenge questions, validation and test documents, had slipped the exact digest).
A question of one split counts as shared when either key meets the other split's.

A study may acknowledge, by name, shared questions found after it ran
(``Study.acknowledged_shared``): the check then refuses only when more are shared than it
acknowledges, and reports the acknowledged ones.

Where a study's questions come from, per cell, first found:

1. the cell's own ``splits.json`` under the study's root (``runs/study-NAME``, or the root
   given): what the run recorded (``data.splits.split_question_digests``, checked against each
   split's fingerprint), with the near-duplicate keys of the same carving from its declaration
   when that carving gives the recorded questions (else the exact digests alone, and a line
   that says so);
2. otherwise the cell's declared configuration, carved again by the run's own loader
   (the task's ``load_splits``, `apps.calm_llm.tasks`): the splits are deterministic in the
   split seed and the data, so this is what the cell used or will use. Published cells
   (``docs/results/NAME``) keep no ``splits.json`` and are covered this way, as are declared
   studies that have not run.

Cost: one carving of the splits per distinct data configuration (cells that differ only in
methods or training options share it): loading each source once, O(questions) digests.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import sys
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from apps.errors import DataError
from apps.study.design import ROLES, SPLIT_KINDS, Study
from apps.study.runner import Cell, cells

# split name (train, calib, test/<set>, ood/<set>) -> its questions, each as
# (question_digest, near_digest or None where only the exact digest is known)
Question = tuple[str, "str | None"]
SplitQuestions = dict[str, set[Question]]
Loader = Callable[[Study, Cell, Path], SplitQuestions]


class DisciplineError(ValueError):
    """A study would test on another study's development questions (or develop on another
    study's test questions); the message names both studies, the splits, the count and the fix."""


def split_kind(name: str) -> str:
    """``test/sciq`` -> ``test``; ``train`` -> ``train``."""
    kind = name.split("/", 1)[0]
    if kind not in SPLIT_KINDS:
        raise ValueError(f"split {name!r}: not one of {SPLIT_KINDS} (optionally /<set>)")
    return kind


_WORD = re.compile(r"[\W_]+")  # runs of anything but letters and digits, as question_key


def _fold(word: str) -> str:
    """A word without its English plural ending when at least three letters stay: -ies -> -y
    (``bodies``), -es after s, x, z, ch, sh (``boxes``), else -s but not -ss (``adaptations``,
    ``maybes``); ``gas`` and ``glass`` stay."""
    if word.endswith("ies") and len(word) >= 6:
        return word[:-3] + "y"
    if word.endswith("es") and word[:-2].endswith(("s", "x", "z", "ch", "sh")) and len(word) >= 5:
        return word[:-2]
    if word.endswith("s") and not word.endswith("ss") and len(word) >= 4:
        return word[:-1]
    return word


def near_key(e: Any) -> str:
    """The inflection-blind key of a question: its text and the SET of its option texts, each
    casefolded, punctuation and spacing collapsed, every word's plural ending folded (`_fold`).
    Coarser than ``data.splits.question_key`` on purpose: it is used only to keep final-test
    questions away from development ones, where a false match costs a question and a missed
    one costs the claim."""
    def norm(t: str) -> str:
        return " ".join(_fold(w) for w in _WORD.sub(" ", t.casefold()).split())

    if not hasattr(e, "question"):  # an instruction example: never a test question
        return "\x1e" + norm(getattr(e, "instruction", "")) + "\x1f" + norm(getattr(e, "input", ""))
    return "\x1f".join([norm(e.question), *sorted({norm(o) for o in getattr(e, "options", ())})])


def near_digest(e: Any) -> str:
    """The first 16 hex digits of sha256 over `near_key`."""
    return hashlib.sha256(near_key(e).encode("utf-8")).hexdigest()[:16]


def _carved(study: Study, cell: Cell) -> SplitQuestions:
    """The questions of a cell's splits, carved again from its declared configuration by the
    run's own loader (deterministic in the split seed and the data)."""
    from apps.calm_llm.data.splits import question_digest

    cfg = cell.config(study)
    from apps.calm_llm import tasks

    with warnings.catch_warnings():  # the dedup counts of another study's data: its run warns
        warnings.simplefilter("ignore", UserWarning)
        splits = tasks.get(cfg.task).load_splits(cfg)
    return {name: {(question_digest(e), near_digest(e)) for e in exs}
            for name, exs in splits.named().items()}


def cell_questions(study: Study, cell: Cell, root: Path, *,
                   cache: dict[str, SplitQuestions | DataError] | None = None) -> SplitQuestions:
    """A cell's questions per split: recorded in ``root/<cell>/splits.json`` when the cell ran,
    else carved from its declaration (see the module docstring). ``cache`` (keyed by the data
    configuration and split seed) lets cells that share their splits carve them once."""
    from apps.calm_llm.data.splits import split_question_digests

    if not (root / cell.name / "splits.json").is_file():
        return _carved_once(study, cell, cache)
    record = split_question_digests(root / cell.name)
    try:  # the near-duplicate keys of the recorded questions, if the carving is what ran
        carved = _carved_once(study, cell, cache)
    except DataError:
        carved = {}
    if {name: {d for d, _ in qs} for name, qs in carved.items()} == record:
        return carved
    print(f"split discipline: {study.name} {cell.name}: its splits.json is not what its "
          "declaration carves from the data here, so its questions are compared by their exact "
          "digests only (no near-duplicate match)", file=sys.stderr)
    return {name: {(d, None) for d in ds} for name, ds in record.items()}


def _carved_once(study: Study, cell: Cell,
                 cache: dict[str, SplitQuestions | DataError] | None) -> SplitQuestions:
    cfg = cell.config(study)
    key = json.dumps([cfg.task, cfg.split_seed, cfg.seed if cfg.split_seed < 0 else None,
                      dataclasses.asdict(cfg.data)], sort_keys=True, default=str)
    if cache is None:
        return _carved(study, cell)
    if key not in cache:
        try:
            cache[key] = _carved(study, cell)
        except DataError as e:  # remembered too: the data are not read again for the next cell
            cache[key] = e
    got = cache[key]
    if isinstance(got, DataError):
        raise got
    return got


def by_role(study: Study, root: Path, role: str, *, loader: Loader | None = None,
            cache: dict[str, SplitQuestions | DataError] | None = None,
            skipped: dict[str, list[str]] | None = None) -> SplitQuestions:
    """The union over a study's cells of the questions of every split it declares as ``role``
    (split name -> question digests); ``cache`` as in ``cell_questions``. With ``skipped``, a
    cell whose splits cannot be carved from the data here (``DataError``) is recorded there
    ("study: why" -> cells) and left out instead of raising."""
    if role not in ROLES:
        raise ValueError(f"role {role!r}: one of {ROLES}")
    cache = {} if cache is None else cache
    out: SplitQuestions = {}
    for c in cells(study):
        try:
            got = loader(study, c, root) if loader else cell_questions(study, c, root, cache=cache)
        except DataError as e:
            # a declared study whose splits the offline data cannot carve (paper-7b asks for
            # 1,000 OpenBookQA questions, 500 exist offline) has used no question here; one that
            # ran elsewhere has its splits.json, read above
            if skipped is None:
                raise
            skipped.setdefault(f"{study.name}: {str(e).splitlines()[0]}", []).append(c.name)
            continue
        for name, qs in got.items():
            if study.roles[split_kind(name)] == role:
                out.setdefault(name, set()).update(qs)
    return out


def default_root(study: Study) -> Path:
    """Where ``python -m apps.study NAME`` keeps a study's cells by default."""
    return Path(f"runs/study-{study.name}")


def shared(mine: set[Question], theirs: set[Question]) -> int:
    """How many of ``mine`` are in ``theirs``: by exact digest, or by near digest where both
    sides know it (module docstring)."""
    exact = {d for d, _ in theirs}
    near = {n for _, n in theirs if n is not None}
    return len({d for d, n in mine if d in exact or (n is not None and n in near)})


def _overlaps(mine: SplitQuestions, theirs: SplitQuestions) -> list[tuple[str, str, int]]:
    found = [(a, b, shared(qa, qb)) for a, qa in sorted(mine.items())
             for b, qb in sorted(theirs.items())]
    return [f for f in found if f[2]]


def check(study: Study, root: Path, catalogue: Mapping[str, Study], *,
          roots: Mapping[str, Path] | None = None, loader: Loader | None = None) -> int:
    """Refuse ``study`` (under ``root``) when its test questions are another catalogued study's
    development questions, or its development questions another study's test questions; returns
    the number of (other study, role) registries compared. ``roots``: where each other study's cells are (default
    ``runs/study-NAME``); ``loader`` replaces ``cell_questions`` (tests).

    Cost: the splits of ``study`` and of every other study holding the opposite role, carved
    once per distinct data configuration (or read from recorded cells)."""
    roots = dict(roots or {})
    cache: dict[str, SplitQuestions | DataError] = {}  # one carving per data configuration
    skipped: dict[str, list[str]] = {}
    mine = {role: by_role(study, root, role, loader=loader, cache=cache)
            for role in ("development", "test")}
    compared = 0
    for other in catalogue.values():
        if other.name == study.name:
            continue
        where = roots.get(other.name, default_root(other))
        for my_role, their_role in (("test", "development"), ("development", "test")):
            if not mine[my_role] or their_role not in other.roles.values():
                continue
            theirs = by_role(other, where, their_role, loader=loader, cache=cache, skipped=skipped)
            compared += 1
            found = _unacknowledged(study, other, _overlaps(mine[my_role], theirs))
            if found:
                raise DisciplineError(_message(study, other, my_role, found))
    for why, left in skipped.items():
        print(f"split discipline: {len(left)} cells of {why.split(':')[0]} left out, their splits "
              f"cannot be carved from the data here ({why.split(': ', 1)[1]})", file=sys.stderr)
    return compared


def _unacknowledged(study: Study, other: Study,
                    found: list[tuple[str, str, int]]) -> list[tuple[str, str, int]]:
    """``found`` without the shared questions ``study`` acknowledges (``acknowledged_shared``:
    "other study: my split" -> how many), each acknowledged one said on stderr."""
    left = []
    for mine, theirs, n in found:
        allowed = study.acknowledged_shared.get(f"{other.name}: {mine}", 0)
        if n > allowed:
            left.append((mine, theirs, n))
        else:
            print(f"split discipline: {study.name}'s {mine} split shares {n} question"
                  f"{'s' if n != 1 else ''} with "
                  f"{other.name}'s {theirs} split, acknowledged in its declaration",
                  file=sys.stderr)
    return left


def _message(study: Study, other: Study, my_role: str, found: list[tuple[str, str, int]]) -> str:
    mine, theirs, n = found[0]
    total = sum(k for *_, k in found)
    more = f" (and {len(found) - 1} more split pairs, {total} shared in all)" if len(found) > 1 else ""
    if my_role == "test":
        what = (f"study {study.name} would test on questions study {other.name} used for "
                f"development: its {mine} split shares {n} questions with {other.name}'s {theirs} "
                f"split{more}")
    else:
        what = (f"study {study.name} would develop on final-test questions of study {other.name}: "
                f"its {mine} split shares {n} questions with {other.name}'s {theirs} split{more}")
    return (f"{what}. Fix: draw the test questions from documents no development study read (e.g. "
            f"the sets' test documents: arc_easy_test, arc_challenge_test, sciq_test), or change "
            f"the split seed or set of {study.name} and check again with `python -m apps.study "
            f"{study.name} --dry-run`; or, if {other.name} made no choice from those questions, "
            f"declare its roles accordingly in apps/study/catalogue.py")
