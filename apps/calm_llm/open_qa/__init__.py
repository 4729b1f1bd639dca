"""``--task open_qa``: CALM and its baselines on free-form answers, scored by Semantic-ECE.

`run` is the runner (the stages of `apps.calm_llm.runner`, as the multiple-choice run), `score` turns
per-question records into confidences, metrics, tables and reliability diagrams.
"""
