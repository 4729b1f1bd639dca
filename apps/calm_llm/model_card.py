"""The model card (``README.md``) of an export: what the folder is, how it did, how to load it.

Hugging Face reads the YAML front matter (``base_model``, ``library_name: peft``, ``tags``,
``datasets``); the body holds the method and its options, the data and split sizes, the in- and
out-of-domain table (accuracy, confidence ECE with its bootstrap interval, NLL; Guo et al.
2017's ECE), the reliability diagrams (copied next to the card), α's summary (τ and l ranges,
support), the command that produced the run and the three lines that load the export with its
calibration. Everything is read from the export itself (``calibration.json``, ``config.json``,
``base.json``, ``alpha.*``) and from the run's folder (``metrics.json``, ``splits.json``,
``reliability_<dataset>.png``) when it is given; nothing is recomputed.
"""

from __future__ import annotations

import json
import shlex
import shutil
import sys
from pathlib import Path
from typing import Any

from .io import atomic_write_text
from .tables import fmt


def write_card(export_dir: str | Path, *, run_dir: str | Path | None = None,
               command: str | None = None) -> Path:
    """Write ``export_dir/README.md`` (and copy the run's reliability diagrams beside it).

    ``command``: the command line to record; default this process's own (``python -m
    apps.calm_llm ...`` when it is the app's CLI)."""
    out = Path(export_dir)
    cal = json.loads((out / "calibration.json").read_text())
    cfg = json.loads((out / "config.json").read_text())
    base = json.loads((out / "base.json").read_text())
    run = Path(run_dir) if run_dir is not None else None
    metrics = _read(run / "metrics.json") if run else None
    splits = _read(run / "splits.json") if run else None
    images = _copy_diagrams(run, out, cfg) if run else []
    parts = [
        _front_matter(cal, cfg, base),
        f"# {cal['row']}: {base['name_or_path'] or 'a base model'} calibrated by `{cal['method']}`\n",
        _method_section(cal, cfg, base),
        _data_section(cfg, splits),
        _results_section(cal["row"], metrics, images),
        _alpha_section(out),
        "## Command\n\n```bash\n" + (command or _this_command()) + "\n```\n\n"
        "Paths are cut to their last component, here and in `config.json` beside this card, "
        "which holds every option of the run: `python -m apps.calm_llm --config config.json` "
        "reruns it (with the data and model found here).\n",
        _load_section(cal),
    ]
    return atomic_write_text(out / "README.md", "\n".join(p for p in parts if p))


def portable(value: Any) -> Any:
    """A copy of a config value with every absolute or home-relative path cut to its last
    component (``NAME=/data/x.jsonl`` -> ``NAME=x.jsonl``), so no path of the training
    machine travels with the export."""
    if isinstance(value, dict):
        return {k: portable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [portable(v) for v in value]
    if isinstance(value, str):
        key, sep, rest = value.partition("=")
        if sep and rest.startswith(("/", "~")) and "/" not in key:
            return f"{key}={Path(rest).name}"
        if value.startswith(("/", "~")):
            return Path(value).name
    return value


def _read(path: Path) -> Any:
    return json.loads(path.read_text()) if path.is_file() else None


def _this_command() -> str:
    """This process's command line; the app's CLI is spelled as ``python -m apps.calm_llm``."""
    argv = list(sys.argv)
    if argv and Path(argv[0]).parent.name == "calm_llm" and Path(argv[0]).name == "__main__.py":
        return "python -m apps.calm_llm " + shlex.join(portable(argv[1:]))
    return shlex.join(["python", *portable(argv)]) if argv else "(unknown)"


def _datasets(cfg: dict[str, Any]) -> list[str]:
    """Hub names of the run's datasets where the source table knows one (``sciq`` ->
    ``allenai/sciq``), else the project's source names."""
    from .data.sources import SOURCES

    d = cfg["data"]
    names = [*d["in_domain"], *d["out_of_domain"]] + ([d["instruction_data"]] if d["instruction_data"] else [])
    out = []
    for n in names:
        hub = SOURCES.get(n).hub if n in SOURCES else ""
        out.append(hub.split(":")[0].split("@")[0] if hub else n)
    return list(dict.fromkeys(out))


def _front_matter(cal: dict[str, Any], cfg: dict[str, Any], base: dict[str, Any]) -> str:
    tags = ["calibration", "calm-bilevel", cal["method"], "lora",
            "multiple-choice" if cal["task"] == "mcqa" else "open-qa"]
    lines = ["---"]
    if base.get("name_or_path"):
        lines.append(f"base_model: {json.dumps(base['name_or_path'])}")
    lines += ["library_name: peft", "tags:", *[f"- {t}" for t in tags], "datasets:",
              *[f"- {json.dumps(n)}" for n in _datasets(cfg)], "---", ""]
    return "\n".join(lines)


def _method_section(cal: dict[str, Any], cfg: dict[str, Any], base: dict[str, Any]) -> str:
    m, s = cfg["model"], cal["scoring"]
    lines = ["## Method", "",
             f"- method `{cal['method']}` (row `{cal['row']}`), task `{cal['task']}`; "
             f"{cfg['train']['steps']} steps, batch {cfg['train']['batch_size']}, "
             f"lr {cfg['train']['lr']}, seed {cfg['seed']}",
             f"- LoRA r={m['lora_r']}, alpha={m['lora_alpha']}, on {', '.join(m['lora_target_modules'])}; "
             f"base weights in {m['dtype']}",
             f"- base: `{base.get('name_or_path')}`, {base.get('source', '')}; fingerprint "
             f"{str(base.get('embedding_sha256', ''))[:12]} (vocabulary {base.get('vocab_size')}; "
             "`apps.calm_llm.export.check_base` refuses another base)",
             f"- options scored in `{s['mode']}` mode, `{s['prompt_style']}` prompt"
             + (f", cloze normalization `{s['cloze_norm']}`" if s["mode"] == "cloze" else "")
             if cal["task"] == "mcqa" else "- answers sampled (open QA; docs/open_qa.md)"]
    if cal["applies"] == "temperature":
        lines.append(f"- temperature T = {cal['temperature']:.6g} divides {cal['divides']}")
    elif cal["applies"] == "alpha":
        lines.append("- α (`alpha.safetensors`, `alpha.json`) acts on the "
                     + ("vocabulary logits (S, L, V) before every softmax" if cal["acts_on"] == "vocab"
                        else "(N, K) option scores before the softmax over options"))
    else:
        lines.append("- applied after the model: nothing (the adapter alone"
                     + (", the run used --no-alpha-at-inference)" if cal.get("alpha_trained") else ")"))
    if cal["method"].startswith("calm"):
        c = cfg["calm"]
        # eta: bome's own option now (plugin_options.bome), a calm field in older configs
        c = {**c, **{k: v for k, v in (cfg.get("plugin_options", {}).get("bome") or {}).items()
                     if k == "eta"}}
        lines.append("- CALM options: " + ", ".join(f"{k}={c[k]}" for k in (
            "solver", "alpha_param", "alpha_form", "alpha_support", "upper_objective", "upper_loss",
            "inner_steps", "eta", "alpha_lr") if k in c))
    return "\n".join(lines) + "\n"


def _data_section(cfg: dict[str, Any], splits: dict[str, Any] | None) -> str:
    d = cfg["data"]
    lines = ["## Data", "", f"- in-domain: {', '.join(d['in_domain'])}; out-of-domain: "
             f"{', '.join(d['out_of_domain']) or 'none'}"
             + (f"; training on instruction data `{d['instruction_data']}`" if d["instruction_data"] else "")]
    if splits:
        sizes = ", ".join(f"{k} {v['n']}" for k, v in splits["splits"].items())
        lines.append(f"- split sizes (questions): {sizes}; split seed {splits.get('seed')}")
    else:
        lines.append(f"- requested sizes: train {d['n_train']}, calibration {d['n_calib']}, "
                     f"test {d['n_test']} per in-domain set, {d['n_ood']} per out-of-domain set")
    return "\n".join(lines) + "\n"


def _results_section(row: str, metrics: dict[str, Any] | None, images: list[str]) -> str:
    per_ds = (metrics or {}).get("results", {}).get(row)
    if not per_ds:
        return "## Results\n\nNo results recorded with this export (written outside a run).\n"
    ece = "conf_ece" if any("conf_ece" in r for r in per_ds.values()) else "semantic_ece"
    lines = ["## Results", "", f"Accuracy, {ece.replace('_', '-')} with its 95% bootstrap "
             "interval, and NLL on the held-out sets (the run's `metrics.json`).", "",
             f"| set | domain | n | accuracy | {ece} [95% CI] | NLL |", "|---|---|---|---|---|---|"]
    for ds, r in per_ds.items():
        ci = r.get(f"{ece}_ci")
        interval = f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else ""
        lines.append(f"| {ds} | {'in' if r.get('domain') == 'id' else 'out'} | {r.get('n')} | "
                     f"{fmt(r.get('accuracy'), nan='nan')} | {fmt(r.get(ece), nan='nan')}{interval} | "
                     f"{fmt(r.get('nll'), nan='nan')} |")
    lines.append("")
    lines += [f"![reliability diagram, {name}]({name})" for name in images]
    return "\n".join(lines) + "\n"


def _copy_diagrams(run: Path, out: Path, cfg: dict[str, Any]) -> list[str]:
    """Copy the run's reliability diagrams (every method of the run so far, overlaid)."""
    names = []
    for ds in [*cfg["data"]["in_domain"], *cfg["data"]["out_of_domain"]]:
        src = run / f"reliability_{''.join(c if c.isalnum() or c in '-_.' else '_' for c in ds)}.png"
        if src.is_file():
            shutil.copyfile(src, out / src.name)
            names.append(src.name)
    return names


def _alpha_section(out: Path) -> str:
    """τ and l ranges and the support of the export's α (nothing without one)."""
    if not (out / "alpha.json").is_file():
        return ""
    from safetensors.torch import load_file

    from calibration import alpha as calibration_alpha

    meta = json.loads((out / "alpha.json").read_text())  # written with the card: has "options"
    param = calibration_alpha.get(meta["param"], **meta["options"])
    values = param.constrained(load_file(str(out / "alpha.safetensors")))
    ids = meta.get("class_ids")
    support = "every vocabulary column" if ids is None else f"{len(ids)} token ids ({meta['support']})"
    lines = ["## α", "", f"- parameterization `{meta['param']}` {json.dumps(meta.get('options', {}))}, "
             f"on {meta['acts_on']}, support: {support}; applied at inference: "
             f"{meta.get('alpha_at_inference', True)}"]
    for name, t in values.items():
        t = t.detach().double().flatten()
        lines.append(f"- {name}: min {float(t.min()):.4g}, median {float(t.median()):.4g}, "
                     f"max {float(t.max()):.4g} ({t.numel()} values)")
    return "\n".join(lines) + "\n"


def _load_section(cal: dict[str, Any]) -> str:
    how = {"alpha": "with α applied", "temperature": "with T applied",
           "none": "(the adapter alone)"}[cal["applies"]]
    return (
        "## Load\n\n"
        f"With the project installed (`pip install calm-bilevel[llm]`), {how}:\n\n"
        "```python\n"
        "from apps.calm_llm.calibrated import load_export\n"
        "model = load_export(\"PATH/TO/THIS/FOLDER\")  # loads the base named in base.json, checks it\n"
        "scores = model.option_scores(\"Question text?\", [\"option A\", \"option B\"])  # softmax = p\n"
        "```\n\n"
        "`model.generate(**inputs)` generates with the calibration applied. Without the project, "
        "`peft.PeftModel.from_pretrained(base, \"PATH/TO/THIS/FOLDER\")` loads the adapter "
        "alone (no α or T); lm-evaluation-harness: `python -m apps.calm_llm.lm_eval_model "
        "--model calm --model_args export=PATH/TO/THIS/FOLDER --tasks ...`.\n"
    )
