"""Loading a causal LM with LoRA, and a functional forward over the LoRA tensors.

The bilevel solvers need objectives that are plain functions of pytrees, so the model is called
through ``torch.func.functional_call(model, inner, ...)``: ``inner`` maps LoRA parameter names to
tensors (the solver's own copies during inner steps); every other weight is the frozen base.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..errors import CalmError, ConfigError
from .distributed import Dist, shard_frozen_base
from .io import CorruptFile

if TYPE_CHECKING:  # the type only: the model imports nothing from config (config reads methods)
    from .config import ModelConfig

DEFAULT_MODEL_NAMES = ("smollm2", "default")
TINY_MODEL_NAME = "tiny"


class ModelLoadError(CalmError, ValueError):
    """The base model named by ``--model`` cannot be loaded; the message names it and the fix."""


# how a local folder is spelled; anything else is taken for a hub name ORG/NAME
_PATH_LIKE = ("/", "./", "../", "~", ".\\")


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
    if path.exists() or name.startswith(_PATH_LIKE):
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


@dataclass
class CausalLM:
    """A LoRA-wrapped causal LM seen as a function of its LoRA tensors.

    Attributes:
        model: the peft model (base frozen, adapters trainable).
        tokenizer: its tokenizer.
        device: where inputs are moved.
    """

    model: nn.Module
    tokenizer: Any
    device: torch.device
    # `base_fingerprint` of the base, taken at load time (before any sharding): what an export
    # records so that its adapter and α are never applied to another base
    base: dict[str, Any] | None = None

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])

    def inner(self) -> dict[str, torch.Tensor]:
        """The live LoRA parameters {name: Parameter} (the inner variables θ)."""
        return {n: p for n, p in self.model.named_parameters() if p.requires_grad}

    def inner_state(self) -> dict[str, torch.Tensor]:
        """Detached copies of the LoRA tensors (for resetting and checkpoints)."""
        return {n: p.detach().clone() for n, p in self.inner().items()}

    @torch.no_grad()
    def load_inner(self, state: dict[str, torch.Tensor]) -> None:
        """Copy tensors into the LoRA parameters; every name must match."""
        params = self.inner()
        missing = set(params) - set(state)
        extra = set(state) - set(params)
        if missing or extra:
            raise KeyError(f"LoRA state mismatch: missing {sorted(missing)[:3]}, extra {sorted(extra)[:3]}")
        for n, p in params.items():
            p.copy_(state[n].to(p.device, p.dtype))

    def logits(
        self,
        inner: dict[str, torch.Tensor] | None,
        batch: Any,
        *,
        last_only: bool = False,
        keep: int = 0,
    ) -> torch.Tensor:
        """Vocabulary logits (S, L, V), float32 (float64 for a float64 model); only the last
        column (S, 1, V) when ``last_only``, only the last ``keep`` columns (S, keep, V) when
        ``keep > 0``; (M, V) at the target positions for a packed batch (``keep`` unused).

        Keeping fewer columns skips the output projection (and the V-wide tensors after it)
        where there is no target; with V ≈ 50k that projection dominates memory.

        ``inner`` (LoRA name -> tensor) replaces those parameters for this call only
        (``torch.func.functional_call``), so gradients flow to whatever tensors are passed;
        ``None`` uses the module's own parameters.

        A packed shared-prefix batch (``batch.packed``) is one forward of the packed rows under
        their block mask, and the output projection runs only at the target positions: its
        logits are (M, V), one row per True entry of ``batch.logit_rows`` (default
        ``target_ids != -100``) in row-major order (`scoring` reads either shape). A
        cache-layout batch (``batch.prefix``) is two forwards: the G prefixes with a KV cache,
        then the S continuations against that cache gathered to their rows. With gradients,
        the backward goes through each prefix once in both layouts and sums what its options
        send back.
        """
        if batch.packed is not None:
            return self._packed_logits(inner, batch)
        if batch.prefix is not None:
            return self._shared_prefix_logits(inner, batch, keep=keep)
        kwargs: dict[str, Any] = {
            "input_ids": batch.input_ids,
            "attention_mask": batch.attention_mask,
            "position_ids": batch.position_ids,
            "use_cache": False,
        }
        if last_only:
            kwargs["logits_to_keep"] = 1
        elif keep:
            # the kept columns as an index, not an int: transformers slices an int as
            # hidden[:, -k:], a non-contiguous view that the output projection then runs as a
            # batched bmm, several times slower on the CPU than the mm of the contiguous copy
            # an index gives (docs/performance.md, part 6)
            L = batch.input_ids.shape[1]
            kwargs["logits_to_keep"] = torch.arange(L - int(keep), L, device=batch.input_ids.device)
        return _upcast(self._call(inner, kwargs).logits)

    @functools.cached_property
    def _cache_kwarg(self) -> str:
        """The KV cache's name in forward(...) and its output: ``cache`` from transformers 5.24
        on, ``past_key_values`` before (5.24 still accepts the old name, with a warning)."""
        base = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"

    def _checkpointing(self) -> bool:
        for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
            if hasattr(type(self.model), name) or hasattr(self.model, name):
                return bool(getattr(self.model, name))
        return False

    @property
    def prefix_layout(self) -> str:
        """The shared-prefix layout this model runs correctly and fastest: "packed" where the
        attention kernel takes a custom 4D mask (SDPA, eager), the model is not FSDP-sharded
        (the packed forward calls the decoder and the head itself, past the root module's
        unsharding hooks), every layer is full attention (a sliding window, chunked attention
        or a recurrent/convolutional layer ignores the block mask) and a packed forward gives
        the plain forward's logits on a probe question (`_packed_agrees`: catches heads with
        their own scaling); "cache" otherwise."""
        base = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        c = base.config
        attn = getattr(c, "_attn_implementation", None) or "eager"
        sharded = hasattr(self.model, "unshard")  # an FSDP2 module
        windowed = bool(getattr(c, "sliding_window", None) and getattr(c, "use_sliding_window", True)
                        or getattr(c, "attention_chunk_size", None))
        mixed = any(t != "full_attention" for t in (getattr(c, "layer_types", None) or []))
        if attn not in ("sdpa", "eager") or sharded or windowed or mixed:
            return "cache"
        return "packed" if self._packed_agrees else "cache"

    @functools.cached_property
    def _packed_agrees(self) -> bool:
        """Whether a packed forward of a probe question (a 6-token context, options of 3 and 2
        tokens) gives the plain forward's logits at every answer token, to 1e-3 of their scale
        (bf16: 5e-2): once per model, two forwards of a few tokens."""
        from .data.schema import Packed

        ids = torch.arange(11, 22, device=self.device) % self.vocab_size
        ctx, opts = ids[:6], [ids[6:9], ids[9:11]]
        packed = torch.cat([ctx[:-1], ctx[-1:], opts[0][:-1], ctx[-1:], opts[1][:-1]])[None]
        pos = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 5, 6]], device=self.device)
        seg = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1, 2, 2]], device=self.device)
        where = torch.arange(5, 10, device=self.device)
        pk = Packed(input_ids=packed, position_ids=pos, segment_ids=seg, target_index=where[None])
        dtype = self.model.get_input_embeddings().weight.dtype
        with torch.no_grad(), self.mode(False):
            got = _upcast(self._packed_forward(pk.input_ids, pk.attention_mask(dtype),
                                               pk.position_ids, where))
            want = [_upcast(self.model(input_ids=torch.cat([ctx, o[:-1]])[None], use_cache=False)
                            .logits[0, 5:]) for o in opts]
        want = torch.cat(want)
        tol = (5e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-3) * (1 + float(want.abs().max()))
        return bool(torch.isfinite(got).all()) and float((got - want).abs().max()) <= tol

    @functools.cached_property
    def _packed_forward(self) -> nn.Module:
        return _PackedForward(self.model)

    def _call(
        self, inner: dict[str, torch.Tensor] | None, kwargs: dict[str, Any],
        module: nn.Module | None = None, prefix: str = "",
    ) -> Any:
        """``module`` (default the model) called with ``kwargs`` at the LoRA tensors ``inner``;
        ``prefix`` is the model's name inside ``module``."""
        module = self.model if module is None else module
        if inner is None:
            return module(**kwargs)
        params = {prefix + n: t for n, t in inner.items()} if prefix else inner
        call = functools.partial(torch.func.functional_call, module, params, args=(),
                                 kwargs=kwargs, strict=False)
        if not (self._checkpointing() and self.model.training and torch.is_grad_enabled()):
            return call()
        live = self.inner()
        if all(inner.get(n) is p for n, p in live.items()):
            return call()
        # A checkpointed layer recomputes its forward during the backward, after functional_call
        # has put the live parameters back: the recompute would run at the live θ, not at
        # `inner` (BOME's inner iterates, ITD's unroll, a detached θ), and give wrong gradients
        # or a CheckpointError. Those forwards keep their activations instead.
        with _checkpointing_off(self.model):
            return call()

    def _packed_logits(self, inner: dict[str, torch.Tensor] | None, batch: Any) -> torch.Tensor:
        if self.prefix_layout != "packed":
            raise ValueError(
                "a packed shared-prefix batch needs SDPA or eager attention, full attention in "
                "every layer and an unsharded model (no FSDP); collate with "
                "prefix_layout=CausalLM.prefix_layout ('cache' here)"
            )
        pk = batch.packed
        where = pk.target_index[batch.logit_positions]  # (M,)
        if bool((where < 0).any()):
            raise ValueError("packed batch: a target position has no packed position")
        # the hidden states' dtype (the embedding stays unquantized under 4/8-bit loading)
        dtype = self.model.get_input_embeddings().weight.dtype
        return _upcast(self._call(inner, {
            "input_ids": pk.input_ids,
            "attention_mask": pk.attention_mask(dtype),
            "position_ids": pk.position_ids,
            "where": where,
        }, self._packed_forward, "model."))  # (M, V)

    def _shared_prefix_logits(
        self, inner: dict[str, torch.Tensor] | None, batch: Any, *, keep: int = 0
    ) -> torch.Tensor:
        pre = batch.prefix
        if self._checkpointing() and self.model.training and torch.is_grad_enabled():
            # transformers drops the KV cache inside checkpointed layers: the continuations
            # would silently lose their context
            raise ValueError(
                "a cache-layout shared-prefix batch cannot be trained with gradient "
                "checkpointing (collate with prefix_layout='packed' or share_prefix=False)"
            )
        out = self._call(inner, {
            "input_ids": pre.input_ids,
            "attention_mask": pre.attention_mask,
            "position_ids": pre.position_ids,
            "use_cache": True,
            "logits_to_keep": 1,  # the prefix needs no logits of its own; keep the head's cost at one column
        })
        cache = getattr(out, self._cache_kwarg)
        cache.batch_select_indices(pre.row_group)  # (G, ..., P, d) -> (S, ..., P, d), differentiable
        kwargs: dict[str, Any] = {
            "input_ids": batch.input_ids,
            "attention_mask": torch.cat([pre.attention_mask[pre.row_group], batch.attention_mask], 1),
            "position_ids": batch.position_ids,
            self._cache_kwarg: cache,
            "use_cache": True,
        }
        if keep:
            kwargs["logits_to_keep"] = int(keep)
        return _upcast(self._call(inner, kwargs).logits)

    @contextlib.contextmanager
    def mode(self, train: bool):
        """Temporarily set train/eval mode (LoRA dropout)."""
        was = self.model.training
        self.model.train(train)
        try:
            yield
        finally:
            self.model.train(was)


class _PackedForward(nn.Module):
    """The decoder over packed rows, then the output projection at the target positions only:
    ``head(decoder(ids)[where])`` (M, V). A module, so that ``functional_call`` swaps the LoRA
    tensors of both (its parameters are the model's, named ``model.*``)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                position_ids: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
        base = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        h = base.get_decoder()(input_ids=input_ids, attention_mask=attention_mask,
                               position_ids=position_ids, use_cache=False).last_hidden_state
        z = base.get_output_embeddings()(h.reshape(-1, h.shape[-1]).index_select(0, where))
        cap = getattr(base.config, "final_logit_softcapping", None)
        return torch.tanh(z / cap) * cap if cap else z


@contextlib.contextmanager
def _checkpointing_off(model: nn.Module):
    """Turn transformers' per-layer gradient checkpointing off for the duration."""
    layers = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True]
    for m in layers:
        m.gradient_checkpointing = False
    try:
        yield
    finally:
        for m in layers:
            m.gradient_checkpointing = True


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


def _upcast(logits: torch.Tensor) -> torch.Tensor:
    """Half-precision logits -> float32 (log-softmax over 50k entries needs it); wider stays."""
    return logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits


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
