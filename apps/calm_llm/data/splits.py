"""Train / calibration / test / out-of-domain splits: seeded, disjoint by id, recorded.

Protocol (the papers'): every in-domain set gives its own test set of ``n_test`` questions;
what remains of the in-domain sets is pooled into a training split of ``n_train`` and a
calibration split of ``n_calib`` questions, each spread as evenly as possible over the sets
(so a 15,000-question MMLU does not crowd out a 500-question OpenBookQA); each out-of-domain
set is capped at ``n_ood`` questions. With ``instruction_train`` (the CALM paper's OOD protocol)
the training split is a seeded subset of ``n_train`` instruction examples instead and the
in-domain sets only give calibration and test questions.

Splits are disjoint by content too, not only by id: a question (with the same options, in any
order, up to case and spacing) found in an out-of-domain set is removed from the in-domain sets,
and one found in two in-domain sets is kept in the first only; `Splits.overlap` and a warning
report how many, so an OOD score is never measured on questions the model trained on.
"""

from __future__ import annotations

import hashlib
import json
import random
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ...errors import DataError
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
            "overlap_removed": dict(self.overlap),
            "splits": {
                name: {"n": len(exs), "ids": [e.id for e in exs], "sha256": split_digest(exs),
                       "examples": [example_digest(e) for e in exs]}
                for name, exs in self.named().items()
            },
        }


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


def _remove_overlap(
    in_domain: dict[str, list[MCQAExample]], out_of_domain: dict[str, list[MCQAExample]]
) -> tuple[dict[str, list[MCQAExample]], dict[str, int]]:
    """In-domain sets without the questions of the OOD sets or of an earlier in-domain set."""
    seen: dict[str, str] = {}  # content key -> the set it belongs to
    for name, exs in out_of_domain.items():
        for e in exs:
            seen.setdefault(content_key(e), name)
    overlap: dict[str, int] = {}
    kept: dict[str, list[MCQAExample]] = {}
    for name, exs in in_domain.items():
        kept[name] = []
        for e in exs:
            key = content_key(e)
            owner = seen.setdefault(key, name)
            if owner == name:
                kept[name].append(e)
            else:
                pair = f"{owner} & {name}"
                overlap[pair] = overlap.get(pair, 0) + 1
    return kept, overlap


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
) -> Splits:
    """Carve seeded, id-disjoint splits (see the module docstring for the protocol).

    Each set is shuffled with a generator keyed by (seed, set name), so adding a set does not
    change another set's draws. Raises ValueError when a set is too small for the request,
    when a set is both in- and out-of-domain, or when two examples share an id.
    """
    counts = {"n_train": n_train, "n_calib": n_calib, "n_test": n_test, "n_ood": n_ood}
    _check_split_inputs(in_domain, out_of_domain, instruction_train, counts)
    in_domain, overlap = _remove_overlap(in_domain, out_of_domain)
    if overlap:
        warnings.warn(
            "the same questions appear in two sets; removed from the second so no split shares "
            "a question with another: " + ", ".join(f"{k}: {v}" for k, v in overlap.items()),
            stacklevel=2,
        )
    test: dict[str, list[MCQAExample]] = {}
    rest: dict[str, list[MCQAExample]] = {}
    for name, exs in in_domain.items():
        if len(exs) < n_test:
            raise DataError(f"in-domain set {name!r} has {len(exs)} examples, fewer than n_test={n_test}")
        order = _shuffled(exs, seed, f"id:{name}")
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
        raise DataError(
            f"in-domain sets hold {sum(available)} examples after the test sets "
            f"({dict(zip(names, available))}), fewer than n_train + n_calib = {n_mcqa_train + n_calib}"
        )
    calib_take = allocate(n_calib, available)
    calib = [e for n, k in zip(names, calib_take) for e in rest[n][:k]]
    if instruction_train is None:
        after_calib = [a - k for a, k in zip(available, calib_take)]
        train_take = allocate(n_train, after_calib)
        train = [e for n, c, k in zip(names, calib_take, train_take) for e in rest[n][c : c + k]]
    train = _shuffled(train, seed, "train-order")
    calib = _shuffled(calib, seed, "calib-order")

    ood = {name: _shuffled(exs, seed, f"ood:{name}")[:n_ood] for name, exs in out_of_domain.items()}
    return Splits(train=train, calib=calib, test=test, ood=ood, seed=seed, counts=counts,
                  overlap=overlap)
