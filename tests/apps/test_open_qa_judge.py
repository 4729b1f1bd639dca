"""The open-QA answer judge: alias modes are `calibration.semantic.matches`; the LLM judge is
asked only what alias matching cannot decide, and its verdict is p(yes) > p(no) of a forward."""

import pytest
import torch

from apps.calm_llm.open_qa import judge as J
from calibration import semantic

ITEMS = [
    ("Capital of France?", "Paris", ["Paris", "Paree"]),        # exact alias
    ("Capital of France?", "It is Paris.", ["Paris"]),           # contains, not exact
    ("Capital of France?", "The.", ["Paris"]),                   # normalizes to ""
    ("Who wrote Hamlet?", "Shakespeare", ["William Shakespeare"]),
    ("Who wrote Hamlet?", "Marlowe", ["William Shakespeare"]),
]


@pytest.mark.parametrize("mode", ["exact", "contains"])
def test_alias_modes_are_semantic_matches(mode):
    want = [semantic.matches(a, al, mode=mode) for _, a, al in ITEMS]
    assert J.judge_answers(ITEMS, mode) == want


class Recorder:
    def __init__(self, verdict):
        self.verdict, self.calls = verdict, []

    def __call__(self, items):
        self.calls.append(list(items))
        return [self.verdict] * len(items)


@pytest.mark.parametrize("verdict", [True, False])
def test_the_judge_is_asked_once_and_only_what_matching_cannot_decide(verdict):
    rec = Recorder(verdict)
    got = J.judge_answers(ITEMS, "judge", rec)
    assert got == [True, verdict, False, verdict, verdict]
    assert rec.calls == [[ITEMS[1], ITEMS[3], ITEMS[4]]]


def test_judge_mode_without_a_judge_is_an_error():
    with pytest.raises(ValueError, match="--judge-model"):
        J.judge_answers(ITEMS, "judge", None)


@pytest.fixture(scope="module")
def tiny_judge():
    return J.LLMJudge.load("tiny", batch_size=2)


def test_verdicts_are_yes_against_no_of_a_direct_forward(tiny_judge):
    j = tiny_judge
    p = j.p_yes(ITEMS)  # batches of 2, left-padded
    for item, got in zip(ITEMS, p):
        text = j.prompt(*item)
        ids = torch.tensor([_encode(j, text)])
        with torch.no_grad():
            probs = j.model(input_ids=ids).logits[0, -1].float().softmax(-1)
        yes, no = probs[j.yes].sum(), probs[j.no].sum()
        assert got == pytest.approx(float(yes / (yes + no)), abs=1e-5)
    assert j(ITEMS) == [x > 0.5 for x in p]


def _encode(j, text):
    from apps.calm_llm.sampling import encode_prompts

    return encode_prompts(j.tokenizer, [text])[0]


def test_yes_and_no_token_sets(tiny_judge):
    assert tiny_judge.yes and tiny_judge.no and not set(tiny_judge.yes) & set(tiny_judge.no)
    assert "Gold answers: William Shakespeare" in tiny_judge.prompt(*ITEMS[3])
