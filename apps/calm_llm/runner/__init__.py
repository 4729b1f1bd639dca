"""The stages of a run, for any task, each in its own module:

* `prepare`: claim the run directory, refuse a resume that would mix results, record
  ``config.json`` and ``splits.json``;
* `load`: the model and the model-side state every row is run against (`Evaluation`: the
  methods' `Context`, the evaluation sets, the LoRA initialization);
* `train`: train one row for ``--steps`` optimizer steps, with checkpoints and resume;
* `evaluate`: the passes a row is evaluated in (with and without α);
* `report`: the run's state, when its results are written, which rows a resume keeps, a row's
  export and summary, the final table;
* `rows`: one row, train → evaluate → report;
* `run`: the whole run, the stages in order.

What differs between tasks (the data, how a row is evaluated and scored, the files and the
table) is the `apps.calm_llm.tasks.base.Task` that `run` is given; no stage names a task.
"""
