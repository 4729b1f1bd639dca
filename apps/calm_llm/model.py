"""Loading a causal LM with LoRA: ``--model`` checked before anything is read, the base and
its tokenizer (dtype, quantization, attention kernel), the LoRA adapters, the base's
fingerprint, and `load`, which assembles them into a `CausalLM` on a device (sharded under FSDP).

`CausalLM` itself, the functional forward over the LoRA tensors, lives in `causal_lm`
(re-exported here).
"""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..errors import CalmError, ConfigError
from .causal_lm import CausalLM
from .distributed import Dist, shard_frozen_base
from .io import CorruptFile

if TYPE_CHECKING:  # the type only: the model imports nothing from config (config reads methods)
    from .config import ModelConfig

DEFAULT_MODEL_NAMES = ("smollm2", "default")
TINY_MODEL_NAME = "tiny"


class ModelLoadError(CalmError, ValueError):
    """The base model named by ``--model`` cannot be loaded; the message names it and the fix."""


# how a local folder is spelled; anything else is taken for a hub name ORG/NAME (export.py
# reads it too, to tell a base recorded by path from one recorded by hub name)
PATH_LIKE = ("/", "./", "../", "~", ".\\")

__all__ = ["DEFAULT_MODEL_NAMES", "FINGERPRINT", "PATH_LIKE", "TINY_MODEL_NAME", "CausalLM",
           "ModelLoadError", "add_lora", "base_fingerprint", "check_model_available", "load",
           "load_base", "resolve_device"]


def check_model_available(mc: ModelConfig) -> None:
    """Refuse, before any data or weights are read, a ``--model`` this machine cannot load: a
    folder that does not exist or holds no model, a name that is no hub name, or (offline) a hub
    model that is not in the Hugging Face cache. Loading would fail later with transformers'
    "Repo id must be in the form ..." traceback or after a minute of network retries."""
    name = mc.name_or_path
    if name == TINY_MODEL_NAME or name in DEFAULT_MODEL_NAMES:
        return
    if name.startswith("random:"):  # built from its config alone (synthetic.py): check the spec
        from .synthetic import random_config

        try:
            random_config(name)
        except ValueError as e:
            raise ModelLoadError(str(e)) from e
        return
    path = Path(name).expanduser()
    if path.is_dir():
        if not any((path / f).is_file() for f in ("config.json", "adapter_config.json")):
            raise ModelLoadError(
                f"--model {name}: the folder holds no config.json, so it is not a Hugging Face "
                "model folder; give the folder that holds config.json and the weights"
            )
        return
    if path.exists() or name.startswith(PATH_LIKE):
        raise ModelLoadError(
            f"--model {name}: no such folder; give a model folder, a hub name ORG/NAME, "
            "'smollm2' (offline SmolLM2-135M-Instruct) or 'tiny'"
        )
    from huggingface_hub import constants, is_offline_mode, try_to_load_from_cache

    try:
        cached = try_to_load_from_cache(name, "config.json")
    except ValueError as e:  # huggingface_hub's HFValidationError: not of the form ORG/NAME
        raise ModelLoadError(
            f"--model {name!r}: neither a local folder nor a hub name of the form ORG/NAME "
            f"({e}); give a model folder, a hub name, 'smollm2' or 'tiny'"
        ) from e
    if not isinstance(cached, str) and is_offline_mode():
        raise ModelLoadError(
            f"--model {name}: not a local folder and not in the Hugging Face cache "
            f"({constants.HF_HUB_CACHE}), and the hub is off (HF_HUB_OFFLINE): download it where "
            f"there is a network (huggingface-cli download {name}) and copy that cache here, or "
            "pass the model's folder, or use --model smollm2 (offline)"
        )


def resolve_device(name: str) -> torch.device:
    """'auto' -> cuda when available, else cpu."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _torch_dtype(name: str) -> torch.dtype:
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[name]


def _quantization_config(mc: ModelConfig) -> Any:
    if mc.quantization == "none":
        return None
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ConfigError(
            f"--quantization {mc.quantization} needs the bitsandbytes package "
            "(pip install bitsandbytes; it runs on CUDA GPUs)"
        )
    if not torch.cuda.is_available():  # bitsandbytes' 4/8-bit kernels are CUDA kernels
        raise RuntimeError(
            f"--quantization {mc.quantization} needs a CUDA GPU (bitsandbytes quantizes on "
            "CUDA only) and torch sees none here; use --quantization none on this machine"
        )
    from transformers import BitsAndBytesConfig

    if mc.quantization == "4bit":
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=_torch_dtype(mc.dtype),
        )
    return BitsAndBytesConfig(load_in_8bit=True)


def load_base(mc: ModelConfig, *, eager: bool = False, seed: int = 0,
              device: torch.device | None = None) -> tuple[nn.Module, Any]:
    """The base causal LM and its tokenizer, all weights frozen.

    ``eager`` forces ``attn_implementation="eager"`` (needed by second-order solvers: the fused
    SDPA kernels have no double backward). ``device``: where a ``random:ARCH`` model is
    materialized (default CPU); other models load on the CPU and are moved by `load`.
    """
    attn = "eager" if eager else (None if mc.attn_implementation == "auto" else mc.attn_implementation)
    if mc.name_or_path.startswith("random:"):
        if mc.quantization != "none":
            raise ModelLoadError(f"--model {mc.name_or_path} with --quantization {mc.quantization}: "
                                 "a random model is built unquantized; use --quantization none")
        from .synthetic import random_model_and_tokenizer

        model, tok = random_model_and_tokenizer(mc.name_or_path, device=device or "cpu",
                                                dtype=_torch_dtype(mc.dtype), seed=seed)
        if attn:
            model.set_attn_implementation(attn)
    elif mc.name_or_path == TINY_MODEL_NAME:
        from .assets import tiny_model_and_tokenizer

        model, tok = tiny_model_and_tokenizer(seed, hidden=mc.tiny_hidden, layers=mc.tiny_layers)
        model = model.to(_torch_dtype(mc.dtype))
        if attn:
            model.set_attn_implementation(attn)
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if mc.name_or_path in DEFAULT_MODEL_NAMES:
            from .assets import default_model_dir

            path: str | Path = default_model_dir()
        else:
            path = mc.name_or_path
        kwargs: dict[str, Any] = {"dtype": _torch_dtype(mc.dtype)}
        if attn:
            kwargs["attn_implementation"] = attn
        quant = _quantization_config(mc)
        if quant is not None:
            kwargs["quantization_config"] = quant
        check_model_available(mc)
        try:
            model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
            tok = AutoTokenizer.from_pretrained(path)
        except Exception as e:
            if mc.name_or_path in DEFAULT_MODEL_NAMES:  # our own converted copy, damaged
                raise CorruptFile(
                    f"{path}: the converted model cache is damaged ({type(e).__name__}: "
                    f"{str(e).strip()[:200]}). Delete that folder and rerun (it is converted "
                    "again from the GGUF, about 20 s; a run that stopped here continues with "
                    "--resume DIR)") from e
            if not isinstance(e, OSError):  # a bug, or a damaged user folder: its traceback
                raise
            # no network, no such repo, a cut download: one line, with the fix
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ModelLoadError(
                f"--model {mc.name_or_path}: cannot load it ({reason}); give a local model "
                "folder, or a hub name this machine has cached or can download (set "
                "HF_HUB_OFFLINE=1 to fail at once where there is no network), or --model smollm2"
            ) from e
    if tok.pad_token is None:  # many chat models ship without one; padding is masked anyway
        tok.pad_token = tok.eos_token
    for p in model.parameters():
        p.requires_grad_(False)
    return model, tok


def add_lora(model: nn.Module, mc: ModelConfig, *, seed: int = 0) -> nn.Module:
    """Wrap with peft LoRA adapters; only the adapters require grad. LoRA A is drawn with `seed`."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    targets: str | list[str] = list(mc.lora_target_modules)
    if targets == ["all-linear"]:
        targets = "all-linear"
    if mc.quantization != "none":
        model = prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=mc.gradient_checkpointing
        )
    lcfg = LoraConfig(
        r=mc.lora_r,
        lora_alpha=mc.lora_alpha,
        lora_dropout=mc.lora_dropout,
        target_modules=targets,
        task_type="CAUSAL_LM",
        bias="none",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            peft_model = get_peft_model(model, lcfg)
        except ValueError as e:  # peft's message lists the modules it did find
            raise ConfigError(f"--lora-target-modules {mc.lora_target_modules}: {e}") from e
    if mc.gradient_checkpointing:
        # non-reentrant: works with frozen inputs; forwards at parameters other than the live ones
        # are run unchecked (CausalLM._call)
        peft_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return peft_model


FINGERPRINT = "sha256 of the input-embedding rows embedding_rows, rounded to bfloat16"


def base_fingerprint(model: nn.Module, name: str = "") -> dict[str, Any]:
    """A cheap identity of a base model's weights, to tell whether an adapter or α belongs to it.

    ``vocab_size`` is the width of the logits (the output embedding's rows, what α acts on);
    ``embedding_sha256`` hashes five fixed rows of the input embedding, rounded to bfloat16 so
    that the same base loaded in fp32 or bf16 has one fingerprint (4/8-bit loading leaves the
    embedding unquantized). Five rows of a trained embedding tell two bases apart; they cost
    a few kilobytes to read, not a pass over the weights.
    """
    emb = model.get_input_embeddings().weight
    if hasattr(emb, "full_tensor"):  # a DTensor: only this rank's shard is here
        raise ValueError("base_fingerprint: the embedding is sharded (FSDP); take the fingerprint "
                         "before sharding, as model.load does (CausalLM.base)")
    head = model.get_output_embeddings()
    v_in = int(emb.shape[0])
    rows = sorted({0, v_in // 4, v_in // 2, (3 * v_in) // 4, v_in - 1})
    sample = emb.detach()[rows].to("cpu", torch.bfloat16).contiguous().view(torch.int16)
    return {
        "name_or_path": name,
        "vocab_size": int(head.weight.shape[0]) if head is not None else v_in,
        "embedding_shape": [int(d) for d in emb.shape],
        "embedding_rows": rows,
        "embedding_sha256": hashlib.sha256(sample.numpy().tobytes()).hexdigest(),
        "fingerprint": FINGERPRINT,
    }


def load(
    mc: ModelConfig,
    *,
    device: torch.device,
    eager: bool = False,
    seed: int = 0,
    dist: Dist | None = None,
) -> CausalLM:
    """Base model + tokenizer + LoRA adapters on `device`, in eval mode.

    With ``dist.fsdp`` over several processes the model is built on the CPU and its frozen
    base weights are sharded over the ranks (`distributed.shard_frozen_base`), so no GPU ever
    holds the whole base; the LoRA tensors stay whole on every rank.
    """
    fsdp = dist is not None and dist.fsdp and dist.world > 1
    if fsdp and mc.quantization != "none":
        raise ConfigError(
            f"--quantization {mc.quantization} with FSDP: quantized base weights cannot be "
            "sharded here; use FSDP in bf16, or the DDP config with --quantization 4bit"
        )
    # a random model is materialized where it runs (unsharded, unquantized)
    base, tok = load_base(mc, eager=eager, seed=seed,
                          device=None if fsdp or mc.quantization != "none" else device)
    fingerprint = base_fingerprint(base, mc.name_or_path)  # before sharding splits the embedding
    if mc.quantization == "none" and not fsdp:
        base = base.to(device)
    model = add_lora(base, mc, seed=seed)
    model.eval()
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if n_train == 0:
        raise ConfigError(f"--lora-target-modules {mc.lora_target_modules}: no LoRA parameters created")
    if fsdp and dist is not None:  # (fsdp implies dist; spelled out for the type checker)
        shard_frozen_base(model, dist, device)
    return CausalLM(model=model, tokenizer=tok, device=device, base=fingerprint)
