"""A real architecture from its config alone: random weights, a tokenizer built in code.

``--model random:llama-3.1-8b`` is Llama-3.1-8B's shape (Grattafiori et al., 2024, "The Llama 3
Herd of Models", Table 3: 32 layers, width 4096, FFN 14336, 32 query / 8 key-value heads,
RoPE θ = 500,000; the released config.json adds the vocabulary of 128,256 ids, 256 of them
reserved special tokens, and the "llama3" RoPE frequency scaling) with random weights:
what a GPU machine without network or model files can train to measure step time and memory
of the 7-8B setting. Overrides after ``@`` shrink it: ``random:llama-3.1-8b@layers=2`` (the
same width, fewer layers), ``@layers=1,hidden=64`` (a CPU test), keys `OVERRIDES`.

Building: the model is created on the meta device (no memory, no init), allocated directly on
the target device in the target dtype (``to_empty``), then filled there: every weight matrix
and embedding ~ N(0, 0.02²) (the config's ``initializer_range``), every RMSNorm weight 1, and
the rotary frequencies recomputed on the device (they are buffers that ``to_empty`` leaves
uninitialized). On a GPU that is seconds for 8B parameters; the usual CPU construction would
spend minutes initializing 8B fp32 weights and then copy 16 GB to the device. The draws come
from a generator seeded with ``seed`` on that device: the same seed gives the same weights
on the same device type.

The tokenizer is a byte-level BPE (Sennrich et al., 2016; GPT-2's byte alphabet) whose merges
are learned in code from `data.synthetic.corpus` (about a second), padded to the model's
vocabulary with never-merged filler tokens so that every id the model can emit decodes to
text, and closed by Llama 3's special tokens (``<|begin_of_text|>`` 128000, prepended to every
text; ``<|end_of_text|>`` 128001 = EOS; ``<|finetune_right_pad_id|>`` 128004 = padding). Any
text encodes (bytes are the base alphabet); the option letters after ``" ### Answer:"`` are
one token each, as the letter mode needs.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import torch
from torch import nn

RANDOM_PREFIX = "random:"
# Llama-3.1-8B's config.json (meta-llama/Llama-3.1-8B), the fields that set shapes and numerics
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": {
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "initializer_range": 0.02,
        "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": 128001,
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8192},
    },
}
OVERRIDES = ("layers", "hidden", "intermediate", "heads", "kv_heads", "vocab")
N_SPECIAL = 256  # Llama 3's reserved block at the top of the vocabulary
BOS, EOS, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|finetune_right_pad_id|>"
N_MERGED = 2048  # byte-level BPE tokens learned from the synthetic corpus


def is_random_name(name: str) -> bool:
    """Whether ``--model name`` asks for a random model of a known architecture."""
    return name.startswith(RANDOM_PREFIX)


def parse_random_name(name: str) -> tuple[str, dict[str, int]]:
    """``"random:ARCH[@key=int,...]"`` -> (ARCH, overrides); a ValueError names what is wrong."""
    if not is_random_name(name):
        raise ValueError(f"--model {name!r}: a random model is named {RANDOM_PREFIX}ARCH[@key=N,...]")
    arch, _, spec = name[len(RANDOM_PREFIX):].partition("@")
    if arch not in ARCHITECTURES:
        raise ValueError(f"--model {name}: unknown architecture {arch!r}; known: {sorted(ARCHITECTURES)}")
    out: dict[str, int] = {}
    for item in filter(None, spec.split(",")):
        key, eq, value = item.partition("=")
        if key not in OVERRIDES or not eq or not value.isdigit() or int(value) < 1:
            raise ValueError(f"--model {name}: {item!r} is not KEY=N with N >= 1 and KEY one of "
                             f"{OVERRIDES} (e.g. {RANDOM_PREFIX}{arch}@layers=2)")
        out[key] = int(value)
    return arch, out


def random_config(name: str) -> Any:
    """The transformers config of ``random:ARCH[@overrides]``.

    ``hidden`` alone rescales the rest as the 8B model is proportioned: FFN 3.5 × width (to a
    multiple of 8), heads of width 128 (16 below width 512), 4 query heads per key-value head.
    """
    from transformers import LlamaConfig

    arch, o = parse_random_name(name)
    c = dict(ARCHITECTURES[arch])
    if "hidden" in o:
        h = o["hidden"]
        head = 128 if h >= 512 else 16
        if h % head:
            raise ValueError(f"--model {name}: hidden={h} must be a multiple of {head}")
        c.update(hidden_size=h, intermediate_size=8 * round(3.5 * h / 8),
                 num_attention_heads=h // head, num_key_value_heads=max(1, h // head // 4))
    for key, field in (("layers", "num_hidden_layers"), ("intermediate", "intermediate_size"),
                       ("heads", "num_attention_heads"), ("kv_heads", "num_key_value_heads"),
                       ("vocab", "vocab_size")):
        if key in o:
            c[field] = o[key]
    if c["hidden_size"] % c["num_attention_heads"] or c["num_attention_heads"] % c["num_key_value_heads"]:
        raise ValueError(f"--model {name}: width {c['hidden_size']}, {c['num_attention_heads']} heads and "
                         f"{c['num_key_value_heads']} key-value heads do not divide evenly")
    if c["vocab_size"] < N_MERGED + 256 + N_SPECIAL:
        raise ValueError(f"--model {name}: vocab={c['vocab_size']} is below the built-in tokenizer's "
                         f"{N_MERGED + 256 + N_SPECIAL} tokens")
    # the specials sit at the top of the vocabulary, as in Llama 3
    c.update(bos_token_id=c["vocab_size"] - N_SPECIAL, eos_token_id=c["vocab_size"] - N_SPECIAL + 1,
             pad_token_id=c["vocab_size"] - N_SPECIAL + 4)
    return LlamaConfig(**c)


@torch.no_grad()
def build_random_model(name: str, *, device: torch.device | str = "cpu",
                       dtype: torch.dtype = torch.float32, seed: int = 0) -> nn.Module:
    """``random:ARCH`` as a ``LlamaForCausalLM`` on ``device`` in ``dtype``, weights random.

    Meta device -> ``to_empty(device)`` -> fill in place (see the module docstring). Cost: one
    pass of random draws over the weights on the device; no host memory for them.
    """
    from transformers import LlamaForCausalLM

    config = random_config(name)
    device = torch.device(device)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    # cast on meta (free), then allocate once: no float32 copy of the weights ever exists
    model = model.to(dtype).to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    std = config.initializer_range
    for p in model.parameters():
        if p.ndim == 1:  # RMSNorm gains
            p.fill_(1.0)
        else:  # weight matrices and embeddings
            p.normal_(0.0, std, generator=gen)
    for module in model.modules():  # the rotary frequencies: buffers, not weights
        if type(module).__name__.endswith("RotaryEmbedding"):
            with torch.device(device):
                fresh = type(module)(module.config)
            for bname, buf in fresh.named_buffers(recurse=False):
                setattr(module, bname, buf)  # float32, as a pretrained model keeps them
    model.eval()
    return model


@functools.lru_cache(maxsize=4)
def _tokenizer_json(vocab_size: int, seed: int = 0) -> str:
    """The serialized byte-level BPE tokenizer of `synthetic_tokenizer` (learned once per process)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    from .data.prompts import LETTERS
    from .data.synthetic import corpus

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=N_MERGED + 256, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    # the answer letters after a space, often enough to be merged first: one token each
    letters = [" " + " ".join(LETTERS)] * 200 + ["### Question: Options: Answer with only a single letter:\n ### Answer:"] * 50
    tok.train_from_iterator(corpus(seed) + letters, trainer=trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    n_regular = vocab_size - N_SPECIAL
    # fillers: reachable by no merge, so never produced by encoding, but every id decodes
    for k in range(len(vocab), n_regular):
        vocab[f"Ġfill{k}"] = k
    specials = [BOS, EOS, "<|reserved_special_token_0|>", "<|reserved_special_token_1|>", PAD]
    specials += [f"<|reserved_special_token_{k}|>" for k in range(2, N_SPECIAL - 3)]
    spec["added_tokens"] = [
        {"id": n_regular + i, "content": s, "single_word": False, "lstrip": False,
         "rstrip": False, "normalized": False, "special": True} for i, s in enumerate(specials)]
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, n_regular)])
    return tok.to_str()


def synthetic_tokenizer(vocab_size: int = 128256, seed: int = 0) -> Any:
    """The built-in tokenizer (see the module docstring) as a transformers fast tokenizer with
    ``vocab_size`` ids (``len(tok) == vocab_size``): BOS prepended, EOS and PAD set."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer.from_str(_tokenizer_json(vocab_size, seed))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD)


def random_model_and_tokenizer(name: str, *, device: torch.device | str = "cpu",
                               dtype: torch.dtype = torch.float32, seed: int = 0) -> tuple[nn.Module, Any]:
    """`build_random_model` and the `synthetic_tokenizer` of its vocabulary."""
    model = build_random_model(name, device=device, dtype=dtype, seed=seed)
    return model, synthetic_tokenizer(int(model.config.vocab_size))
