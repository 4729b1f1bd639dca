"""The stages of a run that both tasks share, each in its own module:

* `prepare`: claim the run directory, refuse a resume that would mix results, record
  ``config.json`` and ``splits.json``;
* `train`: train one row for ``--steps`` optimizer steps, with checkpoints and resume.

The multiple-choice run (`apps.calm_llm.train`) and the open-QA run (`apps.calm_llm.open_qa.run`)
call them and say only what differs: how data load, how a method is evaluated and reported.
"""
