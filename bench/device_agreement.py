"""The same tiny model and batch in float64 on the CPU and float32 on a device agree.

    python -m bench.device_agreement [--device cuda]

What a GPU run of the app computes must be what the CPU computes, to float32 accuracy: a
kernel, a dtype cast or a device-dependent branch that goes wrong shows up here as a
deviation far above rounding. The reference is the app's own context (config, synthetic data
through ``--data-files``, `apps.calm_llm.model.load`, LoRA, collator) in float64 on the CPU;
the subject is the same context built on ``--device`` in float32 with the reference's weights
copied in (a random model drawn on another device has other weights). The LoRA B matrices are
drawn nonzero first, so that the adapters are not at the degenerate zero point where the LoRA A
gradients vanish. One lower (training) and one upper (calibration) batch, cloze mode (the
packed shared-prefix forward), α = affine over the vocabulary, no dropout, no checkpointing;
eager attention for every quantity (ITD and AID differentiate through gradients), and again
with the default attention kernel (SDPA, what first-order runs use) for the log-likelihoods
and BOME's directions, marked "(sdpa)".

Compared, each as max |subject − reference| / max |reference| over all entries:

=====================  ==========================================================  =========
quantity               what                                                        tolerance
=====================  ==========================================================  =========
option_loglik          summed log-likelihood of every option of the calibration      1e-4
                       questions (`predict.predict_option_logits`)
bome_outer/inner       BOME's directions for α and θ (Liu et al., 2022, "BOME!")    1e-3
itd_hypergrad          dF/dα through T = 3 unrolled inner steps (ITD)               1e-3
aid_hypergrad          dF/dα by implicit differentiation with 5 CG iterations       1e-3
=====================  ==========================================================  =========

Why these tolerances: float32 carries ~6e-8 relative rounding per operation; the
log-likelihoods are one forward of a 2-layer model and a 4,096-entry log-softmax, while the
directions and hypergradients pass through 3 inner gradient steps, a backward, and (AID) a CG
solve whose residual amplifies rounding by the Hessian's condition number. Measured on the CPU (float32 against float64, 2026-12-06): option_loglik 1.1e-7, bome_outer
4.3e-6, bome_inner 1.3e-6, itd_hypergrad 3.0e-6, aid_hypergrad 2.6e-5 (CG stops at its second
iteration, where the random model's lower Hessian turns out indefinite, in both precisions).
The tolerances are 40-1000× above those and below bf16's own rounding (4e-3 relative per
operation), so a silent cast to half precision fails the check, as would a wrong kernel or branch.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
from pathlib import Path
from typing import Any

import torch

TOLERANCES = {"option_loglik": 1e-4, "bome_outer": 1e-3, "bome_inner": 1e-3,
              "itd_hypergrad": 1e-3, "aid_hypergrad": 1e-3}
MODEL = "random:llama-3.1-8b@layers=2,hidden=64,vocab=4096"


def deviation(got: dict[str, torch.Tensor] | torch.Tensor, ref: dict[str, torch.Tensor] | torch.Tensor) -> float:
    """max |got − ref| / max |ref| over every entry (of every tensor of a dict), in float64."""
    if isinstance(ref, dict):
        got = torch.cat([got[k].detach().double().cpu().flatten() for k in ref])
        ref = torch.cat([ref[k].detach().double().cpu().flatten() for k in ref])
    got, ref = got.detach().double().cpu(), ref.detach().double().cpu()
    finite = torch.isfinite(ref)  # option slots a question does not have are -inf in both
    if not torch.equal(finite, torch.isfinite(got)):
        return float("inf")
    scale = float(ref[finite].abs().max())
    return float((got[finite] - ref[finite]).abs().max()) / (scale if scale > 0 else 1.0)


def _argv(device: str, data: list[str], solver: str) -> list[str]:
    return ["--config", "paper-7b", "--model", MODEL, "--dtype", "fp32", "--device", device,
            "--mode", "cloze", "--lora-r", "4", "--lora-alpha", "8", "--lora-dropout", "0",
            "--no-gradient-checkpointing", "--solver", solver, "--methods", "calm",
            "--in-domain", "synth_arith", "--out-of-domain", "synth_words", "--n-train", "8",
            "--n-calib", "4", "--n-test", "4", "--n-ood", "4", "--batch-size", "4",
            "--grad-accum", "1", "--calib-batch-size", "4", "--data-files", *data]


def build(device: str, data: list[str], solver: str = "itd") -> Any:
    """The app's context for the tiny model on ``device`` (float32), as the runner builds it;
    ``solver`` itd gives eager attention (second order), bome the default kernel (SDPA)."""
    from apps.calm_llm.config import parse_args
    from apps.calm_llm.distributed import Dist
    from apps.calm_llm.tasks.mcqa import build_mc, load_data

    cfg = parse_args(_argv(device, data, solver))
    return build_mc(cfg, Dist(), load_data(cfg)).ctx


def measure(ctx: Any, method: Any, solvers: tuple[str, ...] = ("bome", "itd", "aid")) -> dict[str, Any]:
    """Option log-likelihoods, BOME's directions and the ITD/AID hypergradients (those of
    ``solvers``) on the first lower and upper batch of the method's streams."""
    from apps.calm_llm.predict import predict_option_logits
    from apps.calm_llm.solvers import build_solver

    lower, upper = method.streams["train"].next(), method.streams["calib"].next()
    out: dict[str, Any] = {"option_loglik": predict_option_logits(ctx, method, ctx.calib_examples, "agreement")[0]}
    inner = {n: p.detach() for n, p in ctx.lm.inner().items()}
    outer = {n: a.detach() for n, a in method.alpha.params.items()}
    with ctx.lm.mode(True):
        for name in solvers:
            solver = build_solver(dataclasses.replace(
                ctx.cfg, calm=dataclasses.replace(ctx.cfg.calm, solver=name)))
            res = solver.step(method.problem, outer, inner, upper_batch=upper, lower_batch=lower)
            if name == "bome":
                out["bome_outer"], out["bome_inner"] = res.outer_grad, res.inner_grad
            else:
                out[f"{name}_hypergrad"] = res.outer_grad
    return out


@torch.no_grad()
def _draw_lora_b(ctx: Any, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    for n, p in ctx.lm.inner().items():
        if "lora_B" in n:
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)


def check(device: str = "auto") -> dict[str, Any]:
    """Reference (CPU, float64) against subject (``device``, float32): per quantity the
    deviation, its tolerance and whether it is within; plus a markdown table."""
    from apps.calm_llm import methods
    from apps.calm_llm.data import synthetic
    from apps.calm_llm.model import resolve_device

    dev = str(resolve_device(device))
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 means float32 on the GPU too
    with tempfile.TemporaryDirectory() as tmp:
        data = [f"{n}={synthetic.write_jsonl(synthetic.questions(k, 24), Path(tmp) / f'{n}.jsonl')}"
                for n, k in (("synth_arith", "arithmetic"), ("synth_words", "categories"))]
        ref, sub, sdpa = build("cpu", data), build(dev, data), build(dev, data, "bome")
    _draw_lora_b(ref)
    for ctx in (sub, sdpa):
        ctx.lm.model.load_state_dict(ref.lm.model.state_dict())
    ref.lm.model.to(torch.float64)
    calm = methods.info("calm").load()
    m_ref, m_sub, m_sdpa = calm(ref), calm(sub), calm(sdpa)
    for a in m_ref.alpha.params.values():
        a.data = a.data.double()
    got_ref = measure(ref, m_ref)
    quantities = {}
    # eager attention (every quantity), then the default SDPA kernel that first-order runs use
    for suffix, got in (("", measure(sub, m_sub)), (" (sdpa)", measure(sdpa, m_sdpa, ("bome",)))):
        for k, value in got.items():
            d, tol = deviation(value, got_ref[k]), TOLERANCES[k]
            quantities[k + suffix] = {"deviation": d, "tolerance": tol, "ok": d <= tol}
    worst = max(quantities, key=lambda k: quantities[k]["deviation"])
    lines = [f"float64 (cpu) vs float32 ({dev}), {MODEL}: largest deviation {worst} "
             f"{quantities[worst]['deviation']:.2e}", "",
             "| quantity | max abs deviation / max abs | tolerance | ok |", "|---|---|---|---|"]
    lines += [f"| {k} | {q['deviation']:.2e} | {q['tolerance']:.0e} | {'yes' if q['ok'] else 'NO'} |"
              for k, q in quantities.items()]
    return {"device": dev, "model": MODEL, "quantities": quantities, "largest": worst,
            "table": "\n".join(lines)}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto")
    result = check(ap.parse_args().device)
    print(result["table"])
    raise SystemExit(0 if all(q["ok"] for q in result["quantities"].values()) else 1)
