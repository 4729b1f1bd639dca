"""The causal LM seen as a function of its LoRA tensors: `CausalLM`, its logits over a batch
(plain, packed shared-prefix, or cache-layout shared-prefix), the LoRA state it exposes to the
solvers, and the packed forward's probe of whether it is exact on this model.

The bilevel solvers need objectives that are plain functions of pytrees, so the model is called
through ``torch.func.functional_call(model, inner, ...)``: ``inner`` maps LoRA parameter names to
tensors (the solver's own copies during inner steps); every other weight is the frozen base.
`model.load` builds one.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


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


def _upcast(logits: torch.Tensor) -> torch.Tensor:
    """Half-precision logits -> float32 (log-softmax over 50k entries needs it); wider stays."""
    return logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
