"""What every example shares: the command line, one training loop for every solver
(``bilevel.fit`` with a timing callback), and the outputs (JSON, a Markdown table, a PNG of a
metric against wall-clock with one curve per solver).

Wall-clock excludes the evaluations: the clock stops while ``evaluate`` runs, so a curve's
x-axis is the time the solver itself spent.
"""

from __future__ import annotations

import argparse
import json
import math
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import bilevel

Curve = list[dict[str, float]]


@dataclass(frozen=True)
class Setup:
    """How one solver runs in an example.

    ``inner_update="solution"``: θ ← θ_T after each step (the ITD/AID/meta-learning warm
    start); ``"optimizer"``: θ takes one SGD step of size ``inner_lr`` along the solver's
    ``inner_grad`` (BOME's joint update). α always takes an Adam step of size ``outer_lr``
    (``outer_optimizer="sgd"``: plain SGD, Reptile's outer update).
    """

    solver: Any
    outer_lr: float
    inner_update: str = "solution"
    inner_lr: float = 0.0
    outer_optimizer: str = "adam"


def parse_args(description: str, argv: Sequence[str] | None) -> argparse.Namespace:
    """``--quick`` (the tests' size), ``--out DIR``, ``--seed N``, ``--only NAME``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="a few seconds (the tests' size)")
    parser.add_argument("--out", default="runs/examples", help="folder for the JSON/MD/PNG")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--only", action="append", metavar="NAME", help="run only this solver (repeatable)"
    )
    return parser.parse_args(argv)


def select(table: dict[str, Any], only: list[str] | None) -> dict[str, Any]:
    """The entries of a solver table named by ``--only`` (all when None); unknown names are
    an error that lists the known ones."""
    if not only:
        return table
    unknown = [n for n in only if n not in table]
    if unknown:
        raise SystemExit(f"--only: unknown solver(s) {unknown}; known: {list(table)}")
    return {n: table[n] for n in only}


def train(
    problem: bilevel.Problem,
    setup: Setup,
    outer: Any,
    inner: Any,
    *,
    steps: int,
    eval_every: int,
    evaluate: Callable[[], dict[str, float]],
    batches: Callable[[int], tuple[Any, Any]],
) -> Curve:
    """Run ``setup`` for ``steps`` outer steps with ``bilevel.fit``; ``evaluate()`` at step 0,
    every ``eval_every`` steps and at the end. Returns the curve: one dict per evaluation
    with ``step``, ``time_s`` (solver time so far) and the metrics."""
    alphas = bilevel.tree.leaves(outer)
    opt_cls = torch.optim.Adam if setup.outer_optimizer == "adam" else torch.optim.SGD
    outer_opt = opt_cls(alphas, lr=setup.outer_lr)
    inner_opt = None
    if setup.inner_update == "optimizer":
        inner_opt = torch.optim.SGD(bilevel.tree.leaves(inner), lr=setup.inner_lr)
    curve = [{"step": 0.0, "time_s": 0.0, **evaluate()}]
    clock = {"spent": 0.0, "since": time.perf_counter(), "done": 0}

    def callback(k: int, result: bilevel.StepResult) -> bool:
        clock["done"] = k + 1
        if (k + 1) % eval_every and k + 1 != steps:
            return False
        clock["spent"] += time.perf_counter() - clock["since"]
        point = {"step": float(k + 1), "time_s": clock["spent"], **evaluate()}
        clock["since"] = time.perf_counter()
        if not all(math.isfinite(v) for v in point.values()):
            # the last update made the variables non-finite: stop and say so
            point["diverged"] = f"a non-finite metric after step {k + 1}"
        curve.append(point)
        return "diverged" in point

    # CG warns at every step where the Hessian is not positive definite along its search
    # direction (the MLPs); counted and reported instead of printed thousands of times.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        try:
            _fit(problem, setup, outer, inner, steps, outer_opt, inner_opt, batches, callback)
        except FloatingPointError as err:
            # A solver that diverges is a result, not a crash of the whole comparison. The
            # step raised before any update, so the variables are still the last finite ones.
            clock["spent"] += time.perf_counter() - clock["since"]
            point = {"step": float(clock["done"]), "time_s": clock["spent"], **evaluate()}
            curve.append({**point, "diverged": str(err)})
    curve[-1]["cg_indefinite_steps"] = float(
        sum("not positive definite" in str(w.message) for w in caught)
    )
    return curve


def _fit(
    problem: bilevel.Problem,
    setup: Setup,
    outer: Any,
    inner: Any,
    steps: int,
    outer_opt: torch.optim.Optimizer,
    inner_opt: torch.optim.Optimizer | None,
    batches: Callable[[int], tuple[Any, Any]],
    callback: Callable[[int, bilevel.StepResult], bool],
) -> None:
    bilevel.fit(
        problem,
        setup.solver,
        outer,
        inner,
        steps=steps,
        outer_optimizer=outer_opt,
        inner_optimizer=inner_opt,
        batches=batches,
        inner_update="optimizer" if inner_opt is not None else setup.inner_update,
        callback=callback,
        progress=False,
    )


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """A Markdown table with the keys of the first row as columns (floats to 4 digits)."""
    cols = list(rows[0])

    def cell(v: Any) -> str:
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(cell(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


Panel = tuple[str, str] | tuple[str, str, str]


def plot(path: Path, curves: dict[str, Curve], panels: list[Panel], title: str) -> None:
    """One panel per (metric, label[, run-name prefix]): that metric against solver time, one
    line per run (only the runs whose name starts with the prefix, when given)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    for ax, (metric, label, *prefix) in zip(axes[0], panels):
        for name, curve in curves.items():
            if prefix and not name.startswith(prefix[0]):
                continue
            points = [(p["time_s"], p[metric]) for p in curve if metric in p]
            if points:
                ax.plot(*zip(*points), marker=".", label=name)
        ax.set_xlabel("solver wall-clock (s; evaluations excluded)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(
    out: str,
    name: str,
    *,
    config: dict[str, Any],
    curves: dict[str, Curve],
    summary: list[dict[str, Any]],
    panels: list[Panel],
    title: str,
    notes: str = "",
) -> dict[str, Path]:
    """``out/NAME.json`` (config, curves, summary), ``out/NAME.md`` (the summary table and
    ``notes``) and ``out/NAME.png`` (:func:`plot`). Returns the three paths."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    paths = {ext: folder / f"{name}.{ext}" for ext in ("json", "md", "png")}
    record = {"example": name, "config": config, "curves": curves, "summary": summary}
    paths["json"].write_text(json.dumps(record, indent=1) + "\n")
    text = f"# {title}\n\n{markdown_table(summary)}"
    paths["md"].write_text(text + (f"\n{notes}\n" if notes else ""))
    plot(paths["png"], curves, panels, title)
    return paths


def summary_row(
    label: str, name: str, curve: Curve, finals: dict[str, str], best: tuple[str, str]
) -> dict[str, Any]:
    """One table row: ``{label: name}``, the final value of each metric in ``finals``
    (column → metric), the best value of ``best = (metric, "min" | "max")`` over the curve and
    the solver time at which it was reached, the total time and CG's indefinite steps."""
    metric, mode = best
    pick = min if mode == "min" else max
    finite = [p for p in curve if math.isfinite(p[metric])]
    top = pick(finite, key=lambda p: p[metric])
    return {
        label: name,
        **{column: curve[-1][m] for column, m in finals.items()},
        f"best {metric}": top[metric],
        "time to best (s)": top["time_s"],
        "total time (s)": curve[-1]["time_s"],
        "CG indefinite steps": int(curve[-1]["cg_indefinite_steps"]),
        "note": f"diverged after {int(curve[-1]['step'])} steps" if "diverged" in curve[-1] else "",
    }
