"""docs/bilevel.md's example runs as written, and bilevel/ imports nothing but torch."""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_doc_example_runs(capsys):
    text = (ROOT / "docs" / "bilevel.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) == 1
    exec(compile(blocks[0], "docs/bilevel.md", "exec"), {"__name__": "__doc_example__"})
    out = capsys.readouterr().out
    names = ("BOME", "BOME value_gap", "ITD", "ITD truncated", "AID", "Unrolled truncated",
             "ITD Adam", "FD", "V-PBGD", "F2SA", "SOBA", "FiniteDifference")
    for name in names:
        assert f"{name}: validation loss" in out or f"{name} tensor" in out, name
    for solver in ("CG", "Neumann", "FixedPoint", "Dense"):
        assert f"Implicit {solver} tensor" in out, solver


def test_writing_your_own_linear_solver_example_runs(capsys):
    text = (ROOT / "docs" / "bilevel.md").read_text()
    section = text.split("## Writing your own linear solver", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```py\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 1, "the section lost its worked example"
    namespace = {"__name__": "__doc_linear_solver__"}
    exec(compile(blocks[0], "docs/bilevel.md#writing-your-own-linear-solver", "exec"), namespace)
    assert "richardson" in capsys.readouterr().out
    # the example's solver also passes through AID, warm-started, to the same hypergradient
    import bilevel

    aid = bilevel.AID(0, 0.1, linear_solver=namespace["richardson"], warm_start=True)
    for _ in range(2):
        r = aid.step(namespace["problem"], namespace["alpha"], {"w": namespace["w_star"]},
                     **namespace["args"])
        assert abs(float(r.outer_grad["a"]) - float(namespace["oracle"]["a"])) < 1e-10


def test_bilevel_imports_only_torch_and_the_standard_library():
    allowed_third_party = {"torch"}
    forbidden = {"calibration", "apps", "transformers", "numpy", "tqdm"}
    for path in (ROOT / "bilevel").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module.split(".")[0]]
            else:
                continue
            for name in names:
                # tqdm is allowed only as a lazy import inside a function (loop.py).
                if name == "tqdm" and path.name == "loop.py":
                    continue
                assert name not in forbidden, f"{path}: imports {name}"
                assert name in allowed_third_party or name in _stdlib(), f"{path}: imports {name}"


def _stdlib() -> set[str]:
    import sys

    return set(sys.stdlib_module_names) | {"__future__"}


def _section_block(title):
    text = (ROOT / "docs" / "bilevel.md").read_text()
    section = text.split(f"## {title}", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```py\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 1, f"the section {title!r} lost its worked example"
    return blocks[0]


def test_writing_your_own_solver_example_runs_through_fit(capsys):
    """The section's solver uses the public API only, matches ITD(1) from θ_T (asserted in the
    block) and trains through bilevel.fit: the validation loss goes down."""
    namespace = {"__name__": "__doc_solver__"}
    exec(compile(_section_block("Writing your own solver"), "docs/bilevel.md#own-solver", "exec"),
         namespace)
    history = namespace["history"]
    assert len(history) == 30 and history.last["upper_loss"] < history.records[0]["upper_loss"]
    assert "own solver" in capsys.readouterr().out
    block = _section_block("Writing your own solver")
    assert "bilevel._" not in block and "from bilevel." not in block  # public names only


def test_the_minibatch_example_runs_and_draws_one_batch_per_inner_step(capsys):
    namespace = {"__name__": "__doc_minibatch__"}
    exec(compile(_section_block("Minibatch inner loops: `lower_batches=`"),
                 "docs/bilevel.md#minibatch", "exec"), namespace)
    history = namespace["history"]
    assert history.last["upper_loss"] < history.records[0]["upper_loss"]
    assert "minibatch ITD" in capsys.readouterr().out


def test_the_resume_example_runs_and_equals_the_uninterrupted_run(capsys):
    """The block asserts the bit-for-bit equality itself; this checks it ran to the end."""
    namespace = {"__name__": "__doc_resume__"}
    exec(compile(_section_block("Long runs: solver state, `checkpoint=` and resume"),
                 "docs/bilevel.md#resume", "exec"), namespace)
    assert "resumed" in capsys.readouterr().out


def test_the_custom_root_example_matches_the_closed_form(capsys):
    """The block asserts custom_root's L-BFGS hypergradient equals the ridge closed form."""
    block = _section_block("Differentiating an inner solution computed elsewhere: `custom_root`")
    exec(compile(block, "docs/bilevel.md#custom-root", "exec"), {"__name__": "__doc_croot__"})
    assert "custom_root" in capsys.readouterr().out
    assert "bilevel._" not in block  # public names only


DISTRIBUTED = "Distributed (data-parallel) runs: `torchrun`, `bilevel.distributed`"


def test_the_distributed_example_runs_alone(capsys):
    """Without a process group the data-parallel script is the one-process run (it runs on
    two ranks in tests/bilevel/test_bilevel_distributed.py); its launch line is a bash block,
    never executed as Python."""
    namespace = {"__name__": "__doc_distributed__"}
    exec(compile(_section_block(DISTRIBUTED), "docs/bilevel.md#distributed", "exec"), namespace)
    assert "1 rank(s): validation loss" in capsys.readouterr().out
    section = (ROOT / "docs" / "bilevel.md").read_text().split(f"## {DISTRIBUTED}", 1)[1]
    assert "```bash\ntorchrun --nproc-per-node 2 examples/distributed_l2_hpo.py" in section


def test_the_modules_example_runs_and_leaves_batchnorm_untouched(capsys):
    """The block asserts ITD's fit lowers the validation loss with the BatchNorm buffers
    unchanged and eval mode using the stored statistics; MAML over tasks runs under vmap."""
    block = _section_block("Modules: `bilevel.functional(module)`")
    namespace = {"__name__": "__doc_modules__"}
    exec(compile(block, "docs/bilevel.md#modules", "exec"), namespace)
    assert "modules: MAML meta-gradient norm" in capsys.readouterr().out
    assert namespace["result"].info["outer_grad_norm"] > 0
    assert "bilevel._" not in block and "functional_call" not in block  # the helper only
