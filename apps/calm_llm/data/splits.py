"""Train / calibration / test / out-of-domain splits: seeded, disjoint by id, recorded.

Protocol (the papers'): every in-domain set gives its own test set of ``n_test`` questions;
what remains of the in-domain sets is pooled into a training split of ``n_train`` and a
calibration split of ``n_calib`` questions, each spread as evenly as possible over the sets
(so a 15,000-question MMLU does not crowd out a 500-question OpenBookQA); each out-of-domain
set is capped at ``n_ood`` questions. With ``instruction_train`` (the CALM paper's OOD protocol)
the training split is a seeded subset of ``n_train`` instruction examples instead and the
in-domain sets only give calibration and test questions.

Splits are disjoint by content too, not only by id (issue 29). A question's key (`question_key`)
is its text up to case, spacing and punctuation plus the set of its option texts up to case and
spacing, so a copy under another id or with its options reordered has the same key. Before any
split is carved, with ``dedup="drop"`` (the default): a question repeated within one set is kept
once; a question whose gold option text is repeated as a distractor (unanswerable) is dropped;
a question found in an out-of-domain set is removed from the in-domain sets (the side training,
calibration and in-domain test are carved from), and one found in two in-domain sets is kept in
the first only. Every drop is counted in `Splits.manifest` and a warning, so an OOD or test score
is never measured on questions the model trained on and no question counts twice. With
``dedup="refuse"`` any of these is a `DataError` naming the ids. Instruction training examples
(another format) are not compared with the multiple-choice questions. Cost: one key per
question, O(total text length) time and O(questions) memory, before any shuffle.

Each split also gets a fingerprint (`split_fingerprint`: sha256 over its questions' sorted key
digests), recorded in ``splits.json`` and ``metrics.json``, so a study can tell which questions
another run used (`split_fingerprints`, `split_question_digests` read a run directory).
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...errors import ConfigError, DataError
from .schema import InstructionExample, MCQAExample


@dataclass
class Splits:
    """The carved splits. ``test`` is keyed by in-domain set, ``ood`` by out-of-domain set."""

    train: list[MCQAExample] | list[InstructionExample]
    calib: list[MCQAExample]
    test: dict[str, list[MCQAExample]]
    ood: dict[str, list[MCQAExample]]
    seed: int = 0
    counts: dict[str, int] = field(default_factory=dict)
    overlap: dict[str, int] = field(default_factory=dict)  # "a & b" -> examples removed from b
    repeated: dict[str, int] = field(default_factory=dict)  # set -> copies of its own questions
    unanswerable: dict[str, list[str]] = field(default_factory=dict)  # set -> ids dropped
    dedup: str = "drop"

    def named(self) -> dict[str, list[Any]]:
        """Every split under one flat name: train, calib, test/<set>, ood/<set>."""
        out: dict[str, list[Any]] = {"train": list(self.train), "calib": list(self.calib)}
        out.update({f"test/{k}": v for k, v in self.test.items()})
        out.update({f"ood/{k}": v for k, v in self.ood.items()})
        return out

    def manifest(self) -> dict[str, Any]:
        """JSON-able record: per split its size, ids (in order) and a sha256 of its content.

        The digest covers each example's canonical JSON (id, text, options, label), so a
        changed data file with unchanged ids is still detected; ``examples`` holds each
        example's own digest (16 hex digits), so `manifest_changes` can say how many changed.
        """
        return {
            "seed": self.seed,
            "requested": dict(self.counts),
            "dedup": self.dedup,
            "overlap_removed": dict(self.overlap),
            "repeated_removed": dict(self.repeated),
            "unanswerable_removed": {k: list(v) for k, v in self.unanswerable.items()},
            "splits": {
                name: {"n": len(exs), "ids": [e.id for e in exs], "sha256": split_digest(exs),
                       "examples": [example_digest(e) for e in exs],
                       "fingerprint": split_fingerprint(exs),
                       "questions": [question_digest(e) for e in exs]}
                for name, exs in self.named().items()
            },
        }

    def fingerprints(self) -> dict[str, str]:
        """``{split name: split_fingerprint}`` (what metrics.json records)."""
        return {name: split_fingerprint(exs) for name, exs in self.named().items()}


def example_digest(example: MCQAExample | InstructionExample) -> str:
    """The first 16 hex digits of sha256 over one example's canonical JSON."""
    text = json.dumps(example.__dict__, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def _source_of(example_id: str) -> str:
    return example_id.split(":", 1)[0]  # ids are "source:..." (see sources.content_id)


def manifest_changes(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """What differs between two `Splits.manifest` records, one line per split that changed,
    naming its sources and how many examples changed (empty when the splits are the same)."""
    out = []
    a, b = saved.get("splits", {}), now.get("splits", {})
    for name in [*a, *(n for n in b if n not in a)]:
        if name not in b or name not in a:
            out.append(f"split {name} {'is gone' if name not in b else 'is new'}")
            continue
        old, new = a[name], b[name]
        if old.get("sha256") == new["sha256"]:
            continue
        if "examples" in old:
            before = set(zip(old["ids"], old["examples"]))
            after = set(zip(new["ids"], new["examples"]))
        else:  # a record written before per-example digests: ids only
            before, after = set(old["ids"]), set(new["ids"])
        differ = (after - before) | (before - after)
        ids = {x[0] if isinstance(x, tuple) else x for x in differ}
        sources = sorted({_source_of(i) for i in ids})
        n_changed = len(after - before)
        if not differ:
            detail = "the same examples in another order" if "examples" in old else \
                "the same ids with other content"
        else:
            detail = (f"{n_changed} of {new['n']} examples differ (sources: {', '.join(sources)})"
                      + (f", {old['n']} before" if old["n"] != new["n"] else ""))
        out.append(f"{name}: {detail}")
    return out


def content_key(e: Any) -> str:
    """The question and its options (any order) up to case and spacing; an open-QA question
    (no options) by its text alone, so TriviaQA and NQ-open never share a question."""
    def norm(t: str) -> str:
        return " ".join(t.casefold().split())

    return "\x1f".join([norm(e.question), *sorted(norm(o) for o in getattr(e, "options", ()))])


_PUNCT = re.compile(r"[\W_]+")  # runs of anything but letters and digits (any script)


def question_key(e: Any) -> str:
    """The near-duplicate key of a question: its text casefolded with punctuation and spacing
    collapsed to single spaces, then the SET of its option texts casefolded with spacing
    collapsed (so reordered options match). Option texts keep their punctuation: measured on
    the offline sets it carries meaning there ("1"/"-1", "Rh+ve"/"Rh-ve" in MMLU and MedMCQA).
    An instruction example (no question) is keyed by its instruction and input."""
    if not hasattr(e, "question"):
        return "\x1e".join(" ".join(t.casefold().split()) for t in (e.instruction, e.input))
    text = " ".join(_PUNCT.sub(" ", e.question.casefold()).split())
    options = sorted({" ".join(o.casefold().split()) for o in getattr(e, "options", ())})
    return "\x1f".join([text, *options])


def question_digest(e: Any) -> str:
    """The first 16 hex digits of sha256 over `question_key` (what splits.json lists)."""
    return hashlib.sha256(question_key(e).encode("utf-8")).hexdigest()[:16]


def split_fingerprint(examples: Sequence[Any]) -> str:
    """sha256 over the split's sorted `question_digest` lines: the same questions give the same
    fingerprint whatever their ids, order or option order; computable from splits.json alone."""
    digests = sorted(question_digest(e) for e in examples)
    return hashlib.sha256("\n".join(digests).encode("ascii")).hexdigest()


DEDUP_MODES = ("drop", "refuse")


def _drop_within(exs: list[Any]) -> tuple[list[Any], list[str], list[str]]:
    """One set without its unanswerable questions and without later copies of a question
    (by `question_key`): (kept, unanswerable ids, repeated ids)."""
    seen: set[str] = set()
    kept, unanswerable, repeated = [], [], []
    for e in exs:
        if isinstance(e, MCQAExample) and e.gold_repeated():
            unanswerable.append(e.id)
            continue
        key = question_key(e)
        if key in seen:
            repeated.append(e.id)
            continue
        seen.add(key)
        kept.append(e)
    return kept, unanswerable, repeated


def _remove_overlap(
    in_domain: dict[str, list[MCQAExample]], out_of_domain: dict[str, list[MCQAExample]]
) -> tuple[dict[str, list[MCQAExample]], dict[str, list[str]]]:
    """In-domain sets without the questions of the OOD sets or of an earlier in-domain set;
    ``{"owner & set": ids removed from set}``."""
    seen: dict[str, str] = {}  # question key -> the set it belongs to
    for name, exs in out_of_domain.items():
        for e in exs:
            seen.setdefault(question_key(e), name)
    overlap: dict[str, list[str]] = {}
    kept: dict[str, list[MCQAExample]] = {}
    for name, exs in in_domain.items():
        kept[name] = []
        for e in exs:
            owner = seen.setdefault(question_key(e), name)
            if owner == name:
                kept[name].append(e)
            else:
                overlap.setdefault(f"{owner} & {name}", []).append(e.id)
    return kept, overlap


def _ids(ids: list[str], n: int = 8) -> str:
    return ", ".join(ids[:n]) + (f" and {len(ids) - n} more" if len(ids) > n else "")


def _clean_sets(
    in_domain: dict[str, list[Any]], out_of_domain: dict[str, list[Any]], dedup: str
) -> tuple[dict[str, list[Any]], dict[str, list[Any]], dict[str, dict[str, list[str]]]]:
    """The sets without unanswerable, repeated and overlapping questions (module docstring);
    with ``dedup="refuse"`` a `DataError` naming them instead. Returns the sets and
    ``{"unanswerable"|"repeated"|"overlap": {set or pair: ids}}``."""
    if dedup not in DEDUP_MODES:
        raise ConfigError(f"dedup (--dedup) must be one of {', '.join(DEDUP_MODES)}, got {dedup!r}")
    found: dict[str, dict[str, list[str]]] = {"unanswerable": {}, "repeated": {}, "overlap": {}}
    cleaned = []
    for sets in (out_of_domain, in_domain):
        out = {}
        for name, exs in sets.items():
            out[name], bad, rep = _drop_within(exs)
            found["unanswerable"].update({name: bad} if bad else {})
            found["repeated"].update({name: rep} if rep else {})
        cleaned.append(out)
    ood, ind = cleaned
    ind, found["overlap"] = _remove_overlap(ind, ood)
    lines = [f"{k}: {len(v)} unanswerable (the gold option's text repeated as a distractor: "
             f"{_ids(v)})" for k, v in found["unanswerable"].items()]
    lines += [f"{k}: {len(v)} repeated within the set ({_ids(v)})" for k, v in found["repeated"].items()]
    lines += [f"{k}: {len(v)} in both sets, removed from the second ({_ids(v)})"
              for k, v in found["overlap"].items()]
    if lines and dedup == "refuse":
        raise DataError("--dedup refuse: the data hold questions that would be counted twice, "
                        "cross from one split into another, or cannot be answered: "
                        + "; ".join(lines) + ". Remove them from the data files, or pass "
                        "--dedup drop to drop them (counted in splits.json)")
    if lines:
        warnings.warn("questions dropped before the splits were carved (--dedup drop; counted in "
                      "splits.json): " + "; ".join(lines), stacklevel=3)
    return ind, ood, found


def _dropped_note(found: dict[str, dict[str, list[str]]]) -> str:
    """Why the in-domain sets are smaller than their files, when --dedup drop made them so."""
    dropped = {kind: sum(len(v) for v in per.values()) for kind, per in found.items()}
    if not any(dropped.values()):
        return "; lower --n-train / --n-calib / --n-test, or give more questions"
    parts = ", ".join(f"{n} {kind}" for kind, n in dropped.items() if n)
    return (f" (--dedup drop removed {sum(dropped.values())} questions before the splits were "
            f"carved: {parts}; --dedup refuse lists them instead); lower --n-train / --n-calib "
            "/ --n-test, or give more questions")


def split_digest(examples: Sequence[MCQAExample | InstructionExample]) -> str:
    """sha256 over the canonical JSON lines of the examples, in order."""
    h = hashlib.sha256()
    for e in examples:
        h.update(json.dumps(e.__dict__, sort_keys=True, ensure_ascii=False).encode("utf-8"))
        h.update(b"\n")
    return h.hexdigest()


def allocate(total: int, available: Sequence[int]) -> list[int]:
    """Split ``total`` over groups as evenly as possible without exceeding ``available``.

    Water filling: every group gets the same share until it runs out; the remainder goes to
    the groups with room left, earlier groups first. Raises when ``total > sum(available)``.
    """
    if total > sum(available):
        raise DataError(f"cannot take {total} examples from groups holding {list(available)}")
    take = [0] * len(available)
    left = total
    while left > 0:
        open_ = [i for i, a in enumerate(available) if take[i] < a]
        share = max(left // len(open_), 1)
        for i in open_:
            add = min(share, available[i] - take[i], left)
            take[i] += add
            left -= add
            if left == 0:
                break
    return take


def _shuffled(xs: Sequence[Any], seed: int, salt: str) -> list[Any]:
    out = list(xs)
    random.Random(f"{seed}:{salt}").shuffle(out)
    return out


def _check_split_inputs(
    in_domain: dict[str, list[MCQAExample]],
    out_of_domain: dict[str, list[MCQAExample]],
    instruction_train: list[InstructionExample] | None,
    counts: dict[str, int],
) -> None:
    """Counts >= 0, at least one in-domain set, no set on both sides, no id twice."""
    for k, v in counts.items():
        if v < 0:
            raise ValueError(f"{k} must be >= 0, got {v}")
    if not in_domain:
        raise ValueError("make_splits needs at least one in-domain set")
    both = set(in_domain) & set(out_of_domain)
    if both:
        raise ValueError(f"sets both in-domain and out-of-domain: {sorted(both)}")
    all_ids: set[str] = set()
    for name, exs in [*in_domain.items(), *out_of_domain.items(), ("instructions", instruction_train or [])]:
        for e in exs:
            if e.id in all_ids:
                raise ValueError(f"duplicate example id {e.id!r} (seen again in {name!r})")
            all_ids.add(e.id)


def make_splits(
    in_domain: dict[str, list[MCQAExample]],
    out_of_domain: dict[str, list[MCQAExample]],
    *,
    n_train: int,
    n_calib: int,
    n_test: int,
    n_ood: int,
    seed: int,
    instruction_train: list[InstructionExample] | None = None,
    dedup: str = "drop",
) -> Splits:
    """Carve seeded, id- and content-disjoint splits (see the module docstring for the protocol).

    Each set is shuffled with a generator keyed by (seed, set name), so adding a set does not
    change another set's draws. ``dedup`` ("drop" or "refuse") says what happens to repeated,
    overlapping and unanswerable questions. Raises ValueError when a set is too small for the
    request, when a set is both in- and out-of-domain, or when two examples share an id.
    """
    counts = {"n_train": n_train, "n_calib": n_calib, "n_test": n_test, "n_ood": n_ood}
    _check_split_inputs(in_domain, out_of_domain, instruction_train, counts)
    raw_in, raw_ood = in_domain, out_of_domain
    in_domain, out_of_domain, found = _clean_sets(in_domain, out_of_domain, dedup)
    kept = {e.id for sets in (in_domain, out_of_domain) for exs in sets.values() for e in exs}

    def draw(raw: list[Any], salt: str) -> list[Any]:
        # shuffle the set as read, then drop: each dropped question is replaced by the next one
        # drawn, so dropping k questions moves only k (reshuffling the rest would move most)
        return [e for e in _shuffled(raw, seed, salt) if e.id in kept]

    test: dict[str, list[MCQAExample]] = {}
    rest: dict[str, list[MCQAExample]] = {}
    for name, exs in in_domain.items():
        if len(exs) < n_test:
            raise DataError(f"in-domain set {name!r} has {len(exs)} examples, fewer than n_test={n_test}")
        order = draw(raw_in[name], f"id:{name}")
        test[name], rest[name] = order[:n_test], order[n_test:]

    names = list(rest)
    available = [len(rest[n]) for n in names]
    if instruction_train is not None:
        if len(instruction_train) < n_train:
            raise DataError(f"instruction_train has {len(instruction_train)} examples, fewer than n_train={n_train}")
        train: list[Any] = _shuffled(instruction_train, seed, "instructions")[:n_train]
        n_mcqa_train = 0
    else:
        n_mcqa_train = n_train
    if n_mcqa_train + n_calib > sum(available):
        raise DataError(f"in-domain sets hold {sum(available)} examples after the test sets "
                        f"({dict(zip(names, available))}), fewer than n_train + n_calib = "
                        f"{n_mcqa_train + n_calib}{_dropped_note(found)}")
    calib_take = allocate(n_calib, available)
    calib = [e for n, k in zip(names, calib_take) for e in rest[n][:k]]
    if instruction_train is None:
        after_calib = [a - k for a, k in zip(available, calib_take)]
        train_take = allocate(n_train, after_calib)
        train = [e for n, c, k in zip(names, calib_take, train_take) for e in rest[n][c : c + k]]
    train = _shuffled(train, seed, "train-order")
    calib = _shuffled(calib, seed, "calib-order")

    ood = {name: draw(raw_ood[name], f"ood:{name}")[:n_ood] for name in out_of_domain}
    return Splits(train=train, calib=calib, test=test, ood=ood, seed=seed, counts=counts,
                  overlap={k: len(v) for k, v in found["overlap"].items()},
                  repeated={k: len(v) for k, v in found["repeated"].items()},
                  unanswerable=found["unanswerable"], dedup=dedup)


def _read_splits_record(run_dir: str | Path) -> dict[str, Any]:
    """A run directory's splits.json, each split's fingerprint checked against its question
    digests (an edited record is refused, never trusted)."""
    from ..io import CorruptFile  # io imports torch: only when a run directory is read

    path = Path(run_dir) / "splits.json"
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        splits = record["splits"]
    except FileNotFoundError:
        raise DataError(f"{path}: no such file; pass the directory of a run (it holds "
                        "config.json and splits.json)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise CorruptFile(f"{path} is unreadable ({e}); restore it from a copy or rerun") from e
    for name, entry in splits.items():
        if "fingerprint" not in entry or "questions" not in entry:
            raise DataError(f"{path}: split {name!r} has no fingerprint (the run predates split "
                            "fingerprints); rerun it to record them")
        if hashlib.sha256("\n".join(sorted(entry["questions"])).encode("ascii")).hexdigest() \
                != entry["fingerprint"]:
            raise CorruptFile(f"{path}: split {name!r}'s fingerprint does not match its question "
                              "digests (the file was edited); restore it from a copy or rerun")
    return splits


def split_fingerprints(run_dir: str | Path) -> dict[str, str]:
    """``{split name: fingerprint}`` of a run (``train``, ``calib``, ``test/<set>``,
    ``ood/<set>``), read from its splits.json and checked. Two runs evaluated the same questions
    on a split exactly when the fingerprints are equal (`split_fingerprint`)."""
    return {name: entry["fingerprint"] for name, entry in _read_splits_record(run_dir).items()}


def split_question_digests(run_dir: str | Path) -> dict[str, set[str]]:
    """``{split name: set of question_digest}`` of a run, for partial overlaps: a study refuses
    to test on questions in another study's development splits by intersecting these sets."""
    return {name: set(entry["questions"]) for name, entry in _read_splits_record(run_dir).items()}
