"""Per-item estimates beside the results (train/eval/items.py): every row the harness writes with an
estimate comes back from items.parquet as the same estimate (its value and its interval recomputed
from the file equal the row's), and two runs' items difference item by item."""

from __future__ import annotations


import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from tests.test_eval_harness import FakeJob, _manifest, _samples_artifact
from train.eval import harness as H
from train.eval.interface import Row
from train.eval.intervals import auc_estimate, interval, macro, mean, paired_difference, proportion
from train.eval.items import ITEM_COLUMNS, items_table, read_items, write_items


def test_the_harness_writes_items_that_give_back_each_rows_value_and_interval(tmp_path):
    _samples_artifact(tmp_path)
    table = {(1, "t1"): 5, (1, "t2"): 4, (2, "t3"): 1, (2, "t4"): 2, (3, "t4"): 3, (3, "t5"): 3.5}
    m = _manifest(tmp_path, [("ret", "split_retrieval", "test")])
    out = tmp_path / "run" / "eval" / "final"
    rows, errors = H.run_harness(FakeJob(table, scorable={1, 2, 3}), torch.nn.Linear(1, 1), m, out, log=lambda s: None)
    assert errors == []
    t = pq.read_table(out / "items.parquet")
    assert tuple(t.column_names) == ITEM_COLUMNS
    assert pq.ParquetFile(out / "items.parquet").metadata.row_group(0).column(0).compression == "ZSTD"
    items = read_items(out / "items.parquet")
    with_est = [r for r in rows if r["benchmark"] == "ret"]
    assert len(with_est) == 6 and set(items) == {("ret", "score", r["metric"]) for r in with_est}
    assert ("fake-own", "all", "acc") not in items  # a job metric without per-item outcomes has no items
    for r in with_est:
        est = items[("ret", "score", r["metric"])]
        assert est.n == r["n"]
        assert 100 * est.value == pytest.approx(r["value"])
        lo, hi = interval(est, 100.0)
        assert (lo, hi) == pytest.approx((r["ci_low"], r["ci_high"]))
    # t2i's five captions are clustered by their image (three images), i2t's three images each their own
    assert sorted(set(items[("ret", "score", "t2i_R@1")].cluster)) == ["0", "1", "2"]

    # a second run on the same items: the difference item by item is the difference of the values
    table2 = {**table, (2, "t3"): 9}
    out2 = tmp_path / "run2" / "eval" / "final"
    rows2, _ = H.run_harness(FakeJob(table2, scorable={1, 2, 3}), torch.nn.Linear(1, 1), m, out2, log=lambda s: None)
    a, b = items[("ret", "score", "i2t_R@1")], read_items(out2 / "items.parquet")[("ret", "score", "i2t_R@1")]
    d, lo, hi = paired_difference(b, a, 100.0)
    v = {r["metric"]: r["value"] for r in rows2}["i2t_R@1"] - {r["metric"]: r["value"] for r in rows}["i2t_R@1"]
    assert d == pytest.approx(v) and v == pytest.approx(100 / 3)
    assert lo <= d <= hi


def test_every_kind_of_estimate_round_trips(tmp_path):
    rng = np.random.default_rng(0)
    n = 40
    img = rng.integers(0, 9, n)
    ests = {"p": proportion(rng.random(n) < 0.3, img), "m": mean(rng.random(n), img),
            "a": auc_estimate(rng.random(n), rng.random(n), img, rng.integers(0, 7, n)),
            "macro": macro([proportion(rng.random(10) < 0.5, np.arange(10) % 3), proportion(rng.random(5) < 0.5)])}
    rows = [Row("b", k, "x", 100 * e.value, e.n, None, est=e) for k, e in ests.items()]
    rows.append(Row("b", "none", "x", 1.0, 3, None))
    write_items(rows, tmp_path)
    back = read_items(tmp_path / "items.parquet")
    assert set(back) == {("b", k, "x") for k in ests}
    for k, e in ests.items():
        g = back[("b", k, "x")]
        assert g.value == pytest.approx(e.value) and g.binary == e.binary and g.n == e.n
        assert interval(g, 100.0) == pytest.approx(interval(e, 100.0))
        assert (g.neg is None) == (e.neg is None) and (g.cluster2 is None) == (e.cluster2 is None)
    assert items_table([Row("b", "s", "x", 1.0, 0, None)]).num_rows == 0


def test_an_unreadable_items_file_is_one_line_naming_it(tmp_path):
    from pipeline.io.run_files import CorruptRunFile

    p = tmp_path / "items.parquet"
    p.write_bytes(b"not parquet")
    with pytest.raises(CorruptRunFile) as e:
        read_items(p)
    msg = str(e.value)
    assert msg.startswith(f"{p}: cannot be read as per-item estimates") and "\n" not in msg
    assert "train eval <job> --manifest M --checkpoint RUN_DIR --out RUN_DIR/eval/final" in msg
