"""``--task open_qa``: CALM and its baselines on free-form answers, scored by Semantic-ECE.

`run` is the runner (stages as in the multiple-choice `apps.calm_llm.train`), `score` turns
per-question records into confidences, metrics, tables and reliability diagrams.
"""
