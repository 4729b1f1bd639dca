"""Each example runs with --quick, writes its JSON, Markdown table and PNG, and shows the
property it exists to show (on the quick sizes, fixed seeds)."""

import json

import pytest
import torch

pytest.importorskip("sklearn")
pytest.importorskip("matplotlib")

from examples import few_shot_sinusoid, hyper_cleaning, l2_hpo  # noqa: E402


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def outputs(module, tmp_path):
    paths = module.main(["--quick", "--out", str(tmp_path)])
    record = json.loads(paths["json"].read_text())
    table = paths["md"].read_text()
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for name in record["curves"]:
        assert f"| {name} |" in table, name
    final = {name: curve[-1] for name, curve in record["curves"].items()}
    for curve in record["curves"].values():
        times = [p["time_s"] for p in curve]
        assert times[0] >= 0.0 and times == sorted(times)
    return record, final


@pytest.mark.slow
def test_hyper_cleaning_beats_training_on_the_corrupted_labels(tmp_path):
    record, final = outputs(hyper_cleaning, tmp_path)
    assert set(record["curves"]) == {
        f"{m}/{s}" for m in ("linear", "mlp") for s in hyper_cleaning.SOLVERS
    }
    base = final["linear/unweighted"]
    assert base["f1"] == 0.0  # α frozen at 0: every weight is 0.5, nothing flagged
    for solver in ("BOME", "ITD", "AID"):
        run = final[f"linear/{solver}"]
        assert run["val_acc"] > base["val_acc"] + 0.05, (solver, run, base)
    for solver in ("ITD", "AID"):
        # flagging every example would score F1 = 2/3 at 50% corruption
        assert final[f"linear/{solver}"]["f1"] > 0.75, (solver, final[f"linear/{solver}"])


@pytest.mark.slow
def test_l2_hpo_lowers_the_validation_loss_below_a_fixed_regularization(tmp_path):
    record, final = outputs(l2_hpo, tmp_path)
    base = final["no HPO (α = 0)"]
    for solver in ("BOME", "ITD", "AID"):
        assert final[solver]["val_loss"] < base["val_loss"], (solver, final[solver], base)
    # the reference leaves α at 0; the solvers moved it
    assert base["mean_log_reg"] == 0.0
    assert all(abs(final[s]["mean_log_reg"]) > 1e-3 for s in ("BOME", "ITD", "AID"))


@pytest.mark.slow
def test_few_shot_meta_learning_improves_on_the_initialization(tmp_path):
    record, final = outputs(few_shot_sinusoid, tmp_path)
    assert set(record["curves"]) == set(few_shot_sinusoid.LEARNERS)
    for name in ("MAML", "FOMAML", "iMAML"):
        curve = record["curves"][name]
        assert curve[-1]["test_mse"] < curve[0]["test_mse"], (name, curve[0], curve[-1])


def test_a_diverging_solver_is_reported_not_a_crash(tmp_path, monkeypatch):
    """An inner step far above 2/L makes ITD's iterates overflow: the example records where
    and goes on; the table says so."""
    import bilevel
    from examples._common import Setup

    monkeypatch.setattr(l2_hpo, "SOLVERS", {"ITD lr=1e4": Setup(bilevel.ITD(20, 1e4), 0.05)})
    record, final = outputs(l2_hpo, tmp_path)
    assert "non-finite" in final["ITD lr=1e4"]["diverged"]
    assert "diverged after" in (tmp_path / "l2_hpo.md").read_text()


def test_only_selects_solvers_and_names_the_known_ones(tmp_path):
    paths = l2_hpo.main(["--quick", "--out", str(tmp_path), "--only", "AID"])
    assert list(json.loads(paths["json"].read_text())["curves"]) == ["AID"]
    with pytest.raises(SystemExit, match=r"unknown solver\(s\) \['XYZ'\]; known: \['BOME'"):
        l2_hpo.main(["--quick", "--out", str(tmp_path), "--only", "XYZ"])
