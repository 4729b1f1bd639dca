"""Exports that travel: every calibrated method exports (ts too), the folder loads as it is, its
scores are the run's, it names its base portably, it carries a model card, and lm-eval-harness
scores it with α or T applied (issue 31)."""

import json
import shutil

import pytest
import torch
import yaml
from peft import PeftModel
from safetensors.torch import load_file, save_file

from apps.calm_llm import config as C
from apps.calm_llm.__main__ import main
from apps.calm_llm.calibrated import CalibrationError, load_export
from apps.calm_llm.export import AlphaLogitsProcessor, load_adapter, portable, portable_base_name
from apps.calm_llm.model import load_base
from apps.calm_llm.tasks.mcqa import load_data

ROWS = ("ts", "sft", "calm")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny cloze run of none, ts, sft and calm (2 steps), its config and splits, and a copy
    of the calm export whose α is made visibly non-identity (2 steps barely move it)."""
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("run")
    assert main(["--config", "tiny", "--methods", "none", *ROWS, "--steps", "2", "--n-boot", "10",
                 "--no-zero-shot", "--checkpoint-every", "0", "--out", str(out)]) == 0
    cfg = C.from_dict(json.loads((out / "config.json").read_text()))
    moved = out / "export" / "calm_moved"
    shutil.copytree(out / "export" / "calm", moved)
    g = torch.Generator().manual_seed(0)
    alpha = load_file(str(moved / "alpha.safetensors"))
    # shifts of a few nats on the support's 83 tokens move every log-softmax visibly
    save_file({n: t + 3.0 * torch.randn(t.shape, generator=g) for n, t in alpha.items()},
              str(moved / "alpha.safetensors"))
    return out, cfg, load_data(cfg)


def _eval_sets(splits):
    return [*splits.test.items(), *splits.ood.items()]


@pytest.mark.slow
@pytest.mark.parametrize("row", ROWS)
def test_the_export_scores_as_the_run_predicted(run, row):
    out, _, splits = run
    preds = load_file(str(out / "predictions.safetensors"))
    model = load_export(out / "export" / row)  # the base that base.json names, loaded here
    for name, examples in _eval_sets(splits):
        probs = torch.softmax(model.option_scores(examples), -1)
        torch.testing.assert_close(probs, preds[f"{row}/{name}/probs"], rtol=0, atol=1e-5)
    if row == "ts":  # T matters: without it the distribution is the untouched model's
        name, examples = _eval_sets(splits)[0]
        raw = torch.softmax(model.option_scores(examples, calibrated=False), -1)
        assert float((raw - preds[f"ts/{name}/probs"]).abs().max()) > 1e-2


def test_only_the_untouched_model_has_no_export_and_ts_records_what_t_divides(run):
    out, _, _ = run
    assert not (out / "export" / "none").exists()
    metrics = json.loads((out / "metrics.json").read_text())["results"]
    cal = json.loads((out / "export" / "ts" / "calibration.json").read_text())
    assert cal["applies"] == "temperature" and cal["acts_on"] == "options"
    assert cal["temperature"] == pytest.approx(metrics["ts"]["sciq"]["temperature"], rel=1e-12)
    assert "sum_t log p(y_t | context, y_<t)" in cal["divides"] and "softmax(s / T)" in cal["divides"]
    assert json.loads((out / "export" / "calm" / "calibration.json").read_text())["acts_on"] == "vocab"
    assert json.loads((out / "export" / "sft" / "calibration.json").read_text())["applies"] == "none"


def test_the_folder_loads_with_peft_as_it_is_and_load_adapter_says_in_place(run):
    out, cfg, _ = run
    d = out / "export" / "sft"
    base, tok = load_base(cfg.model, seed=cfg.seed)
    ids = tok("Question: why?\nAnswer: because", return_tensors="pt").input_ids
    with torch.no_grad():
        plain = base(input_ids=ids).logits
        kept = load_adapter(d, base, in_place=False)  # a copy is wrapped: base stays plain
        assert not any("lora" in n for n, _ in base.named_modules())
        wrapped = PeftModel.from_pretrained(base, str(d)).eval()  # the folder as it is
        torch.testing.assert_close(wrapped(input_ids=ids).logits, kept(input_ids=ids).logits)
        assert float((wrapped(input_ids=ids).logits - plain).abs().max()) > 0  # trained LoRA B
    assert any("lora" in n for n, _ in base.named_modules())  # peft wrapped base itself


def test_no_path_of_the_training_machine_travels(run):
    out, _, _ = run
    for row in ROWS:
        d = out / "export" / row
        for f in [*d.glob("*.json"), d / "README.md"]:
            assert str(out) not in f.read_text() and "/tmp" not in f.read_text(), f
        assert json.loads((d / "adapter_config.json").read_text())["base_model_name_or_path"] == "tiny"
        base = json.loads((d / "base.json").read_text())
        assert base["name_or_path"] == base["model_option"] == "tiny"
    assert portable({"out": "/runs/x", "data": {"data_files": ["mine=/data/q.jsonl"], "mode": "cloze"}}) \
        == {"out": "x", "data": {"data_files": ["mine=q.jsonl"], "mode": "cloze"}}
    assert portable_base_name("/models/Llama-3.1-8B")[0] == "Llama-3.1-8B"
    assert portable_base_name("smollm2")[0] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert "dequantized" in portable_base_name("smollm2")[1]
    assert portable_base_name("allenai/Llama-3.1-Tulu-3-8B-DPO")[0] == "allenai/Llama-3.1-Tulu-3-8B-DPO"


def test_every_export_has_a_model_card(run):
    out, _, _ = run
    metrics = json.loads((out / "metrics.json").read_text())["results"]
    for row in ROWS:
        d = out / "export" / row
        text = (d / "README.md").read_text()
        front = yaml.safe_load(text.split("---\n")[1])
        assert front["base_model"] == "tiny" and front["library_name"] == "peft"
        assert row in front["tags"] and front["datasets"] == ["allenai/sciq", "allenai/ai2_arc"]
        r = metrics[row]["arc_easy"]
        lo, hi = r["conf_ece_ci"]
        assert (f"| arc_easy | out | 8 | {r['accuracy']:.3f} | {r['conf_ece']:.3f} [{lo:.3f}, {hi:.3f}] "
                f"| {r['nll']:.3f} |") in text
        assert "train 16, calib 8, test/sciq 8, ood/arc_easy 8" in text
        for png in ("reliability_sciq.png", "reliability_arc_easy.png"):
            assert (d / png).is_file() and f"]({png})" in text
        assert "load_export(" in text and "option_scores(" in text and "## Command" in text
    assert "temperature T = " in (out / "export" / "ts" / "README.md").read_text()
    calm = (out / "export" / "calm" / "README.md").read_text()
    assert "## α" in calm and "- tau: min " in calm and "- shift: min " in calm and "83 token ids" in calm


def test_generate_applies_alpha_and_refuses_a_temperature_without_a_token_form(run):
    out, _, _ = run
    model = load_export(out / "export" / "calm_moved")
    ids = model.tokenizer("Question: what?\nAnswer:", return_tensors="pt").input_ids
    got = model.generate(input_ids=ids, max_new_tokens=4, do_sample=False)
    from transformers import LogitsProcessorList

    proc = AlphaLogitsProcessor.from_dir(out / "export" / "calm_moved", model=model.model.get_base_model())
    with torch.no_grad():
        want = model.model.generate(input_ids=ids, max_new_tokens=4, do_sample=False,
                                    logits_processor=LogitsProcessorList([proc]),
                                    pad_token_id=model.tokenizer.pad_token_id)
    assert got.tolist() == want.tolist()
    ts = load_export(out / "export" / "ts")
    with pytest.raises(CalibrationError, match="divides summed option log-likelihoods"):
        ts.generate(input_ids=ids, max_new_tokens=2)
    assert ts.generate(input_ids=ids, max_new_tokens=2, do_sample=False, calibrated=False).shape[1] == ids.shape[1] + 2


# -- lm-evaluation-harness ---------------------------------------------------------------------------
def _task(tmp_path, examples):
    """An lm-eval multiple-choice task over `examples`, the app's cloze prompt, local data."""
    rows = [{"question": e.question, "options": list(e.options), "label": e.label} for e in examples]
    (tmp_path / "q.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "calm_tiny_mc.yaml").write_text(yaml.safe_dump({
        "task": "calm_tiny_mc", "dataset_path": "json", "test_split": "test",
        "dataset_kwargs": {"data_files": {"test": str(tmp_path / "q.jsonl")}},
        "output_type": "multiple_choice", "doc_to_text": "Question: {{question}}\nAnswer:",
        "doc_to_choice": "{{options}}", "doc_to_target": "{{label}}", "metric_list": [{"metric": "acc"}],
    }))
    return tmp_path


def _lm_eval_option_lls(lm, task_dir):
    import lm_eval
    from lm_eval.tasks import TaskManager

    res = lm_eval.simple_evaluate(model=lm, tasks=["calm_tiny_mc"], log_samples=True,
                                  task_manager=TaskManager(include_path=str(task_dir),
                                                           include_defaults=False))
    samples = sorted(res["samples"]["calm_tiny_mc"], key=lambda s: s["doc_id"])
    return [torch.tensor([float(r[0][0]) for r in s["resps"]]) for s in samples]


@pytest.mark.slow
@pytest.mark.parametrize("row", ["calm_moved", "ts"])
def test_lm_eval_scores_the_export_with_its_calibration(run, row, tmp_path, monkeypatch):
    pytest.importorskip("lm_eval")
    from lm_eval.api.registry import get_model

    from apps.calm_llm.lm_eval_model import CalmLM

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    assert get_model("calm") is CalmLM  # importing the module registered it
    out, _, splits = run
    examples = list(splits.test["sciq"])[:4]
    task = _task(tmp_path, examples)
    d = out / "export" / row
    got = _lm_eval_option_lls(CalmLM(export=str(d), batch_size=4), task)
    own = load_export(d).option_scores(examples)  # the project's own evaluation of the export
    for i, lls in enumerate(got):
        torch.testing.assert_close(lls.double(), own[i, : len(lls)].double(), rtol=0, atol=1e-4)
    bare = _lm_eval_option_lls(CalmLM(export=str(d), batch_size=4, calibrated="false"), task)
    assert max(float((a - b).abs().max()) for a, b in zip(got, bare)) > 1e-2  # α / T really applied


@pytest.mark.slow
def test_letter_mode_exports_score_as_the_run_predicted(tmp_path):
    """Letter mode: α acts on the answer position's logits and T divides the letters' logits."""
    torch.set_num_threads(1)
    assert main(["--config", "tiny", "--mode", "letter", "--methods", "ts", "calm", "--steps", "1",
                 "--n-boot", "0", "--no-zero-shot", "--checkpoint-every", "0", "--out", str(tmp_path)]) == 0
    splits = load_data(C.from_dict(json.loads((tmp_path / "config.json").read_text())))
    preds = load_file(str(tmp_path / "predictions.safetensors"))
    for row in ("ts", "calm"):
        model = load_export(tmp_path / "export" / row)
        for name, examples in _eval_sets(splits):
            torch.testing.assert_close(torch.softmax(model.option_scores(examples), -1),
                                       preds[f"{row}/{name}/probs"], rtol=0, atol=1e-5)
    cal = json.loads((tmp_path / "export" / "ts" / "calibration.json").read_text())
    assert "letters' next-token logits" in cal["divides"]
    ts = load_export(tmp_path / "export" / "ts")  # letter T is a next-token 1/T: it generates
    assert ts.logits_processors()[0].temperature == cal["temperature"]


@pytest.mark.slow
def test_a_base_given_by_folder_is_checked_and_used(run, tmp_path):
    """An export of a run on a local folder names only the folder: loading it asks for the base,
    and a base passed (as an object, or to lm-eval as base=PATH) is checked and used."""
    out, cfg, splits = run
    d = tmp_path / "export"
    shutil.copytree(out / "export" / "calm_moved", d)
    record = json.loads((d / "base.json").read_text())
    (d / "base.json").write_text(json.dumps({**record, "model_option": None, "name_or_path": "my-base"}))
    with pytest.raises(CalibrationError, match="local folder 'my-base'.*pass it as base="):
        load_export(d)
    base, tok = load_base(cfg.model, seed=cfg.seed)
    base.save_pretrained(tmp_path / "my-base")
    tok.save_pretrained(tmp_path / "my-base")
    examples = list(splits.test["sciq"])[:2]
    want = load_export(out / "export" / "calm_moved").option_scores(examples)
    torch.testing.assert_close(load_export(d, base, tok).option_scores(examples), want)
    pytest.importorskip("lm_eval")
    from apps.calm_llm.lm_eval_model import CalmLM

    lm = CalmLM(export=str(d), base=str(tmp_path / "my-base"), batch_size=2)
    torch.testing.assert_close(lm.calibrated_model.option_scores(examples), want)


def test_lm_eval_generates_with_alpha(run):
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance

    from apps.calm_llm.lm_eval_model import CalmLM

    out, _, _ = run
    lm = CalmLM(export=str(out / "export" / "calm_moved"), batch_size=1)
    context = "Question: what do plants need?\nAnswer:"
    got = lm.generate_until([Instance("generate_until", {}, (context, {
        "until": ["\n\n\n\n"], "max_gen_toks": 5, "do_sample": False}), 0)])[0]
    model = lm.calibrated_model
    ids = model.tokenizer(context, return_tensors="pt").input_ids
    for calibrated in (True, False):
        gen = model.generate(input_ids=ids, max_new_tokens=5, do_sample=False, calibrated=calibrated)
        text = model.tokenizer.decode(gen[0, ids.shape[1]:], skip_special_tokens=True)
        assert (got == text) is calibrated  # α's shifts change the greedy tokens
