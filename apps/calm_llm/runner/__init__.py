"""The stages of a run that both tasks share, each in its own module:

* `prepare`: claim the run directory, refuse a resume that would mix results, record
  ``config.json`` and ``splits.json``;
* `load`: the data (sources → seeded splits) and the model-side state (model, collators, the
  methods' `Context`, the evaluation sets);
* `train`: train one row for ``--steps`` optimizer steps, with checkpoints and resume;
* `evaluate`: fit and evaluate one row (option scoring for multiple choice, sampling for open
  QA), with and without α;
* `report`: the run's state, writing and restoring its results, a row's export and summary;
* `rows`: one row, train → evaluate → report.

The multiple-choice run (`apps.calm_llm.train`) and the open-QA run (`apps.calm_llm.open_qa.run`)
call them in that order and say only which task's loader, evaluator and writer they use.
"""
