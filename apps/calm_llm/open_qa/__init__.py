"""Open QA's own scoring: `score` turns per-question records into confidences, metrics, tables
and reliability diagrams; `judge` decides whether a free-form answer matches a gold alias. The
task that runs them is `apps.calm_llm.tasks.open_qa` (``--task open_qa``).
"""
