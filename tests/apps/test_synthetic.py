"""random:ARCH models, the tokenizer built in code and the synthetic questions (no download,
no data package): shapes against Llama-3.1-8B's published size, the meta-device build against
the ordinary construction, the tokenizer's round trip, the questions' answers."""

import importlib.util

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from apps.calm_llm import synthetic
from apps.calm_llm.config import ModelConfig
from apps.calm_llm.data import synthetic as questions
from apps.calm_llm.data.sources import load_source
from apps.calm_llm.model import ModelLoadError, check_model_available, load

TINY = "random:llama-3.1-8b@layers=2,hidden=64,vocab=4096"


def test_the_8b_shape_has_llama_3_1_8b_parameter_count():
    # 8,030,261,248 parameters: meta-llama/Llama-3.1-8B's model card ("8B"; the safetensors
    # index's total_size 16,060,522,496 bytes in bf16 / 2)
    from transformers import LlamaForCausalLM

    config = synthetic.random_config("random:llama-3.1-8b")
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    assert sum(p.numel() for p in model.parameters()) == 8_030_261_248
    assert (config.vocab_size, config.bos_token_id, config.eos_token_id) == (128256, 128000, 128001)
    assert config.rope_parameters["rope_type"] == "llama3"


@pytest.mark.parametrize("name, match", [
    ("random:gpt-9", "unknown architecture 'gpt-9'"),
    ("random:llama-3.1-8b@layers=0", "KEY=N with N >= 1"),
    ("random:llama-3.1-8b@depth=2", "'depth=2'"),
    ("random:llama-3.1-8b@hidden=100", "multiple of 16"),
    ("random:llama-3.1-8b@vocab=1000", "below the built-in tokenizer"),
])
def test_a_bad_random_name_is_refused_with_what_is_wrong(name, match):
    with pytest.raises(ValueError, match=match):
        synthetic.random_config(name)
    with pytest.raises(ModelLoadError, match=match):  # before any data or weights are read
        check_model_available(ModelConfig(name_or_path=name))


def test_meta_build_matches_the_ordinary_construction_in_everything_but_the_draws():
    from transformers import LlamaForCausalLM

    model = synthetic.build_random_model(TINY, dtype=torch.bfloat16, seed=3)
    torch.manual_seed(0)
    plain = LlamaForCausalLM(synthetic.random_config(TINY))
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    assert {n: (p.shape, torch.bfloat16) for n, p in plain.named_parameters()} == \
        {n: (p.shape, p.dtype) for n, p in model.named_parameters()}
    # the rotary frequencies (buffers to_empty leaves uninitialized) as the constructor computes them
    for (n, b), (_, want) in zip(model.named_buffers(), plain.named_buffers()):
        assert b.dtype == torch.float32 and torch.equal(b, want), n
    for n, p in model.named_parameters():
        if p.ndim == 1:
            assert torch.all(p == 1), n
        else:  # N(0, 0.02²) draws: mean and std within 5 standard errors
            x, se = p.detach().float(), 0.02 / p.numel() ** 0.5
            assert abs(float(x.mean())) < 5 * se and abs(float(x.std()) - 0.02) < 5 * se / 2**0.5 + 1e-4, n
    same = synthetic.build_random_model(TINY, dtype=torch.bfloat16, seed=3)
    other = synthetic.build_random_model(TINY, dtype=torch.bfloat16, seed=4)
    w = "model.layers.0.mlp.up_proj.weight"
    assert torch.equal(dict(same.named_parameters())[w], dict(model.named_parameters())[w])
    assert not torch.equal(dict(other.named_parameters())[w], dict(model.named_parameters())[w])
    ids = torch.arange(1, 20)[None]
    out = model(input_ids=ids).logits
    assert out.shape == (1, 19, 4096) and torch.isfinite(out).all()


def test_tokenizer_covers_the_vocabulary_and_writes_the_letters_as_one_token():
    from apps.calm_llm.data import Collator

    tok = synthetic.synthetic_tokenizer(4096)
    assert len(tok) == 4096 and (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (3840, 3841, 3844)
    assert tok("What is 2 plus 2?")["input_ids"][0] == tok.bos_token_id
    # every id the model can emit decodes (fillers included)
    assert isinstance(tok.decode(list(range(0, 4096, 7))), str)
    ids = Collator(tok, mode="letter", max_options=10).option_token_ids
    assert len(set(ids.tolist())) == 10
    big = synthetic.synthetic_tokenizer()
    assert len(big) == 128256 and big.eos_token_id == 128001


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=80))
def test_any_text_round_trips_through_the_tokenizer(text):
    tok = synthetic.synthetic_tokenizer(4096)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    assert all(i < 2048 + 256 for i in ids)  # learned tokens only: fillers are never produced


def test_synthetic_questions_are_right_distinct_and_balanced(tmp_path):
    rows = questions.questions("arithmetic", 200, seed=1)
    for r in rows:
        a, op, b = r["question"].removeprefix("What is ").rstrip("?").split()
        assert int(r["options"][r["label"]]) == (int(a) + int(b) if op == "plus" else int(a) - int(b))
        assert len(set(r["options"])) == 4
    assert len({r["question"] for r in rows}) == 200
    assert sorted({sum(r["label"] == k for r in rows) for k in range(4)}) == [50]
    cats = questions.questions("categories", 60)
    for r in cats:
        cat = r["question"].split()[-1].rstrip("?")
        assert [o in questions.CATEGORIES[cat] for o in r["options"]].count(True) == 1
        assert r["options"][r["label"]] in questions.CATEGORIES[cat]
    open_rows = questions.questions("open_arithmetic", 30)
    assert all(r["answers"][0].isdigit() for r in open_rows)
    assert questions.number_words(42) == "forty-two" and questions.number_words(17) == "seventeen"
    # read by the app as any user's file: no error, every row kept
    path = questions.write_jsonl(rows, tmp_path / "a.jsonl")
    assert len(load_source("synth_arith", path=path)) == 200
    assert questions.questions("arithmetic", 5, seed=2) == questions.questions("arithmetic", 5, seed=2)
    with pytest.raises(ValueError, match="unknown synthetic question kind 'trivia'"):
        questions.questions("trivia", 3)


def test_load_builds_a_random_model_on_the_device_with_lora():
    mc = ModelConfig(name_or_path=TINY, dtype="bf16", lora_r=4, lora_target_modules=["all-linear"])
    lm = load(mc, device=torch.device("cpu"))
    assert lm.vocab_size == 4096 and len(lm.tokenizer) == 4096
    assert lm.model.get_input_embeddings().weight.dtype == torch.bfloat16
    assert any("mlp.down_proj.lora_A" in n for n in lm.inner())
    # bf16 on the CPU: the packed shared-prefix forward agrees with the plain one within the
    # half-precision tolerance (the branch a bf16 GPU run takes)
    assert lm.prefix_layout == "packed"
    with pytest.raises(ModelLoadError, match="--quantization none"):
        load(ModelConfig(name_or_path=TINY, quantization="4bit"), device=torch.device("cpu"))


def test_qlora_refuses_without_cuda_even_with_bitsandbytes_installed(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "bitsandbytes" else real(name, *a))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="--quantization 4bit needs a CUDA GPU.*--quantization none"):
        load(ModelConfig(name_or_path="sshleifer/none", quantization="4bit"), device=torch.device("cpu"))
