"""Each method family's own options (dataclasses: ``MethodInfo.options``) and the checks of
them: ``validate(cfg)`` raising `ConfigError`.

Torch-free (validation runs before anything heavy loads). `spec.MethodInfo.validate` points
here; `config.validate` runs every registered method's check on every configuration, so a bad
value is named even when its method is not in ``--methods`` (a preset stays valid as a whole).
An options dataclass's fields are the flags ``--<method>-<field>`` (or the field's ``flag``),
read as ``cfg.options_of(method)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...errors import ConfigError
from .. import solvers, task_table
from ..option import opt
from .upper import UPPER_LOSSES


def _check(ok: bool, msg: str) -> None:
    if not ok:
        raise ConfigError(msg)


@dataclass
class LabelSmoothingOptions:
    """``label_smoothing``'s own options (flags ``--label-smoothing``, ``--label-smoothing-scope``)."""

    epsilon: float = opt(0.1, "smoothing of the label_smoothing baseline", flag="--label-smoothing")
    scope: str = opt(
        "vocab",
        "label_smoothing spreads ε over the whole vocabulary (as Hugging Face's Trainer does) or "
        "(letter mode) over the question's option letters, which is what smooths the answer "
        "distribution",
        choices=("vocab", "options"),
    )


@dataclass
class RCFTOptions:
    """``rcft``'s own options (flags ``--rcft-<field>``)."""

    weight: float = opt(0.5, "RCFT: total = (1-w)·SFT + w·s·Σ_k L_k")
    scale: float = opt(
        1e-3, "RCFT: s, the regularizer's scale (1e-3 as released; with AdamW it leaves short "
        "runs indistinguishable from SFT)"
    )
    bins: int = opt(10, "RCFT: confidence bins of the ECE regularizer")
    reestimate_every: int = opt(
        0, "RCFT: re-run the E-step (bin accuracies) every k steps (0 = once, as released)"
    )
    include_top_bin: bool = opt(
        True, "RCFT: regularize the top bin [0.9, 1] too (the released code skips it)"
    )


def _not_negative(options: Any, method: str, names: tuple[str, ...]) -> None:
    """What the shared options get from `config`'s check of every value: >= 0 (an entry's own
    options are sign-free there, so a method says which of its own may not be negative)."""
    for name in names:
        value = getattr(options, name)
        flag = f"--{method}-{name}".replace("_", "-")
        _check(value >= 0, f"{flag}: must be >= 0, got {value}")


def validate_label_smoothing(cfg: Any) -> None:
    """``--label-smoothing`` ε in [0, 1); ``--label-smoothing-scope options`` smooths over
    option letters, so it needs letter-scored MCQA training data."""
    o, d = cfg.options_of("label_smoothing"), cfg.data
    _check(o.epsilon >= 0, f"--label-smoothing: must be >= 0, got {o.epsilon}")
    _check(o.epsilon < 1, "--label-smoothing: must be < 1")
    if o.scope == "options":
        _check(d.mode == "letter" and not d.instruction_data,
               "--label-smoothing-scope options needs --mode letter and MCQA training data")


def validate_rcft(cfg: Any) -> None:
    """The RCFT weight, scale and bins; its regularizer reads option probabilities, so it
    cannot train on instruction data."""
    o = cfg.options_of("rcft")
    _not_negative(o, "rcft", ("weight", "scale", "bins", "reestimate_every"))
    _check(o.weight <= 1, "--rcft-weight: must be in [0, 1]")
    _check(o.scale >= 0, "--rcft-scale: must be >= 0")
    _check(o.bins >= 2, "--rcft-bins: must be at least 2")
    if cfg.data.instruction_data and "rcft" in cfg.methods:
        # in any mode: instruction examples have no options, so no option probabilities
        raise ConfigError("--methods rcft needs MCQA training data (its regularizer uses option "
                          "probabilities); drop rcft or --instruction-data")


def validate_calm(cfg: Any) -> None:
    """The ``calm.*`` options: step sizes and where α acts against what the upper objective
    reads (each solver's own options: its ``SolverInfo.validate``)."""
    c, d = cfg.calm, cfg.data
    _check(c.alpha_lr > 0, f"--alpha-lr: must be positive, got {c.alpha_lr}")
    _check(c.inner_lr > 0, f"--inner-lr: must be positive, got {c.inner_lr}")
    _check(c.inner_steps >= 1, "--inner-steps: must be at least 1")
    if c.alpha_support == "options":
        _check(
            d.mode == "letter",
            "--alpha-support options needs --mode letter (in cloze mode the answer is scored over "
            "the vocabulary: --alpha-support answer_tokens or vocab)",
        )
    _check(c.alpha_tau_max > 1, f"--alpha-tau-max: must be > 1, got {c.alpha_tau_max}")
    _check(c.bome_lr > 0, f"--bome-lr: must be positive, got {c.bome_lr}")
    _validate_calm_objective(cfg)


def _validate_calm_objective(cfg: Any) -> None:
    """What the upper objective reads must be what α acts on and what the scoring mode gives;
    the second-order solvers need an attention kernel with a double backward."""
    c = cfg.calm
    task = task_table.info(cfg.task)
    if not task.has_options:
        # free-form answers have no options: α and the upper loss act on the answer tokens
        _check(c.alpha_acts != "options" and c.alpha_support != "options",
               f"--task {task.name}: answers have no options; use --alpha-acts lower_and_inference "
               "or upper_and_inference and --alpha-support vocab or answer_tokens")
        _check(c.upper_objective == "answer_tokens",
               f"--task {task.name}: the upper loss reads the answer tokens; use --upper-objective "
               "answer_tokens")
    elif c.alpha_acts == "options":
        _check(c.upper_objective == "options",
               "--alpha-acts options puts α on the option scores; it needs --upper-objective "
               "options (answer_tokens reads the vocabulary logits)")
    loss = UPPER_LOSSES.get(c.upper_loss)  # a known name: `_check_fields` ran first
    _check(c.upper_objective in loss.acts_on,
           f"--upper-loss {loss.name} acts on {' and '.join(loss.acts_on)} only; it cannot be "
           f"computed on --upper-objective {c.upper_objective}: use --upper-objective "
           f"{loss.acts_on[0]}, or an upper loss that acts on {c.upper_objective} (those: "
           f"{[n for n, i in UPPER_LOSSES.items() if c.upper_objective in i.acts_on]})")
    if c.upper_objective == "answer_tokens" and task.has_options:
        _check(cfg.data.mode == "cloze", "--upper-objective answer_tokens needs --mode cloze")
    if solvers.is_second_order(c.solver):
        _check(
            cfg.model.attn_implementation != "sdpa",
            f"--solver {c.solver} differentiates twice; --attn-implementation sdpa has no double "
            "backward (use auto or eager)",
        )
