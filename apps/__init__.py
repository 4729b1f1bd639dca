"""Applications that assemble bilevel and calibration with transformers/peft/datasets."""

__version__ = "0.1.0"
