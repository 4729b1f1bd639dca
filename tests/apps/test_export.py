"""Export: the adapter loads with peft, α loads from safetensors+JSON, and a LogitsProcessor
applies α during generate."""

import pytest
import torch
from peft import PeftModel
from transformers import LogitsProcessorList

from apps.calm_llm import config as C
from apps.calm_llm import methods
from apps.calm_llm.data import Collator, MCQAExample
from apps.calm_llm.export import AlphaLogitsProcessor, export_method
from apps.calm_llm.methods.base import Context
from apps.calm_llm.model import load, load_base

EX = [MCQAExample(f"e{i}", f"Is {i} even?", ("yes", "no", "maybe"), i % 2, "t") for i in range(8)]


def test_export_round_trip_and_generate(tmp_path):
    cfg = C.parse_args(["--config", "tiny", "--mode", "letter", "--steps", "2",
                        "--alpha-support", "vocab"])  # generate() below shifts any token
    lm = load(cfg.model, device=torch.device("cpu"), seed=0)
    col = Collator(lm.tokenizer, mode="letter", max_length=96)
    ctx = Context(cfg=cfg, lm=lm, collator=col, train_examples=EX, calib_examples=EX,
                  train_collator=col, option_token_ids=col.option_token_ids)
    m = methods.get("calm")(ctx)
    with lm.mode(True):
        for k in range(2):
            m.step(k)
    with torch.no_grad():  # make α visibly non-identity
        for t in m.alpha.params.values():
            t.add_(0.1 * torch.randn_like(t))
    out = export_method(tmp_path, lm, m)
    assert (out / "adapter" / "adapter_config.json").is_file()

    # the adapter, loaded by peft onto a fresh copy of the base model, reproduces the logits
    base, _ = load_base(cfg.model, seed=0)
    reloaded = PeftModel.from_pretrained(base, str(out / "adapter")).eval()
    batch = col(EX[:3])
    with torch.no_grad():
        ref = lm.logits(None, batch)
        got = reloaded(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                       position_ids=batch.position_ids).logits
    assert any("lora_B" in n and p.abs().sum() > 0 for n, p in reloaded.named_parameters())
    torch.testing.assert_close(got, ref)

    # the processor applies exactly the learned α
    proc = AlphaLogitsProcessor.from_dir(out)
    scores = torch.randn(2, lm.vocab_size)
    torch.testing.assert_close(proc(torch.zeros(2, 1, dtype=torch.long), scores),
                               m.alpha.apply(m.alpha.params, scores).detach())

    # and acts inside generate: a huge shift on one token makes greedy decoding emit only it
    target = 1234
    shift = torch.zeros(lm.vocab_size)
    shift[target] = 1e4
    forced = AlphaLogitsProcessor(proc.param, {**proc.params, "shift": shift})
    ids = lm.tokenizer("Hello", return_tensors="pt").input_ids
    with torch.no_grad():
        gen = reloaded.generate(input_ids=ids, max_new_tokens=3, do_sample=False,
                                logits_processor=LogitsProcessorList([forced]),
                                pad_token_id=lm.tokenizer.pad_token_id)
    assert gen[0, ids.shape[1]:].tolist() == [target] * 3


def test_processor_refuses_alpha_the_run_did_not_evaluate_with(tmp_path):
    cfg = C.parse_args(["--config", "tiny", "--mode", "letter", "--no-alpha-at-inference"])
    lm = load(cfg.model, device=torch.device("cpu"), seed=0)
    col = Collator(lm.tokenizer, mode="letter", max_length=96)
    ctx = Context(cfg=cfg, lm=lm, collator=col, train_examples=EX, calib_examples=EX,
                  train_collator=col, option_token_ids=col.option_token_ids)
    out = export_method(tmp_path, lm, methods.get("calm")(ctx))
    with pytest.raises(ValueError, match="no-alpha-at-inference"):
        AlphaLogitsProcessor.from_dir(out)
    assert AlphaLogitsProcessor.from_dir(out, force=True).params  # still loadable on request
