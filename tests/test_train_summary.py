"""`train run` ends with a short aligned table (job, run folder, steps, final loss, headline
metrics beside chance); `--json` keeps the one JSON line."""

from __future__ import annotations

import json

import pytest

from tests.test_faults_train import _cli_run, _Toy

pytestmark = pytest.mark.usefixtures("one_thread")


def test_summary_table_shows_headline_metrics_with_chance(tmp_path):
    from train.summary import summary_table

    run = tmp_path / "run"
    run.mkdir()
    rows = [{"kind": "train", "step": s, "loss": 1.0 / s} for s in (1, 2, 4)] + [{"kind": "eval", "step": 4}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = {"global/i2t_R@1": 40.00000059604645, "chance/i2t_R@1": 3.125, "sugarcrepe/triples": 104.0,
           "sugarcrepe/overall": 47.4, "chance/sugarcrepe": 50.0, "eval_images": 64,
           **{f"extra/m{k}": 0.5 for k in range(30)}}
    text = summary_table("concept-ot", run, res)
    lines = text.splitlines()
    assert lines[0].split() == ["job", "steps", "final", "loss"]
    assert lines[1].split() == ["concept-ot", "4", "0.25"] and lines[2] == f"run folder: {run}"
    table = {ln.split()[0]: ln.split()[1:] for ln in lines[4:-2]}
    assert table["metric"] == ["value", "chance"]
    assert table["global/i2t_R@1"] == ["40", "3.12"] and table["sugarcrepe/overall"] == ["47.4", "50"]
    # only the metrics with a chance level, overall figures first (a size such as triples is no metric)
    assert list(table) == ["metric", "sugarcrepe/overall", "global/i2t_R@1"]
    assert "30 more metrics" in lines[-2] and lines[-1].strip() == str(run / "eval" / "final" / "metrics.json")
    # columns line up: every value ends in the same column as its header
    head, first = lines[4], lines[6]
    assert head.index("value") + len("value") == first.index("40") + len("40")
    assert len(text) < 1000


def test_train_run_prints_a_table_and_json_on_request(tmp_path, monkeypatch):
    import train.loop

    monkeypatch.setattr(train.loop, "plot_metrics", lambda *a, **k: None)
    r = _cli_run(monkeypatch, _Toy(tmp_path / "run"))
    assert r.exit_code == 0, r.output
    out = r.stdout.strip().splitlines()
    assert out[0].split()[:2] == ["job", "steps"] and out[1].split()[:2] == ["toy", "8"]
    assert out[2] == f"run folder: {tmp_path / 'run'}"
    assert not any(ln.startswith("{") for ln in out)
    r = _cli_run(monkeypatch, _Toy(tmp_path / "run2"), "--json")
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["job"] == "toy" and res["run_dir"] == str(tmp_path / "run2")


def test_runs_table_lists_trained_and_failed_jobs(tmp_path):
    from train.summary import runs_table

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"kind": "train", "step": 20, "loss": 0.5}) + "\n")
    text = runs_table([("concept-ot", run, {"sugarcrepe/overall": 47.4, "chance/sugarcrepe": 50.0}, 41.6),
                       ("concept-ot", run, {"sugarcrepe/overall": 47.4})], ["c3"])
    lines = text.splitlines()
    assert lines[0].split()[:2] == ["job", "headline"] and "wall" in lines[0].split()
    # no results.parquet: the evaluate() metric beside its chance, no interval, no verdict
    assert lines[1].split() == ["concept-ot", "sugarcrepe/overall", "47.4", "—", "50", "(chance)", "—", "—", "—", "42s"]
    assert lines[2].split()[-1] == "-"  # no wall time given
    assert lines[3].split()[0] == "c3" and "did not train" in lines[3]
    assert lines[4] == "run folders:" and lines[5].split() == ["concept-ot:", str(run)]


def test_train_run_all_goes_on_past_jobs_that_cannot_train(tmp_path):
    """Every job is tried; one whose artifacts are missing is one line, the others go on; the report
    is rebuilt; exit 2 because some did not train."""
    import subprocess
    import sys

    man = tmp_path / "m.yaml"
    man.write_text(f"name: t\noutput: {tmp_path / 'out'}\ndataset: {{kind: synthetic}}\n")
    (tmp_path / "out").mkdir()
    r = subprocess.run([sys.executable, "-m", "train.cli", "run", "all", "-m", str(man), "--max-steps", "2"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 2, r.stderr[-2000:]
    from train.registry import feature_jobs, registry

    for name in feature_jobs():
        assert f"== train run {name}" in r.stderr
    assert "== train run clip-encoder" not in r.stderr and len(feature_jobs()) < len(registry())
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == len(feature_jobs()) and all("pipeline run" in ln or "missing" in ln for ln in errors), errors
    assert "did not train" in r.stdout and (tmp_path / "out" / "report" / "index.html").is_file()


def test_runs_table_takes_chance_from_results_parquet(tmp_path):
    """A job's own metric (infoground's val_r1) has no chance in metrics.json; its results.parquet row does."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from train.summary import runs_table

    run = tmp_path / "run"
    (run / "eval" / "final").mkdir(parents=True)
    (run / "metrics.jsonl").write_text(json.dumps({"kind": "train", "step": 20, "loss": 0.5}) + "\n")
    pq.write_table(pa.table({"benchmark": ["infoground"], "subset": [""], "metric": ["val_r1"], "value": [31.0],
                             "chance": [4.0], "ci_low": [20.0], "ci_high": [40.0], "n": [64]}),
                   run / "eval" / "final" / "results.parquet")
    text = runs_table([("infoground", run, {"val_r1": 31.0})], [])
    row = text.splitlines()[1].split()
    assert row == ["infoground", "infoground/val_r1", "31", "[20,", "40]", "4", "(chance)", "64", "above", "—", "-"], text


def test_runs_table_judges_the_headline_by_its_paired_difference_from_the_strongest_baseline(tmp_path):
    """A result above chance whose paired difference from the baseline reported beside it lies below 0 is
    'below', printed with that difference and its interval; without a paired interval (results written
    before the paired columns) it gets no verdict; a row on fewer than 10 items gets none; baseline rows
    never headline."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from train.summary import runs_table, summary_table

    run = tmp_path / "run"
    (run / "eval" / "final").mkdir(parents=True)
    (run / "metrics.jsonl").write_text(json.dumps({"kind": "train", "step": 20, "loss": 0.5}) + "\n")
    cols = ["benchmark", "subset", "metric", "value", "chance", "ci_low", "ci_high", "n", "baseline_for", "diff_vs",
            "diff", "diff_low", "diff_high"]
    nan = float("nan")
    rows = [("c3_mcp", "type2_random", "auc_global_cosine", 0.641, 0.5, 0.62, 0.66, 900, "type2_random/auc", "",
             nan, nan, nan),
            ("c3_mcp", "type2_random", "auc", 0.593, 0.5, 0.57, 0.61, 900, "", "auc_global_cosine", -0.048, -0.07, -0.03),
            ("c3_mcp", "type1", "auc", 0.9, 0.5, 0.6, 1.0, 8, "", "", nan, nan, nan)]
    pq.write_table(pa.Table.from_pylist([dict(zip(cols, r)) for r in rows]), run / "eval" / "final" / "results.parquet")
    row = runs_table([("c3", run, {})], []).splitlines()[1]
    assert "c3_mcp/type2_random/auc " in row and "0.641 (auc_global_cosine)" in row
    assert row.split()[-5:] == ["below", "-0.048", "[-0.07,", "-0.03]", "-"], row
    text = summary_table("c3", run, {})
    assert "too few items" in text and "c3_mcp/type1/auc" in text
    assert not any(ln.startswith("c3_mcp/type2_random/auc_global_cosine") for ln in text.splitlines())
    # the same rows without the paired columns (an older results.parquet): a baseline, no paired interval
    old = [dict(zip(cols[:9], r[:9])) for r in rows]
    pq.write_table(pa.Table.from_pylist(old), run / "eval" / "final" / "results.parquet")
    row = runs_table([("c3", run, {})], []).splitlines()[1]
    assert row.split()[-3:] == ["—", "—", "-"], row


def test_runs_table_reads_a_metric_chance_suffix(tmp_path):
    """infoground's metrics.json names a chance ``<metric>_chance`` (val_r1 -> val_r1_chance)."""
    from train.summary import runs_table

    run = tmp_path / "run"
    (run / "eval" / "final").mkdir(parents=True)
    (run / "metrics.jsonl").write_text(json.dumps({"kind": "train", "step": 20, "loss": 0.5}) + "\n")
    res = {"val_r1": 39.3, "val_r1_chance": 37.5, "val_phrases": 112}
    row = runs_table([("infoground", run, res)], []).splitlines()[1].split()
    assert row[:6] == ["infoground", "val_r1", "39.3", "—", "37.5", "(chance)"], row


def test_runs_table_fits_120_columns_with_long_names(tmp_path):
    """The closing table stays within 120 columns with the demo's longest labels (a benchmark named after
    the output folder, a long baseline name, a long verdict); each run folder is printed whole below it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from train.summary import CLOSING_WIDTH, runs_table

    run = tmp_path / "train" / "infoground" / ("contextual-epochs3-lr0.003-test_splits_val+test-" + "x" * 30 + "-958a0f")
    (run / "eval" / "final").mkdir(parents=True)
    (run / "metrics.jsonl").write_text(json.dumps({"kind": "train", "step": 1230, "loss": 0.00568}) + "\n")
    cols = ["benchmark", "subset", "metric", "value", "chance", "ci_low", "ci_high", "n", "baseline_for", "diff_vs",
            "diff", "diff_low", "diff_high"]
    nan = float("nan")
    rows = [("grounding:a-long-output-folder-name", "val+test", "pointing accuracy", 82.4, 51.0, 79.5, 85.0, 1491, "",
             "pointing accuracy[prior of the nouns alone]", -5.6, -8.25, 1.125),
            ("grounding:a-long-output-folder-name", "val+test", "pointing accuracy[prior of the nouns alone]", 88.0, 51.0,
             86.0, 90.0, 1491, "val+test/pointing accuracy", "", nan, nan, nan)]
    pq.write_table(pa.Table.from_pylist([dict(zip(cols, r)) for r in rows]), run / "eval" / "final" / "results.parquet")
    text = runs_table([("relation-head", run, {}, 1234.5), ("visual-tokens", run, {}, 3.0)], ["text-groups"])
    lines = text.splitlines()
    assert all(len(ln) <= CLOSING_WIDTH for ln in lines[:4]), "\n".join(f"{len(ln)}: {ln}" for ln in lines)
    assert f"  relation-head: {run}" in lines and "not resolved  -5.6 [-8.25, +1.12]" in lines[1], text
