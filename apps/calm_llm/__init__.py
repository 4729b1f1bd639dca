"""CALM: bilevel calibration of an LLM with its baselines and ablations (`python -m apps.calm_llm`).

See docs/calm.md. Entry points: `config.parse_args`, `train.run`, `calibrated.load_export` (an export with
its α or T), `export.AlphaLogitsProcessor`, `lm_eval_model.CalmLM` (lm-eval's `calm`).
"""
