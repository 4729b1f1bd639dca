"""Regenerate docs/img/calibration_alpha.png: the effect of each α parameterization.

A synthetic 4-class model that is overconfident (logits scaled by 3) and biased toward class
0 (+1 on its logit) is fitted post hoc with each parameterization on one half of the data and
evaluated on the other half. Run: python docs/calibration_figures.py
"""

from __future__ import annotations

from pathlib import Path

import torch

from calibration import alpha, plots, posthoc


def synthetic(n: int = 4000, k: int = 4, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    z_true = 1.2 * torch.randn(n, k, generator=g, dtype=torch.float64)
    labels = torch.multinomial(z_true.softmax(-1), 1, generator=g).squeeze(1)
    bias = torch.zeros(k, dtype=torch.float64)
    bias[0] = 1.0
    return 3.0 * z_true + bias, labels


def main(out: Path = Path(__file__).parent / "img" / "calibration_alpha.png") -> Path:
    logits, labels = synthetic()
    half = logits.shape[0] // 2
    fit_z, fit_y, ev_z, ev_y = logits[:half], labels[:half], logits[half:], labels[half:]
    curves = {"uncalibrated": (ev_z.softmax(-1), ev_y)}
    for name in ("temperature", "class_temperature", "shift", "affine"):
        fit = posthoc.fit_alpha(name, fit_z, fit_y, dtype=torch.float64)
        adjusted = alpha.get(name).apply(fit.params, ev_z)
        curves[name] = (adjusted.softmax(-1), ev_y)
    return plots.reliability_diagram(
        curves, out, n_bins=10, title="α parameterizations fitted post hoc (held-out half)"
    )


if __name__ == "__main__":
    print(main())
