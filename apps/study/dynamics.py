"""Training dynamics of a trained row, from its ``history_<row>.jsonl``: what the summary's
dynamics table averages over seeds (BOME's λ and cosines, α's range; docs/calm.md)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

DYNAMICS_MEAN = ("lambda", "cos", "cos_outer", "cos_inner", "calib_entropy")
DYNAMICS_LAST = ("alpha_tau_min", "alpha_tau_max", "alpha_l_min", "alpha_l_max", "alpha_moved")


def dynamics(history: Path) -> dict[str, float]:
    """Over one trained row's steps: the mean of λ, the cosines and the calibration entropy, and
    α's range after the last step (keys a method does not record are left out)."""
    from apps.calm_llm.history import read_history  # a damaged line is named, with the fix

    steps = read_history(history)
    out = {f"mean_{k}": float(np.mean([h[k] for h in steps])) for k in DYNAMICS_MEAN
           if steps and all(k in h for h in steps)}
    out.update({f"last_{k}": float(steps[-1][k]) for k in DYNAMICS_LAST if steps and k in steps[-1]})
    return out
