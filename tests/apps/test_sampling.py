"""sampling.py on the tiny model: the shared prompt cache equals the reference path, processors act
on the raw logits before the sampling warpers, seeding, greedy log-probabilities."""

import pytest
import torch
from transformers import LogitsProcessor

from apps.calm_llm import sampling as S
from apps.calm_llm.config import ModelConfig
from apps.calm_llm.model import load

# different lengths, so the batch is left-padded
PROMPTS = ["Question: what is the capital of France?\nAnswer:", "Hi there", "Name a colour:"]


@pytest.fixture(scope="module")
def lm():
    lm = load(ModelConfig(name_or_path="tiny", lora_r=4), device=torch.device("cpu"), seed=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # LoRA B starts at zero: perturb it so the adapters change the function
        for name, p in lm.inner().items():
            if "lora_B" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
    return lm


def _padded(lm, prompts):
    ids, mask = S.left_pad(S.encode_prompts(lm.tokenizer, prompts), S.pad_id_of(lm.tokenizer), lm.device)
    return ids, mask


def _raw_last_logits(lm, prompts):
    """Direct forward of the left-padded prompts: the next-token logits (B, V)."""
    ids, mask = _padded(lm, prompts)
    with torch.no_grad():
        return lm.model(input_ids=ids, attention_mask=mask, position_ids=S.position_ids(mask)).logits[:, -1].float()


def _run(lm, *, n, share, do_sample, max_new_tokens=6, processors=None):
    ids, mask = _padded(lm, PROMPTS)
    cfg = S.generation_config(lm, do_sample=do_sample, max_new_tokens=max_new_tokens, scores=True)
    with torch.no_grad():
        torch.manual_seed(0)
        return S.generate_batch(lm, ids, mask, n=n, config=cfg, processors=S.processor_list(processors),
                                share_prompt=share, stop=S.stop_mask(lm))


def test_shared_prompt_cache_equals_num_return_sequences(lm):
    ref, got = _run(lm, n=1, share=False, do_sample=False), _run(lm, n=1, share=True, do_sample=False)
    assert torch.equal(ref.sequences, got.sequences)
    for a, b in zip(ref.scores, got.scores):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=0)
    # n > 1 samples: the first step's logits agree row for row, in the same layout
    ref, got = _run(lm, n=3, share=False, do_sample=True), _run(lm, n=3, share=True, do_sample=True)
    torch.testing.assert_close(got.scores[0], ref.scores[0], atol=1e-5, rtol=0)
    raw = _raw_last_logits(lm, PROMPTS).repeat_interleave(3, 0)
    torch.testing.assert_close(got.scores[0], raw, atol=1e-5, rtol=0)


class NewlineAfterEven(LogitsProcessor):
    """A row-dependent stop: a row whose last token id is even is forced to the newline next, so
    rows of one batch end at different steps (and leave `decode`'s batch one by one)."""

    def __init__(self, newline):
        self.newline = newline

    def __call__(self, input_ids, scores):
        out = scores.clone()
        even = input_ids[:, -1] % 2 == 0
        out[even] = float("-inf")
        out[even, self.newline] = 0.0
        return out


class BanStops(LogitsProcessor):
    def __init__(self, stop):
        self.stop = stop

    def __call__(self, input_ids, scores):
        return scores.masked_fill(self.stop[: scores.shape[-1]], float("-inf"))


def _cut(row, stop):
    """Generated ids up to and including the first end-of-answer token."""
    hits = stop[row].nonzero()
    return row[: int(hits[0]) + 1] if hits.numel() else row


def test_decode_drops_finished_rows_and_equals_generate_greedy(lm):
    (nl,) = lm.tokenizer("\n", add_special_tokens=False)["input_ids"]
    procs = [_Scale(0.7), NewlineAfterEven(nl)]
    ref = _run(lm, n=2, share=True, do_sample=False, max_new_tokens=8, processors=procs)
    ids, mask = _padded(lm, PROMPTS)
    stop = S.stop_mask(lm)
    with torch.no_grad():
        got = S.decode(lm, ids, mask, n=2, processors=S.processor_list(procs), do_sample=False,
                       max_new_tokens=8, stop=stop, logprobs=True)
    logp = torch.stack(ref.scores, 1).log_softmax(-1)  # (B·n, T, V)
    lengths = set()
    for r, (tok, lp) in enumerate(zip(got.token_ids, got.token_logprobs)):
        want = _cut(ref.sequences[r, ids.shape[1]:], stop)
        assert tok == want.tolist()
        ref_lp = logp[r, torch.arange(len(tok)), want]
        torch.testing.assert_close(torch.tensor(lp), ref_lp, atol=1e-5, rtol=0)
        lengths.add(len(tok))
    assert len(lengths) > 1  # rows did leave the batch at different steps


def test_decode_samples_what_generate_samples_while_no_row_has_ended(lm):
    """The same seed draws the same tokens as ``generate`` on the shared cache as long as every
    row is still answering (here: no end-of-answer token is allowed)."""
    procs = [BanStops(S.stop_mask(lm))]
    ref = _run(lm, n=3, share=True, do_sample=True, max_new_tokens=6, processors=procs)
    ids, mask = _padded(lm, PROMPTS)
    with torch.no_grad():
        torch.manual_seed(0)
        got = S.decode(lm, ids, mask, n=3, processors=S.processor_list(procs), do_sample=True,
                       max_new_tokens=6, stop=S.stop_mask(lm))
    assert got.token_ids == ref.sequences[:, ids.shape[1]:].tolist()


def test_n_answers_per_prompt_and_seeded(lm):
    kw = dict(n=3, temperature=1.0, top_p=1.0, max_new_tokens=5, batch_size=2)
    a = S.sample_answers(lm, PROMPTS, seed=0, **kw)
    assert [len(x) for x in a] == [3, 3, 3] and all(isinstance(t, str) for x in a for t in x)
    assert S.sample_answers(lm, PROMPTS, seed=0, **kw) == a
    assert S.sample_answers(lm, PROMPTS, seed=1, **kw) != a
    assert lm.model.training is False


class Record(LogitsProcessor):
    def __init__(self):
        self.seen = []

    def __call__(self, input_ids, scores):
        self.seen.append(scores.clone())
        return scores


class Force(LogitsProcessor):
    """An α-like processor: every token but ``keep`` at -inf (from step ``after`` on, ``newline``)."""

    def __init__(self, keep, newline=None, after=None, prompt_len=0):
        self.keep, self.newline, self.after, self.prompt_len = keep, newline, after, prompt_len

    def __call__(self, input_ids, scores):
        step = input_ids.shape[1] - self.prompt_len
        tok = self.newline if self.after is not None and step >= self.after else self.keep
        out = torch.full_like(scores, float("-inf"))
        out[:, tok] = 0.0
        return out


def test_calibration_processors_see_raw_logits_before_temperature_and_top_p(lm):
    rec = Record()
    S.sample_answers(lm, PROMPTS, n=2, temperature=0.5, top_p=0.5, max_new_tokens=2, seed=0,
                     processors=[rec])
    raw = _raw_last_logits(lm, PROMPTS).repeat_interleave(2, 0)
    torch.testing.assert_close(rec.seen[0].float(), raw, atol=1e-5, rtol=0)
    plist = S.processor_list([rec], 0.5, 0.5)
    assert [type(p).__name__ for p in plist] == ["Record", "TemperatureLogitsWarper", "TopPLogitsWarper"]


def test_a_masking_processor_forces_its_token_while_sampling(lm):
    tok = lm.tokenizer(" yes", add_special_tokens=False)["input_ids"][0]
    out = S.sample_answers(lm, PROMPTS, n=2, temperature=1.3, top_p=0.9, max_new_tokens=3, seed=0,
                           processors=[Force(tok)])
    want = S.answer_text(lm.tokenizer.decode([tok] * 3))
    assert want and out == [[want] * 2] * len(PROMPTS)


def test_greedy_logprobs_equal_a_direct_forward(lm):
    scale = _Scale(2.0)  # temperature scaling as the calibration
    got = S.greedy_answers(lm, PROMPTS, max_new_tokens=5, processors=[scale], batch_size=2)
    for prompt, ans in zip(PROMPTS, got):
        prompt_ids = S.encode_prompts(lm.tokenizer, [prompt])[0]
        assert len(ans.token_logprobs) == len(ans.token_ids) and ans.token_ids
        ids = torch.tensor([prompt_ids + ans.token_ids])
        with torch.no_grad():
            logp = (lm.model(input_ids=ids).logits[0].float() / 2.0).log_softmax(-1)
        L = len(prompt_ids)
        ref = logp[L - 1:-1].gather(-1, torch.tensor(ans.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(ans.token_logprobs), ref, atol=1e-4, rtol=0)


class _Scale(LogitsProcessor):
    def __init__(self, t):
        self.t = t

    def __call__(self, input_ids, scores):
        return scores / self.t


def test_greedy_counts_the_newline_token_and_stops(lm):
    (nl,) = lm.tokenizer("\n", add_special_tokens=False)["input_ids"]
    assert S.newline_mask(lm.tokenizer, lm.vocab_size)[nl]
    tok = lm.tokenizer(" yes", add_special_tokens=False)["input_ids"][0]
    L = _padded(lm, PROMPTS)[0].shape[1]
    got = S.greedy_answers(lm, PROMPTS, max_new_tokens=8, processors=[Force(tok, nl, 2, L)])
    for ans in got:
        assert ans.token_ids == [tok, tok, nl] and ans.token_logprobs == [0.0, 0.0, 0.0]
        assert ans.text == S.answer_text(lm.tokenizer.decode([tok, tok]))


def test_answer_text():
    assert S.answer_text("  Paris.\nQuestion: next") == "Paris."
    assert S.answer_text("no newline ") == "no newline"


@pytest.mark.parametrize("batch_size", [1, 2, 8])
def test_sample_and_greedy_equals_the_two_passes_bit_for_bit(lm, batch_size):
    """One prompt forward per batch for both decodes changes no sample, greedy token or
    log-probability (the calibration processor included), and leaves the caller's RNG alone."""
    from apps.calm_llm.methods.ts import ScoreTemperature

    kw = dict(max_new_tokens=5, processors=[ScoreTemperature(1.7)], batch_size=batch_size)
    state = torch.random.get_rng_state()
    samples, greedy = S.sample_and_greedy(lm, PROMPTS, n=4, temperature=0.7, top_p=0.9, seed=11, **kw)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert samples == S.sample_answers(lm, PROMPTS, n=4, temperature=0.7, top_p=0.9, seed=11, **kw)
    assert greedy == S.greedy_answers(lm, PROMPTS, **kw)  # texts, ids and float logprobs: ==
    assert len(samples) == len(greedy) == len(PROMPTS) and all(len(s) == 4 for s in samples)
