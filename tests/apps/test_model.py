"""model.py: the functional forward over LoRA tensors equals the module forward, only LoRA trains."""

import pytest
import torch

from apps.calm_llm.config import ModelConfig
from apps.calm_llm.data import Collator, MCQAExample
from apps.calm_llm.model import load
from apps.errors import ConfigError

EXAMPLES = [
    MCQAExample("q0", "What do plants absorb?", ("carbon dioxide", "gold", "helium", "salt"), 0, "t"),
    MCQAExample("q1", "Which is a mammal?", ("shark", "whale", "trout"), 1, "t"),
]


@pytest.fixture(scope="module")
def lm():
    return load(ModelConfig(name_or_path="tiny", lora_r=4), device=torch.device("cpu"), seed=0)


def test_only_lora_requires_grad(lm):
    trainable = [n for n, p in lm.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert set(trainable) == set(lm.inner())


def test_functional_forward_matches_module_and_last_only(lm):
    batch = Collator(lm.tokenizer, mode="letter", max_length=64)(EXAMPLES)
    with torch.no_grad():
        ref = lm.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                       position_ids=batch.position_ids).logits
        full = lm.logits(lm.inner_state(), batch)
        last = lm.logits(lm.inner_state(), batch, last_only=True)
    torch.testing.assert_close(full, ref.float())
    assert last.shape == (2, 1, lm.vocab_size)
    torch.testing.assert_close(last[:, 0], full[:, -1])


def test_inner_dict_replaces_lora_for_the_call_only(lm):
    batch = Collator(lm.tokenizer, mode="cloze", max_length=64)(EXAMPLES)
    state = lm.inner_state()
    bumped = {n: t + 0.5 if "lora_B" in n else t for n, t in state.items()}
    with torch.no_grad():
        base = lm.logits(None, batch)
        other = lm.logits(bumped, batch)
        again = lm.logits(None, batch)
    assert (base - other).abs().max() > 1e-3  # LoRA B = 0 at init; bumping it changes the output
    torch.testing.assert_close(base, again)
    # gradients reach exactly the tensors passed in
    inner = {n: t.clone().requires_grad_(True) for n, t in bumped.items()}
    loss = lm.logits(inner, batch).logsumexp(-1).mean()
    grads = torch.autograd.grad(loss, list(inner.values()))
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert any(g.abs().sum() > 0 for g in grads)
    assert all(p.grad is None for p in lm.model.parameters())


def test_load_inner_round_trip_and_mismatch(lm):
    state = lm.inner_state()
    new = {n: torch.randn_like(t) for n, t in state.items()}
    lm.load_inner(new)
    torch.testing.assert_close(lm.inner_state(), new)
    lm.load_inner(state)
    with pytest.raises(KeyError, match="mismatch"):
        lm.load_inner({"x": torch.zeros(1)})


def test_eager_all_linear_and_second_order():
    lm = load(ModelConfig(name_or_path="tiny", lora_r=2, lora_target_modules=["all-linear"]),
              device=torch.device("cpu"), eager=True)
    assert lm.model.config._attn_implementation == "eager"
    assert any("mlp.down_proj.lora_A" in n for n in lm.inner())
    batch = Collator(lm.tokenizer, mode="letter", max_length=64)(EXAMPLES)
    inner = {n: (t + 0.1).requires_grad_(True) for n, t in lm.inner_state().items()}
    loss = lm.logits(inner, batch, last_only=True).pow(2).mean()
    g = torch.autograd.grad(loss, list(inner.values()), create_graph=True)
    hv = torch.autograd.grad(sum((x * x).sum() for x in g), list(inner.values()))
    assert all(torch.isfinite(h).all() for h in hv)


def test_bad_target_modules_named():
    with pytest.raises(ValueError, match="lora-target-modules"):
        load(ModelConfig(name_or_path="tiny", lora_target_modules=["nonexistent_proj"]),
             device=torch.device("cpu"))


def test_quantization_without_bitsandbytes_is_a_clear_error():
    import importlib.util

    if importlib.util.find_spec("bitsandbytes") is not None:
        pytest.skip("bitsandbytes installed")
    with pytest.raises(ConfigError, match="bitsandbytes"):
        load(ModelConfig(name_or_path="sshleifer/none", quantization="4bit"), device=torch.device("cpu"))
