"""Open-QA answers against their gold aliases: SQuAD/TriviaQA normalization made explicit
about Unicode (`normalize_answer`), whole-word alias matching that can leave out the aliases
the question itself contains (`matches`), and the SQuAD/TriviaQA token F1 (`token_f1`).
`calibration.semantic` re-exports all three; see docs/open_qa.md.
"""

from __future__ import annotations

import re
import string
import unicodedata
from collections import Counter
from collections.abc import Sequence
from typing import Any, Literal

__all__ = [
    "matches",
    "normalize_answer",
    "token_f1",
]

# ---- normalization --------------------------------------------------------------------------
# TriviaQA's official evaluation adds these to string.punctuation (quotes and accents that are
# not ASCII); every Unicode punctuation character (category P*) is treated alike as well.
_EXTRA_PUNCTUATION = frozenset(string.punctuation) | {"‘", "’", "´", "`"}
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def _is_punctuation(ch: str) -> bool:
    return ch in _EXTRA_PUNCTUATION or unicodedata.category(ch).startswith("P")


def _strip_accents(text: str) -> str:
    """Drop combining marks after canonical decomposition: "é" (NFD: e + U+0301) -> "e"."""
    decomposed = unicodedata.normalize("NFD", text)
    kept = "".join(ch for ch in decomposed if unicodedata.category(ch) != "Mn")
    return unicodedata.normalize("NFC", kept)


def normalize_answer(
    text: str,
    *,
    punctuation: Literal["space", "delete"] = "space",
    strip_accents: bool = True,
) -> str:
    """SQuAD/TriviaQA answer normalization, made explicit about Unicode.

    Steps, in order: Unicode NFKC (compatibility forms: full-width "Ｐａｒｉｓ" -> "Paris", the
    ligature "ﬁ" -> "fi", a no-break space -> a space); case folding (``str.casefold``:
    "Straße" -> "strasse"); with ``strip_accents``, combining marks dropped after NFD
    ("Beyoncé" -> "beyonce"; neither official script does this, see docs/open_qa.md); "_" -> " ";
    punctuation (ASCII ``string.punctuation``, ‘ ’ ´ and every Unicode category-P character)
    replaced by a space (``"space"``, TriviaQA's script: "Campbell-Bannerman" -> "campbell
    bannerman") or deleted (``"delete"``, SQuAD's script: -> "campbellbannerman"); the whole
    words a / an / the removed anywhere; runs of whitespace collapsed to one space, ends stripped.
    """
    if punctuation not in ("space", "delete"):
        raise ValueError(f"punctuation must be 'space' or 'delete', got {punctuation!r}")
    out = unicodedata.normalize("NFKC", text).casefold()
    if strip_accents:
        out = _strip_accents(out)
    out = out.replace("_", " ")
    filler = " " if punctuation == "space" else ""
    out = "".join(filler if _is_punctuation(ch) else ch for ch in out)
    out = _ARTICLES.sub(" ", out)
    return " ".join(out.split())


def _occurs(phrase: str, text: str) -> bool:
    """Whether the normalized ``phrase`` occurs in the normalized ``text`` as whole words."""
    return f" {phrase} " in f" {text} "


def matches(
    answer: str,
    aliases: Sequence[str],
    *,
    mode: Literal["exact", "contains"] = "exact",
    question: str | None = None,
    **normalize: Any,
) -> bool:
    """Whether ``answer`` matches one of the gold ``aliases`` after `normalize_answer`.

    ``mode="exact"``: the normalized answer equals a normalized alias (TriviaQA's exact match).
    ``mode="contains"``: a normalized alias occurs in the normalized answer as whole words
    ("it was paris in 1900" contains "paris"), for models that answer in a sentence.
    ``question``: aliases that occur (whole words, normalized) in the question do not count, so
    an answer is not credited for repeating the question ("Which Cuban city is Havana's rival?"
    answered "the Cuban city of Havana" does not contain the alias "Havana"); a question whose
    every alias occurs in it can then match nothing. An answer that normalizes to "" ("The.")
    matches nothing, even an alias that also normalizes to "" (the band "The The").
    ``normalize`` is passed to `normalize_answer`.
    """
    if isinstance(aliases, str):
        raise TypeError("aliases must be a sequence of strings, not one string")
    norm = normalize_answer(answer, **normalize)
    if not norm:
        return False
    golds = {normalize_answer(a, **normalize) for a in aliases} - {""}
    if question is not None:
        asked = normalize_answer(question, **normalize)
        golds = {g for g in golds if not _occurs(g, asked)}
    if mode == "exact":
        return norm in golds
    if mode == "contains":
        return any(_occurs(g, norm) for g in golds)
    raise ValueError(f"mode must be 'exact' or 'contains', got {mode!r}")


def token_f1(answer: str, aliases: Sequence[str], **normalize: Any) -> float:
    """The SQuAD / TriviaQA token F1 of ``answer`` against its best gold alias.

    With P and G the multisets of whitespace tokens of the normalized answer and of a normalized
    alias, c = |P ∩ G| (multiset intersection): precision c/|P|, recall c/|G|,
    F1 = 2·precision·recall/(precision + recall), 0 when c = 0; the maximum over the aliases
    (Rajpurkar et al. 2016, SQuAD v1.1's evaluation script; TriviaQA's, Joshi et al. 2017, is the
    same with punctuation replaced by spaces, this function's default). An empty normalized
    answer scores 0, and so does an alias that normalizes to "". Cost O(Σ |alias| + |answer|).
    ``normalize`` is passed to `normalize_answer`.
    """
    if isinstance(aliases, str):
        raise TypeError("aliases must be a sequence of strings, not one string")
    predicted = Counter(normalize_answer(answer, **normalize).split())
    best = 0.0
    for alias in aliases:
        gold = Counter(normalize_answer(alias, **normalize).split())
        common = sum((predicted & gold).values())
        if common:
            precision, recall = common / sum(predicted.values()), common / sum(gold.values())
            best = max(best, 2 * precision * recall / (precision + recall))
    return best

