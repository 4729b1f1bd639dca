"""The contract of a task: what `apps.calm_llm.runner.run` calls, stage by stage.

A task owns what differs between multiple choice and open QA: its data (``load_splits``), the
model-side state its rows are evaluated against (``build``), its evaluation of one row
(``evaluate``: fit, predict, metrics into ``state.results``), its files (``write_results``,
``restore``) and its table (``render_table``). The stages that do not differ (run directory,
resume checks, training, export, the row's summary line) are `apps.calm_llm.runner`'s and call
these methods; they never name a task.

A subclass is registered in `apps.calm_llm.task_table` by a `TaskInfo` whose ``target`` names
it (a plugin does this in its own module, docs/extending.md "Tasks"); ``tasks.get(name)``
returns an instance with ``info`` set.
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...errors import ConfigError
from .. import distributed
from ..task_table import TaskInfo

if TYPE_CHECKING:
    from .. import methods as method_registry
    from ..config import Config
    from ..methods.base import Context, Method
    from ..runner.load import Evaluation
    from ..runner.report import RunState


class Task:
    """One ``--task``. Subclasses implement the methods that raise `NotImplementedError`; the
    others are defaults a task may override."""

    info: TaskInfo

    def __init__(self, info: TaskInfo) -> None:
        self.info = info

    @property
    def name(self) -> str:
        return self.info.name

    # -- stage 1-2: data and model ---------------------------------------------------------------
    def check(self, cfg: Config, dist: distributed.Dist) -> None:
        """Refuse, before the run directory is claimed, what this task cannot run: several
        processes (``info.single_process``), ``--select`` (``info.supports_select``)."""
        if self.info.single_process and dist.world > 1:
            raise ConfigError(f"--task {self.name} runs in a single process (sampling is not "
                              "sharded); launch it without accelerate/torchrun")
        if cfg.select and not self.info.supports_select:
            raise ConfigError(f"--select is not supported with --task {self.name} (its choice "
                              "reads multiple-choice predictions); run one setting per run")

    def load_splits(self, cfg: Config) -> Any:
        """The run's `data.splits.Splits` (train / calib / per-source test / OOD)."""
        raise NotImplementedError

    def run_record(self, splits: Any, dist: distributed.Dist) -> dict[str, Any]:
        """``metrics.json``'s run-level record beyond the config hash: the splits' fingerprints."""
        return {"split_fingerprints": splits.fingerprints()}

    def build(self, cfg: Config, dist: distributed.Dist, splits: Any) -> Evaluation:
        """Load the model and build the methods' `Context` and the evaluation sets."""
        raise NotImplementedError

    # -- stage 4-5: evaluate and report ----------------------------------------------------------
    def restore(self, state: RunState) -> None:
        """On resume, keep the rows already evaluated (``runner.report.restore_rows``), each
        checked against its saved outputs. Default: nothing is kept."""

    def before_rows(self, state: RunState, ev: Evaluation) -> None:
        """Anything measured once before the rows (multiple choice: the zero-shot probe)."""

    def run_rows(self, state: RunState, ev: Evaluation) -> None:
        """Run every ``--methods`` row not already evaluated (``runner.rows.run_row``)."""
        from .. import methods as method_registry
        from ..runner.rows import run_row

        for index, name in enumerate(state.cfg.methods):
            if name not in state.results:
                run_row(state, ev, method_registry.info(name), name, ev.ctx,
                        seed=self.row_seed(state.cfg, index, name))

    def row_seed(self, cfg: Config, index: int, row: str) -> int:
        """The generator seed of a row: by its name, not its place in --methods, so that a row
        is the same in any run."""
        return cfg.seed + zlib.crc32(row.encode()) % 100_000

    def evaluate(self, state: RunState, ev: Evaluation, info: method_registry.MethodInfo,
                 method: Method, row: str, ctx: Context, *, select: bool = False) -> None:
        """Fit ``method``'s post-hoc part, evaluate it on every set of ``ev`` as row ``row``
        (and its other `runner.evaluate.passes`), fill ``state.results`` / ``state.outputs``
        and write (``state.write()``)."""
        raise NotImplementedError

    def write_results(self, run_dir: Path, results: dict[str, dict[str, Any]],
                      outputs: dict[str, dict[str, Any]], *, n_bins: int,
                      extra: dict[str, Any]) -> None:
        """``metrics.json`` (with ``"task"``), ``results.md`` and the per-question outputs."""
        raise NotImplementedError

    def render_table(self, results: dict[str, dict[str, Any]]) -> str:
        """The results table printed at the end of the run (markdown)."""
        raise NotImplementedError
