"""Config: defaults < file < CLI, validation errors name the option, presets parse, help shows defaults."""

import json

import pytest

from apps.calm_llm import config as C


def test_defaults_are_the_embedded_cpu_run():
    cfg = C.parse_args([])
    assert cfg.model.name_or_path == "smollm2"
    assert cfg.data.mode == "cloze"
    assert cfg.data.in_domain == ["sciq"] and cfg.data.out_of_domain == ["arc_easy"]
    assert cfg.methods == ["none", "ts", "sft", "calm"]
    # the default preset file says the same as the dataclass defaults
    assert C.parse_args(["--config", "default"]).to_dict() == cfg.to_dict()


@pytest.mark.parametrize("preset", ["default", "tiny", "paper-7b"])
def test_presets_validate(preset):
    C.parse_args(["--config", preset])


def test_paper_preset_matches_method_notes():
    cfg = C.parse_args(["--config", "paper-7b"])
    m = cfg.model
    assert (m.lora_r, m.lora_alpha, m.lora_dropout, m.lora_target_modules) == (
        128, 64, 0.05, ["all-linear"])
    assert m.dtype == "bf16" and cfg.data.mode == "letter"
    assert cfg.data.in_domain == ["mmlu", "medmcqa", "openbookqa"]
    assert cfg.data.out_of_domain[0] == "arc_challenge"
    assert (cfg.train.schedule, cfg.train.warmup_ratio) == ("cosine", 0.1)


def test_cli_overrides_file(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("seed: 3\ntrain:\n  lr: 0.5\n  steps: 7\ncalm:\n  solver: aid\n")
    cfg = C.parse_args(["--config", str(f), "--lr", "0.25", "--methods", "sft", "calm"])
    assert cfg.seed == 3 and cfg.train.steps == 7 and cfg.calm.solver == "aid"
    assert cfg.train.lr == 0.25 and cfg.methods == ["sft", "calm"]
    j = tmp_path / "c.json"
    j.write_text(json.dumps({"calm": {"alpha_at_inference": False}}))
    assert C.parse_args(["--config", str(j)]).calm.alpha_at_inference is False
    assert C.parse_args(["--config", str(j), "--alpha-at-inference"]).calm.alpha_at_inference


def test_saved_config_round_trips(tmp_path):
    cfg = C.parse_args(["--config", "tiny", "--solver", "itd", "--lora-target-modules", "all-linear"])
    path = cfg.save(tmp_path)
    again = C.parse_args(["--config", str(path)])
    assert again.to_dict() == cfg.to_dict() and again.hash() == cfg.hash()
    assert C.parse_args(["--config", str(path), "--out", "x"]).hash() == cfg.hash()
    assert C.parse_args(["--config", str(path), "--seed", "1"]).hash() != cfg.hash()


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--methods", "calm", "bogus"], "bogus"),
        (["--solver", "newton"], "--solver"),
        (["--lr", "-1"], "--lr"),
        (["--lr", "0"], "--lr"),
        (["--alpha-support", "options"], "--alpha-support options needs --mode letter"),
        (["--upper-objective", "answer_tokens", "--mode", "letter"], "answer_tokens"),
        (["--in-domain", "nosuchset"], "nosuchset"),
        (["--solver", "aid", "--attn-implementation", "sdpa"], "double"),
        (["--data-files", "justapath"], "NAME=VALUE"),
        (["--methods"], "at least one method"),
        (["--inner-steps", "0"], "--inner-steps"),
        (["--max-options", "11"], "--max-options"),
        (["--label-smoothing-scope", "options"], "--label-smoothing-scope options needs --mode letter"),
        (["--in-domain", "sciq", "--out-of-domain", "sciq"], "share ['sciq']"),
        (["--n-ood", "0"], "--n-ood"),
        # rcft cannot train on instruction data in either scoring mode
        (["--methods", "rcft", "--instruction-data", "alpaca", "--data-files", "alpaca=a.jsonl"],
         "rcft needs MCQA"),
        (["--methods", "rcft", "--mode", "letter", "--instruction-data", "alpaca",
          "--data-files", "alpaca=a.jsonl"], "rcft needs MCQA"),
    ],
)
def test_bad_values_are_named(argv, needle, capsys):
    with pytest.raises((C.ConfigError, SystemExit)) as e:
        C.parse_args(argv)
    msg = str(e.value) if e.type is C.ConfigError else capsys.readouterr().err
    assert needle in msg


def test_unknown_file_keys_are_named(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  learning_rate: 1\n")
    with pytest.raises(C.ConfigError, match="learning_rate"):
        C.parse_args(["--config", str(f)])
    f.write_text("train:\n  lr: fast\n")
    with pytest.raises(C.ConfigError, match="train.lr"):
        C.parse_args(["--config", str(f)])
    with pytest.raises(C.ConfigError, match="preset"):
        C.parse_args(["--config", "no-such-preset"])


def test_help_documents_every_option_with_default():
    text = " ".join(C.build_parser().format_help().split())
    for _sec, f in C.leaf_fields():
        assert C.flag_of(f) in text
    assert "(default: 'bome')" in text and "(default: 0.001)" in text


def test_config_source_list_matches_the_data_registry():
    # config keeps its own copy so that validation (and --help) never imports torch; this keeps
    # the two from drifting apart.
    from apps.calm_llm import data

    assert C.MCQA_SOURCES == data.MCQA_SOURCES


def test_docs_options_tables_are_the_config():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "calm.md").read_text()
    assert C.options_markdown() in doc, "regenerate docs/calm.md's Options with config.options_markdown()"


def test_split_seed_fixes_the_questions_across_training_seeds():
    from apps.calm_llm.tasks.mcqa import load_data

    def ids(argv):
        s = load_data(C.parse_args(["--config", "tiny", *argv]))
        return [e.id for e in s.train], [e.id for e in s.calib], {k: [e.id for e in v] for k, v in s.test.items()}

    assert C.split_seed(C.parse_args(["--seed", "3"])) == 3  # -1 follows --seed
    assert C.split_seed(C.parse_args(["--seed", "3", "--split-seed", "0"])) == 0
    fixed = ids(["--seed", "0"])
    assert ids(["--seed", "5", "--split-seed", "0"]) == fixed
    assert ids(["--seed", "5"]) != fixed
    with pytest.raises(C.ConfigError, match="--split-seed"):
        C.parse_args(["--split-seed", "-2"])


def test_rcft_and_label_smoothing_options_are_their_methods_own_with_the_same_flags():
    cfg = C.parse_args(["--methods", "rcft", "label_smoothing", "--rcft-weight", "0.3",
                        "--label-smoothing", "0.2", "--label-smoothing-scope", "vocab"])
    assert cfg.options_of("rcft").weight == 0.3 and cfg.options_of("label_smoothing").epsilon == 0.2
    assert not hasattr(cfg.train, "rcft_weight") and not hasattr(cfg.train, "label_smoothing")
    # their flags are compared in every run, as when they were train options: no hash moved
    assert {"--rcft-weight", "--label-smoothing", "--label-smoothing-scope"} <= set(
        C.parse_args([]).comparable())
    with pytest.raises(C.ConfigError, match="--rcft-weight: must be >= 0, got -1.0"):
        C.parse_args(["--rcft-weight", "-1"])
    # a config.json written when they were train options loads into the new place
    old = C.from_dict({"train": {"rcft_weight": 0.25, "label_smoothing_scope": "options",
                                 "lr": 0.01}})
    assert old.options_of("rcft").weight == 0.25 and old.train.lr == 0.01
    assert old.options_of("label_smoothing").scope == "options"
    assert C.from_dict(cfg.to_dict()).comparable() == cfg.comparable()
