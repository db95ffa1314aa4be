"""benchmarks/testbed.py's verdicts from a run's and its control's results.parquet: a learnable row,
a word-order row that must stay at chance, and c3's concept-prior row (above chance in the control too)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]


def _testbed():
    spec = importlib.util.spec_from_file_location("testbed_table", REPO / "benchmarks" / "testbed.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(root: Path, name: str, rows: list[tuple]) -> Path:
    run = root / name
    (run / "eval" / "final").mkdir(parents=True)
    cols = ["benchmark", "subset", "metric", "value", "chance", "ci_low", "ci_high", "n"]
    pq.write_table(pa.Table.from_pylist([dict(zip(cols, r)) for r in rows]), run / "eval" / "final" / "results.parquet")
    return run


def test_verdicts_learn_prior_and_a_failing_control(tmp_path):
    tb = _testbed()
    run = _run(tmp_path, "run", [("c3_mcp", "type1", "auc", 0.59, 0.5, 0.58, 0.60, 1989),
                                 ("c3_mcp", "type2_as_trained", "auc", 0.82, 0.5, 0.80, 0.83, 2000)])
    ctl = _run(tmp_path, "ctl", [("c3_mcp", "type1", "auc", 0.50, 0.5, 0.499, 0.502, 1989),
                                 ("c3_mcp", "type2_as_trained", "auc", 0.79, 0.5, 0.77, 0.80, 2000)])
    got = {r["row"]: (r["verdict"], r["ok"]) for r in tb.job_rows("c3", run, ctl, False)}
    assert got == {"c3_mcp/type1/auc": ("learned, control at chance", True),
                   "c3_mcp/type2_as_trained/auc": ("prior: above chance, the control too", True)}
    # a control that learnt the learnable row fails it; a prior the control lacks fails the prior row
    bad = _run(tmp_path, "bad", [("c3_mcp", "type1", "auc", 0.56, 0.5, 0.55, 0.57, 1989),
                                 ("c3_mcp", "type2_as_trained", "auc", 0.50, 0.5, 0.49, 0.51, 2000)])
    got = {r["row"]: (r["verdict"], r["ok"]) for r in tb.job_rows("c3", run, bad, False)}
    assert got == {"c3_mcp/type1/auc": ("learned, CONTROL OFF CHANCE", False),
                   "c3_mcp/type2_as_trained/auc": ("PRIOR NOT ABOVE CHANCE", False)}
    # word order must stay at chance, in the run and the control
    wo = _run(tmp_path, "wo", [("vg-relation", "all", "macro_accuracy", 58.0, 50.0, 55.0, 61.0, 1147)])
    (row,) = tb.job_rows("concept-ot", wo, None, False)
    assert (row["verdict"], row["ok"]) == ("OFF CHANCE", False)


def test_wall_column_says_when_a_run_was_only_re_evaluated(tmp_path, capsys):
    """The wall column reads train.loop's own "nothing to train" line from a real rerun of a finished run,
    so the script cannot report a re-evaluation as a training time."""
    import torch

    from tests.test_loop_best import _cfg, _Toy
    from train.loop import train

    tb = _testbed()
    job = _Toy(_cfg(), None, tmp_path / "f", torch.device("cpu"))
    train(job, resume=False, progress=False)
    first = capsys.readouterr().err
    assert tb._wall(12.3, first) == "12"
    train(_Toy(_cfg(), None, tmp_path / "f", torch.device("cpu")), resume=True, progress=False)
    assert tb._wall(3.0, capsys.readouterr().err).startswith("3 (re-evaluated: trained before")
