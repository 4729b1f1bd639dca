"""Peers side by side on the classic problems of examples/ (issue 26).

    python -m bench.peers [--quick] [--no-timing] [--problems ...] [--out STEM]

Problems (built from the examples' own data, models and initializations):

    hyper_cleaning/linear, hyper_cleaning/mlp   sklearn digits, 50 % of training labels
                                                corrupted (examples/hyper_cleaning.py)
    l2_hpo                                      per-feature L2, breast cancer (examples/l2_hpo.py)
    sinusoid                                    few-shot sinusoid MAML (examples/few_shot_sinusoid.py)

Methods (bench/peer_steps.py): ITD-SGD and ITD-Adam (T unrolled SGD / Adam steps, θ warm-
started at θ^(T)), AID-CG (T graph-free steps, then implicit differentiation with at most K
CG iterations), MAML (T steps from α), V-PBGD (first order: γ = 10, θ^(T) by T steps, θ takes
an SGD step of β/γ along ∇f + γ∇g, as in the examples). For each (problem, method) every library that has the
method runs the SAME problem: same data, initialization, outer Adam step size, T, inner step
size and K, for the same number of outer steps, all in one process. Recorded per library:

- the relative error ‖h − h_bilevel‖ / ‖h_bilevel‖ of its first-step hypergradient (same α, θ
  for everyone): the evidence that a peer computes what the method defines, or does not;
- the median seconds per outer step as a ratio to bilevel's, the steps taken round-robin by
  bench/harness.time_alternating (the order rotates each round; ``--no-timing`` runs the same
  round-robin loop without a clock, for results taken on a shared machine);
- the final metric after the same number of outer steps (test accuracy and cleaner F1,
  validation/test loss, post-adaptation meta-test MSE);
- any failure: the exception text, or the step at which the hypergradient became non-finite.

Writes bench/results/peers[_quick].json and .md. Peers missing here are skipped with the
reason (torchopt, higher from the ``bench`` extra; betty via ``BETTY_PATH``, see
bench/libs/betty_lib.py).
"""

from __future__ import annotations

import argparse
import importlib.metadata
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import bilevel

from . import harness, libs
from .peer_oracle import oracle_errors
from .peer_steps import LIBRARIES, Hypergrad, Spec, State, bilevel_hypergrad

PROBLEMS = ("hyper_cleaning/linear", "hyper_cleaning/mlp", "l2_hpo", "sinusoid")
Metric = Callable[[State], dict[str, float]]


@dataclass
class Case:
    """A classic problem: one Spec per method, the metric of a final state, the step count."""

    specs: dict[str, Spec]
    metric: Metric
    steps: int


def _cast(tree: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Floating entries in ``dtype`` (new leaves that require grad where the input did)."""
    return {k: v.detach().to(dtype).requires_grad_(v.requires_grad) if v.is_floating_point()
            else v for k, v in tree.items()}


def hyper_cleaning(kind: str, quick: bool, seed: int, dtype: torch.dtype) -> Case:
    """examples/hyper_cleaning.py: its data split, model, ridge and initialization."""
    from examples import hyper_cleaning as hc

    data = _cast(hc.load_data((200, 150, 200) if quick else (800, 400, 597), seed), dtype)
    model = hc.init_model(kind, torch.Generator().manual_seed(seed))
    problem = hc.problem_for(data, model)

    def init() -> tuple[dict, dict]:
        theta = _cast(hc.init_model(kind, torch.Generator().manual_seed(seed)).params, dtype)
        return {"a": torch.zeros(len(data["y_train"]), dtype=dtype, requires_grad=True)}, theta

    def metric(state: State) -> dict[str, float]:
        with torch.no_grad():
            pred = model(state.theta, data["x_test"]).argmax(-1)
            f1 = hc.cleaner_f1(torch.sigmoid(state.alpha["a"]), data["corrupted"])
        return {"test_acc": float((pred == data["y_test"]).float().mean()), "f1": f1}

    # the example's settings (T = 10, β = 0.5, K = 20, outer Adam 0.1); Adam's inner step
    # size is this benchmark's (0.5 is an SGD step size)
    common = {"problem": problem, "init": init, "batches": (None, None), "outer_lr": 0.1}
    specs = {
        m: Spec(**common, inner_steps=10, inner_lr=0.05 if m == "ITD-Adam" else hc.INNER_LR)
        for m in ("ITD-SGD", "ITD-Adam", "AID-CG", "V-PBGD")
    }
    return Case(specs, metric, 4 if quick else 400)


def l2_hpo(quick: bool, seed: int, dtype: torch.dtype) -> Case:
    """examples/l2_hpo.py: breast cancer in thirds, α = 0, θ = 0."""
    from examples import l2_hpo as ex

    data = _cast(ex.load_data(seed, 300 if quick else None), dtype)
    d = data["x_train"].shape[1]
    model = ex.init_model(d)
    problem = ex.problem_for(data, model)

    def init() -> tuple[dict, dict]:
        alpha = _cast({"a": torch.zeros(d, requires_grad=True)}, dtype)
        return alpha, _cast(ex.init_model(d).params, dtype)

    def metric(state: State) -> dict[str, float]:
        with torch.no_grad():
            val = float(problem.upper(state.alpha, state.theta, None))
            test = float(ex.bce(model, state.theta, data, "test"))
        return {"val_loss": val, "test_loss": test}

    common = {"problem": problem, "init": init, "batches": (None, None), "outer_lr": 0.05}
    specs = {
        m: Spec(**common, inner_steps=ex.INNER_STEPS, cg_iters=40,
                inner_lr=0.01 if m == "ITD-Adam" else ex.INNER_LR)
        for m in ("ITD-SGD", "ITD-Adam", "AID-CG", "V-PBGD")
    }
    return Case(specs, metric, 4 if quick else 300)


def sinusoid(quick: bool, seed: int, dtype: torch.dtype) -> Case:
    """examples/few_shot_sinusoid.py's MAML (T = 5, β = 0.02, outer Adam 1e-3), task pool."""
    from examples import few_shot_sinusoid as ex

    pool, tests = (4, 10) if quick else (25, 100)
    gen = torch.Generator().manual_seed(10_000 + seed)
    support, query, test_support, test_query = (
        _cast(b, dtype) for b in (*ex.sample_tasks(pool, (10, 10), gen),
                                  *ex.sample_tasks(tests, (10, 50), gen)))
    problem = bilevel.meta_problem(ex.task_loss)

    def init() -> tuple[dict, dict]:
        alpha = _cast(ex.init_params(torch.Generator().manual_seed(seed)), dtype)
        copies = bilevel.task_copies(alpha, pool)
        return alpha, {k: v.requires_grad_(True) for k, v in copies.items()}

    def metric(state: State) -> dict[str, float]:
        mse = ex.adapted_mse(problem, state.alpha, test_support, test_query, 5, 0.02)
        return {"test_mse": mse}

    spec = Spec(problem, init, (query, support), outer_lr=1e-3, inner_steps=5, inner_lr=0.02,
                task_loss=ex.task_loss)
    return Case({"MAML": spec}, metric, 3 if quick else 500)


def build_case(name: str, quick: bool, seed: int, dtype: torch.dtype = torch.float32) -> Case:
    """The :class:`Case` named ``name`` (one of PROBLEMS), its data and variables in ``dtype``
    (float32 for the runs, float64 for the oracles)."""
    if name.startswith("hyper_cleaning/"):
        return hyper_cleaning(name.split("/")[1], quick, seed, dtype)
    if name == "l2_hpo":
        return l2_hpo(quick, seed, dtype)
    return sinusoid(quick, seed, dtype)


@dataclass
class Runner:
    """One library's run of a (problem, method): its state, its hypergradient function and
    what went wrong. A failed run stops taking steps (its calls become no-ops)."""

    library: str
    hypergrad: Hypergrad
    state: State
    steps: int = 0
    first: list[torch.Tensor] | None = None
    error: str = ""
    notes: list[str] = field(default_factory=list)

    def step(self) -> None:
        """One outer step: hypergradient, then the shared outer update (skipped once failed)."""
        if self.error:
            return
        try:
            grads, theta = self.hypergrad(self.state)
        except Exception as err:  # a peer's failure is a result, recorded with its text
            self.error = f"step {self.steps + 1}: {type(err).__name__}: {err}"[:500]
            return
        bad = sum(int((~torch.isfinite(g)).sum()) for g in grads)
        if bad:
            total = sum(g.numel() for g in grads)
            self.error = f"step {self.steps + 1}: non-finite hypergradient ({bad} of {total} entries)"
            return
        if self.first is None:
            self.first = [g.detach().clone() for g in grads]
        self.state.apply(grads, theta)
        self.steps += 1


def runners_for(spec: Spec, method: str) -> tuple[list[Runner], list[dict[str, Any]]]:
    """A Runner per library that has ``method`` and imports; a record for each skipped one."""
    runners, skipped = [], []
    for library, (methods, builder) in LIBRARIES.items():
        if method not in methods:
            continue
        why = None if library == "bilevel" else libs.unavailable(library)
        if why is not None:
            skipped.append({"library": library, "error": f"skipped: {why}"})
            continue
        try:
            runners.append(Runner(library, builder(spec, method), State(spec)))
        except Exception as err:
            skipped.append({"library": library, "error": f"build: {type(err).__name__}: {err}"})
    return runners, skipped


def run_case(
    runners: list[Runner], steps: int, timing: bool
) -> dict[str, list[float]]:
    """Step 1 for everyone (the agreement point), then steps 2.. round-robin: timed with
    harness.time_alternating (no warm-up round: every step counts toward the final metric)
    or, with ``timing=False``, the same rotation without a clock."""
    for r in runners:
        r.step()
    rest = steps - 1
    if rest <= 0:
        return {}
    if timing:
        runs = {r.library: r.step for r in runners}
        return harness.time_alternating(
            runs, device=torch.device("cpu"), warmup=0, repeats=rest, min_repeats=rest
        )
    for k in range(rest):
        for r in runners[k % len(runners) :] + runners[: k % len(runners)]:
            r.step()
    return {}


def records_for(
    problem: str, method: str, case: Case, runners: list[Runner], times: dict[str, list[float]],
    oracle: dict[str, dict[str, Any]],
) -> list[dict[str, Any]]:
    """One record per library: agreement with bilevel and with the float64 oracle
    (bench/peer_oracle.py), time ratio, final metric, failure."""
    ref = next((r for r in runners if r.library == "bilevel"), None)
    ref_time = harness.median(times["bilevel"]) if "bilevel" in times else None
    out = []
    for r in runners:
        rel = None
        if r.first is not None and ref is not None and ref.first is not None:
            rel = harness.rel_error(torch.cat([g.reshape(-1) for g in r.first]),
                                    torch.cat([g.reshape(-1) for g in ref.first]))
        sec = harness.median(times[r.library]) if r.library in times and not r.error else None
        out.append({
            "problem": problem, "method": method, "library": r.library,
            "version": version(r.library), "steps_done": r.steps, "steps": case.steps,
            "first_step_rel_error": rel, **oracle.get(r.library, {}), "seconds_median": sec,
            "time_ratio": sec / ref_time if sec is not None and ref_time else None,
            "metric": case.metric(r.state), "error": r.error,
        })
    return out


def float64_record(
    problem: str, method: str, spec64: Spec, first32: list[torch.Tensor] | None
) -> dict[str, Any]:
    """bilevel's first step in float64: its distance to the float32 one measures how much
    rounding the problem amplifies (a peer cannot be judged closer than that), and its oracle
    error shows the method itself is right where float32 cannot tell."""
    h64, _ = bilevel_hypergrad(spec64, method)(State(spec64))
    oracle = oracle_errors(spec64, method, {"bilevel": h64}).get("bilevel", {})
    rel = None
    if first32 is not None:
        rel = harness.rel_error(torch.cat([g.reshape(-1) for g in first32]),
                                torch.cat([g.reshape(-1) for g in h64]))
    return {"problem": problem, "method": method, "library": "bilevel@float64",
            "version": version("bilevel"), "steps_done": 1, "steps": 1,
            "first_step_rel_error": rel, **oracle, "seconds_median": None, "time_ratio": None,
            "metric": {}, "error": ""}


def drift(problem: str, method: str, steps: int, seed: int = 0) -> list[dict[str, Any]]:
    """How far rounding alone moves a run: every library's float32 α after k outer steps
    against bilevel's float64 run of the same problem (relative distance), at k = 1, 10, 50,
    100, 200, 500 up to ``steps``. Explains final-metric gaps between libraries whose first
    steps agree: a non-convex run amplifies float32 rounding step after step."""
    case32, case64 = build_case(problem, False, seed), build_case(problem, False, seed, torch.float64)
    runners, _ = runners_for(case32.specs[method], method)
    spec64 = case64.specs[method]
    ref = Runner("bilevel@float64", bilevel_hypergrad(spec64, method), State(spec64))

    def flat(r: Runner) -> torch.Tensor:
        return torch.cat([v.detach().double().reshape(-1) for v in r.state.alpha.values()])

    rows = []
    for k in range(1, steps + 1):
        for r in [*runners, ref]:
            r.step()
        if k in (1, 10, 50, 100, 200, 500) or k == steps:
            a64 = flat(ref)
            rows.append({"step": k, **{r.library: float((flat(r) - a64).norm() / a64.norm())
                                       for r in runners if not r.error}})
            print(rows[-1], flush=True)
    return rows


def version(library: str) -> str:
    """The installed version of ``library`` (betty and BOAT as their distributions name them)."""
    library = library.split("@")[0]
    dist = {"bilevel": "calm-bilevel", "betty": "betty-ml", "boat": "boat-torch"}.get(library, library)
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        if library == "betty":
            return "0.1.1 (unpacked wheel, BETTY_PATH)"
        return "this checkout" if library == "bilevel" else "unknown"


def render(records: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    """The Markdown report: one row per (problem, method, library)."""
    head = ["problem", "method", "library", "version", "first-step rel. error vs bilevel",
            "vs float64 oracle", "time / bilevel", "final metric", "steps", "failure"]
    rows = [
        [r["problem"], r["method"], r["library"], r.get("version", ""),
         harness.fmt(r.get("first_step_rel_error"), "err"), _oracle_cell(r),
         harness.fmt(r.get("time_ratio"), "x"),
         ", ".join(f"{k} {v:.4g}" for k, v in (r.get("metric") or {}).items()),
         f"{r.get('steps_done', 0)}/{r.get('steps', 0)}", r.get("error") or ""]
        for r in records
    ]
    timing = "round-robin, median per outer step" if meta["timing"] else "not measured (--no-timing)"
    if meta.get("steps_override"):
        timing += f"; every problem run for {meta['steps_override']} outer step(s) only (--steps)"
    return (f"# Peers on the classic problems ({meta['mode']})\n\n"
            f"Timing: {timing}. Environment: {meta['env']}.\n\n"
            + harness.markdown_table(head, rows) + "\n\n" + LEGEND)


LEGEND = """\
Columns: the first outer step's hypergradient (same α, θ for every library) against bilevel's
(`bilevel@float64`: bilevel's own first step in float64, against its float32 one: the rounding
the problem amplifies),
and against a float64 oracle independent of all libraries (fd: max over a random direction and
the hypergradient's own of |⟨h, u⟩ − central difference of F(α) = f(α, θ_T(α))| / |·|; dense:
the implicit hypergradient at θ^(T) by a dense solve, which CG with K iterations approximates).
`time / bilevel`: median seconds per outer step over the round-robin steps. `final metric`:
after `steps` outer steps from the same start. A failure stops that library's run (its metric
is then at the step where it stopped). Explanations of the disagreements: docs/bilevel.md,
"Peers on the classic problems".
"""


def _oracle_cell(record: dict[str, Any]) -> str:
    if record.get("oracle_rel_error") is None:
        return "–"
    cell = f"{harness.fmt(record['oracle_rel_error'], 'err')} ({record['oracle']})"
    if record.get("oracle_own_rule_rel_error") is not None:
        cell += f"; its own Adam rule: {harness.fmt(record['oracle_own_rule_rel_error'], 'err')}"
    return cell


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, a few steps (tests)")
    parser.add_argument("--no-timing", action="store_true", help="same loop, no clock")
    parser.add_argument("--problems", nargs="+", choices=PROBLEMS, default=list(PROBLEMS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=None,
                        help="outer steps for every problem (default: the examples' counts); "
                             "1 = the first-step agreement alone")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None, help="output stem (.json and .md)")
    parser.add_argument("--drift", type=int, default=None, metavar="STEPS",
                        help="instead: each library's float32 α against bilevel's float64 run "
                             "over STEPS outer steps, first problem and its first method")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Every problem × method × library; writes the JSON and the Markdown table."""
    args = _parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.drift is not None:
        problem = args.problems[0]
        method = next(iter(build_case(problem, True, args.seed).specs))
        rows = drift(problem, method, args.drift, args.seed)
        out = args.out or harness.RESULTS / "peers_drift"
        out.with_suffix(".md").write_text(
            f"# Rounding drift: {problem} {method}, relative ‖α − α_bilevel,float64‖\n\n"
            + harness.markdown_table(list(rows[0]), [[harness.fmt(v) for v in r.values()]
                                                     for r in rows]) + "\n")
        return 0
    out = args.out or harness.RESULTS / f"peers{'_quick' if args.quick else ''}"
    if args.steps is not None and args.steps < 1:
        raise SystemExit(f"--steps must be ≥ 1, got {args.steps}; 1 runs the agreement step alone")
    meta = {"mode": "quick" if args.quick else "full", "timing": not args.no_timing,
            "steps_override": args.steps,
            "seed": args.seed, "env": harness.environment(torch.device("cpu"))}
    rec = harness.Recorder(out.with_suffix(".json"), meta)
    for problem in args.problems:
        case = build_case(problem, args.quick, args.seed)
        case.steps = args.steps or case.steps
        case64 = build_case(problem, args.quick, args.seed, torch.float64)
        for method, spec in case.specs.items():
            print(f"{problem} {method}", flush=True)
            runners, skipped = runners_for(spec, method)
            times = run_case(runners, case.steps, not args.no_timing)
            firsts = {r.library: r.first for r in runners if r.first is not None}
            oracle = oracle_errors(case64.specs[method], method, firsts)
            for record in records_for(problem, method, case, runners, times, oracle):
                rec.add(record)
            rec.add(float64_record(problem, method, case64.specs[method], firsts.get("bilevel")))
            for s in skipped:
                rec.add({"problem": problem, "method": method, "steps": case.steps, **s})
    text = render(rec.records, meta)
    out.with_suffix(".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
