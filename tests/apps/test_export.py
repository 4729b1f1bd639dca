"""Export: the adapter loads with peft, α loads from safetensors+JSON, and a LogitsProcessor
applies α during generate."""

import dataclasses

import pytest
import torch
from peft import PeftModel
from transformers import LogitsProcessorList

from apps.calm_llm import config as C
from apps.calm_llm import methods
from apps.calm_llm.data import Collator, MCQAExample
from apps.calm_llm.export import (
    AlphaLogitsProcessor,
    BaseMismatch,
    check_base,
    export_method,
    load_adapter,
)
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
    assert (out / "adapter_config.json").is_file()

    # the adapter, loaded by peft onto a fresh copy of the base model, reproduces the logits
    base, _ = load_base(cfg.model, seed=0)
    reloaded = PeftModel.from_pretrained(base, str(out)).eval()  # the folder as it is
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


# -- an export knows its base ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """An untrained calm export on the tiny base (seed 0): what is checked is whose it is."""
    out = tmp_path_factory.mktemp("export")
    cfg = C.parse_args(["--config", "tiny", "--mode", "letter"])
    lm = load(cfg.model, device=torch.device("cpu"), seed=0)
    col = Collator(lm.tokenizer, mode="letter", max_length=96)
    ctx = Context(cfg=cfg, lm=lm, collator=col, train_examples=EX, calib_examples=EX,
                  train_collator=col, option_token_ids=col.option_token_ids)
    export_method(out, lm, methods.get("calm")(ctx))
    return out, cfg, lm


def test_the_export_records_the_base_name_and_fingerprint(exported):
    import json

    out, cfg, lm = exported
    rec = json.loads((out / "base.json").read_text())
    assert rec["name_or_path"] == "tiny" and rec["vocab_size"] == lm.vocab_size
    assert len(rec["embedding_sha256"]) == 64 and len(rec["embedding_rows"]) == 5
    check_base(out, lm)
    check_base(out, load_base(cfg.model, seed=0)[0])  # a fresh copy of the same base
    bf16 = dataclasses.replace(cfg.model, dtype="bf16")
    check_base(out, load_base(bf16, seed=0)[0])  # the same base in bf16: the same fingerprint


def test_an_adapter_or_alpha_on_another_base_is_refused(exported):
    out, cfg, _ = exported
    other, _ = load_base(cfg.model, seed=1)  # same architecture and vocabulary, other weights
    with pytest.raises(BaseMismatch, match=r"was trained on 'tiny' \(embedding \[50280, 32\], "
                                           r"fingerprint [0-9a-f]{12}\); this model has other weights"):
        check_base(out, other)
    with pytest.raises(BaseMismatch):
        load_adapter(out, other, in_place=True)
    with pytest.raises(BaseMismatch):
        AlphaLogitsProcessor.from_dir(out, model=other)
    wider, _ = load_base(cfg.model, seed=0)
    wider.resize_token_embeddings(50288)
    with pytest.raises(BaseMismatch, match="whose logits have 50280 entries; this model's have 50288"):
        check_base(out, wider)
    same, _ = load_base(cfg.model, seed=0)
    assert isinstance(load_adapter(out, same, in_place=True), PeftModel)


def test_the_processor_refuses_scores_of_another_vocabulary(exported):
    out, _, lm = exported
    proc = AlphaLogitsProcessor.from_dir(out)
    assert proc.vocab_size == lm.vocab_size
    proc(torch.zeros(1, 1, dtype=torch.long), torch.randn(1, lm.vocab_size))
    with pytest.raises(ValueError, match=r"logits have 50280 entries, but these scores have 49152"):
        proc(torch.zeros(1, 1, dtype=torch.long), torch.randn(1, 49152))


def test_an_export_without_a_base_record_still_loads_but_cannot_be_checked(exported, tmp_path):
    import shutil

    out, _, lm = exported
    old = tmp_path / "old"
    shutil.copytree(out, old)
    (old / "base.json").unlink()
    assert AlphaLogitsProcessor.from_dir(old).vocab_size is None
    with pytest.raises(FileNotFoundError, match="no base.json"):
        check_base(old, lm)
