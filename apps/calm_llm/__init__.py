"""CALM: bilevel calibration of an LLM with its baselines and ablations (`python -m apps.calm_llm`).

See docs/calm.md. Entry points: `config.parse_args`, `train.run`, `export.AlphaLogitsProcessor`.
"""
