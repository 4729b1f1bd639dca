"""Issue 29's data and config faults, one table row each: the fault, the expected message."""

from __future__ import annotations

import pytest

from apps.calm_llm.config import ConfigError, load_file, parse_args

# (file name, its text, words the refusal must contain). A new config-file fault is one line.
CONFIG_FILE_FAULTS = [
    ("twice.yaml", "train: {steps: 4}\ntrain: {steps: 8}\n", ["'train'", "line 1 and line 2"]),
    ("nested.yaml", "train:\n  steps: 4\n  lr: 0.1\n  steps: 8\n", ["'steps'", "line 2 and line 4"]),
    ("top.yaml", "seed: 1\nmethods: [none]\nseed: 2\n", ["'seed'", "line 1 and line 3"]),
    ("twice.json", '{"train": {"steps": 4},\n "train": {"steps": 8}}', ["'train'", "lines 1, 2"]),
    ("nested.json", '{"train": {\n "steps": 4,\n "steps": 8}}', ["'steps'", "lines 2, 3"]),
]


@pytest.mark.parametrize(("name", "text", "words"), CONFIG_FILE_FAULTS, ids=[r[0] for r in CONFIG_FILE_FAULTS])
def test_config_file_key_given_twice_is_refused(tmp_path, name, text, words):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_file(path)
    assert str(path) in str(e.value) and "given twice" in str(e.value)
    for w in words:
        assert w in str(e.value)
    # the command line refuses it too (the probe: 8 steps were run silently)
    with pytest.raises(ConfigError, match="given twice"):
        parse_args(["--config", str(path)])


def test_yaml_merge_key_may_be_overridden(tmp_path):
    """YAML's "<<" merge is meant to be overridden: not a key given twice."""
    path = tmp_path / "merge.yaml"
    path.write_text("train:\n  <<: {steps: 4, lr: 0.1}\n  steps: 8\n")
    assert load_file(path) == {"train": {"steps": 8, "lr": 0.1}}


def test_same_key_in_two_sections_is_fine(tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_text("train: {steps: 4}\ncalm: {inner_steps: 4}\n")
    assert parse_args(["--config", str(path)]).train.steps == 4
