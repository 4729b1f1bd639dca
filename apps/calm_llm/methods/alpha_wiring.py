"""α: the calibration parameters of CALM, wired to the model's logits.

Where α acts (``--alpha-acts``):

- ``lower_and_inference`` / ``upper_and_inference``: on the vocabulary logits z (S, L', V).
  Its support (``--alpha-support``) picks the columns it may change:
  ``answer_tokens`` — the K tokens that occur at answer positions of the training and
  calibration data (every other column stays at identity: the data carry no signal about
  them, and with Adam their entries would move by noise-sized steps);
  ``vocab`` — K = V, every vocabulary logit has its own (l, τ);
  ``options`` (letter mode) — the option-letter columns.
- ``options``: on the (N, K) option scores, K = the option slots (a bilevel-trained option
  temperature / slot shift; the vocabulary logits are left alone).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Alpha:
    """A parameterization plus the columns it acts on.

    ``params`` are leaf tensors (requires_grad) — the outer variables of the bilevel problem.
    ``on`` is ``"vocab"`` (vocabulary logits; ``class_ids`` the support or None for all V) or
    ``"options"`` (option scores (N, K)).
    """

    param: Any
    params: dict[str, torch.Tensor]
    class_ids: torch.Tensor | None
    on: str = "vocab"

    def apply(self, params: dict[str, torch.Tensor], logits: torch.Tensor) -> torch.Tensor:
        """α-adjusted logits, same shape as ``logits``."""
        return self.param.apply(params, logits, class_ids=self.class_ids)

    def stats(self) -> dict[str, float]:
        """min/median/max of τ and l over the entries α may change, and how many moved
        (|raw − identity| > 1e-3), for the training record."""
        out: dict[str, float] = {}
        with torch.no_grad():
            for key, value in self.param.constrained(self.params).items():
                v = value.detach().float().reshape(-1)
                name = "tau" if key == "tau" else "l"
                out[f"alpha_{name}_min"] = float(v.min())
                out[f"alpha_{name}_median"] = float(v.median())
                out[f"alpha_{name}_max"] = float(v.max())
            n_moved = 0
            if self.params:
                device = next(iter(self.params.values())).device
                identity = self.param.init(self.size, device=device)
                for key, value in self.params.items():
                    n_moved += int(((value.detach() - identity[key]).abs() > 1e-3).sum())
            out["alpha_moved"] = float(n_moved)  # of the support's entries
        return out

    @property
    def size(self) -> int:
        """K, the number of entries each per-class parameter has."""
        for value in self.params.values():
            if value.ndim:
                return int(value.numel())
        return 1


def parameterization(name: str, **run_options: Any) -> Any:
    """The α parameterization registered as ``name`` (`calibration.alpha_table`), given those
    of the run's α options (``form``, ``positivity``, ``tau_max``, ...) that it declares; the
    others do not concern it (a shift has no τ). The table maps the CLI's spellings
    (``"z/tau+l"``) onto the parameterization's own."""
    from calibration import alpha as calibration_alpha
    from calibration import alpha_table

    spec = alpha_table.SPECS.get(name, None)
    declared = spec.options if spec is not None else {}
    return calibration_alpha.get(name, **{k: v for k, v in run_options.items() if k in declared})


def make_alpha(
    name: str,
    form: str,
    support: str,
    *,
    vocab_size: int,
    option_token_ids: torch.Tensor | None,
    device: torch.device,
    positivity: str = "log",
    tau_max: float = 20.0,
    acts: str = "lower_and_inference",
    answer_token_ids: Sequence[int] | torch.Tensor | None = None,
    n_option_slots: int | None = None,
    extra_options: dict[str, Any] | None = None,
) -> Alpha:
    """Initialize α at the identity transform (l = 0, τ = 1). ``extra_options``: the
    parameterization's own options beyond form / positivity / tau_max (a plugin's, from its
    ``--<name>-<option>`` flags)."""
    param = parameterization(name, form=form, positivity=positivity, tau_max=tau_max,
                             **(extra_options or {}))
    on = "vocab"
    if acts == "options":
        if n_option_slots is None:
            raise ValueError("alpha_acts='options' needs the number of option slots")
        class_ids, k, on = None, int(n_option_slots), "options"
    elif support == "options":
        if option_token_ids is None:
            raise ValueError("alpha_support='options' needs the option-letter ids (letter mode)")
        class_ids = option_token_ids.to(device)
        k = int(class_ids.numel())
    elif support == "answer_tokens":
        if answer_token_ids is None or len(answer_token_ids) == 0:
            raise ValueError("alpha_support='answer_tokens' needs the answer token ids of the data")
        class_ids = torch.as_tensor(answer_token_ids, dtype=torch.long).unique().to(device)
        k = int(class_ids.numel())
    elif support == "vocab":
        class_ids, k = None, vocab_size
    else:
        raise ValueError(f"unknown alpha support {support!r} (answer_tokens, vocab, options)")
    params = param.init(k, dtype=torch.float32, device=device)
    params = {n: t.detach().clone().requires_grad_(True) for n, t in params.items()}
    return Alpha(param=param, params=params, class_ids=class_ids, on=on)


def answer_token_ids(
    examples: Sequence[Any], collator: Any, *, options: str, batch_size: int = 64
) -> torch.Tensor:
    """(K,) sorted unique token ids at the answer positions of ``examples`` as ``collator``
    lays them out (``options="gold"``: the gold continuation / response; ``"all"``: every
    option's continuation)."""
    from ..data import batch_iterator

    found: set[int] = set()
    for batch in batch_iterator(list(examples), collator, batch_size, shuffle=False, seed=0,
                                options=options):
        t = batch.target_ids
        found.update(int(x) for x in t[t != -100].unique())
    return torch.tensor(sorted(found), dtype=torch.long)
