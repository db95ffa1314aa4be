"""benchmarks/testbed.py's verdicts from a run's and its control's results.parquet: a learnable row (the paired
verdict: above chance and, on the same images, above the strongest no-learning baseline), a word-order row that
must stay at chance, c3's concept-prior row (above chance in the control too), the controls' exact test with
Holm over the table, and the failures: a missing row, a benchmark that could not be scored, too few items."""

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


def _run(root: Path, name: str, rows: list[tuple], errors: list[str] | None = None) -> Path:
    run = root / name
    (run / "eval" / "final").mkdir(parents=True)
    cols = ["benchmark", "subset", "metric", "value", "chance", "ci_low", "ci_high", "n", "baseline_for", "diff_vs",
            "diff", "diff_low", "diff_high"]
    nan = float("nan")
    full = [(*r, "") if len(r) == 8 else r for r in rows]
    full = [(*r, "", nan, nan, nan) if len(r) == 9 else r for r in full]
    pq.write_table(pa.Table.from_pylist([{**dict(zip(cols, r)), "unit": "fraction" if r[0] == "c3_mcp" else "%"}
                                         for r in full]), run / "eval" / "final" / "results.parquet")
    if errors:
        import json

        (run / "eval" / "final" / "errors.json").write_text(json.dumps(errors))
    return run


C3_OTHER = [("c3_mcp", t, "auc", 0.60, 0.5, 0.58, 0.62, 1500) for t in ("type2_random", "type2_hard", "type2_binding")]
C3_CTL = [("c3_mcp", t, "auc", 0.50, 0.5, 0.49, 0.51, 1500) for t in ("type2_random", "type2_hard", "type2_binding")]


def test_verdicts_learn_prior_and_a_failing_control(tmp_path):
    tb = _testbed()
    run = _run(tmp_path, "run", [("c3_mcp", "type1", "auc", 0.59, 0.5, 0.58, 0.60, 1989),
                                 ("c3_mcp", "type2_as_trained", "auc", 0.82, 0.5, 0.80, 0.83, 2000), *C3_OTHER])
    ctl = _run(tmp_path, "ctl", [("c3_mcp", "type1", "auc", 0.50, 0.5, 0.499, 0.502, 1989),
                                 ("c3_mcp", "type2_as_trained", "auc", 0.79, 0.5, 0.77, 0.80, 2000), *C3_CTL])
    got = {r["row"]: (r["verdict"], r["ok"]) for r in tb.job_rows("c3", run, ctl, False)}
    assert got["c3_mcp/type1/auc"] == ("learned, control not above chance (one-sided p 0.5, Holm)", True)
    assert got["c3_mcp/type2_as_trained/auc"] == ("prior: above chance, the control too", True)
    assert len(got) == 5 and all(ok for _, ok in got.values())
    # a control that learnt the learnable row fails it; a prior the control lacks fails the prior row
    bad = _run(tmp_path, "bad", [("c3_mcp", "type1", "auc", 0.56, 0.5, 0.55, 0.57, 1989),
                                 ("c3_mcp", "type2_as_trained", "auc", 0.50, 0.5, 0.49, 0.51, 2000), *C3_CTL])
    got = {r["row"]: (r["verdict"], r["ok"]) for r in tb.job_rows("c3", run, bad, False)}
    assert got["c3_mcp/type1/auc"] == ("learned, CONTROL ABOVE chance (one-sided p 8.4e-32, Holm)", False)
    assert got["c3_mcp/type2_as_trained/auc"] == ("PRIOR NOT ABOVE CHANCE", False)
    # word order must stay at chance, in the run and the control
    wo = _run(tmp_path, "wo", [("vg-relation", "all", "macro_accuracy", 58.0, 50.0, 55.0, 61.0, 1147)])
    got = {r["row"]: (r["verdict"], r["ok"]) for r in tb.job_rows("concept-ot", wo, None, False)}
    assert got["vg-relation/all/macro_accuracy"] == ("OFF CHANCE", False)


def test_learned_means_above_the_strongest_baseline_on_the_same_images(tmp_path):
    """c3's frozen global-cosine AUC is reported beside each MCP AUC: a trained AUC is 'learned' only when its
    paired difference from that frozen score lies above 0 (issue 47: type2_random 0.593 vs 0.641 is below it;
    a difference inside its own noise is not resolved; without a paired interval there is no verdict)."""
    tb = _testbed()
    rows = [("c3_mcp", "type1", "auc", 0.70, 0.5, 0.66, 0.74, 900, "", "auc_global_cosine", 0.10, 0.06, 0.14),
            ("c3_mcp", "type1", "auc_global_cosine", 0.60, 0.5, 0.57, 0.63, 900, "type1/auc"),
            ("c3_mcp", "type2_random", "auc", 0.593, 0.5, 0.57, 0.61, 900, "", "auc_global_cosine", -0.048, -0.07, -0.03),
            ("c3_mcp", "type2_random", "auc_global_cosine", 0.641, 0.5, 0.62, 0.66, 900, "type2_random/auc"),
            *C3_OTHER[1:], ("c3_mcp", "type2_as_trained", "auc", 0.82, 0.5, 0.80, 0.83, 2000)]
    out = tb.job_rows("c3", _run(tmp_path, "r", rows), None, False)
    got = {r["row"]: (r["verdict"], r["ok"]) for r in out}
    assert got["c3_mcp/type1/auc"] == ("learned", True)
    # type2_random is expected above chance only on the oracle testbed (benchmarks/expectations/testbed.yaml):
    # not called learned; the table says where it stands against the frozen score (its paired verdict)
    v, ok = got["c3_mcp/type2_random/auc"]
    assert ok and v.startswith("above chance (below vs auc_global_cosine: on the oracle testbed not reliably"), v
    shown = {r["row"]: (r["diff_vs"], r["diff"]) for r in out}
    assert shown["c3_mcp/type1/auc"] == ("auc_global_cosine", "+0.1 [+0.06, +0.14]")
    # the learnable row (type1) judged on its paired difference: below it, inside its noise, no paired interval
    for i, (diff, want) in enumerate((((-0.048, -0.07, -0.03), "BELOW BASELINE auc_global_cosine"),
                                      ((0.0007, -0.001, 0.0024), "NOT LEARNED (not resolved)"),  # "learnt by 0.0007"
                                      ((0.1, float("nan"), float("nan")), "NO PAIRED INTERVAL vs auc_global_cosine"))):
        rows[0] = ("c3_mcp", "type1", "auc", 0.70, 0.5, 0.66, 0.74, 900, "", "auc_global_cosine", *diff)
        got = {r["row"]: (r["verdict"], r["ok"]) for r in tb.job_rows("c3", _run(tmp_path, f"r{i}", rows), None, False)}
        assert got["c3_mcp/type1/auc"] == (want, False)


def _boxes_only(k: int, value: float, lo: float, hi: float, n: int = 280) -> tuple:
    return ("relation-head", "held_out", f"recall@{k}[boxes-only]", value, 10.0, lo, hi, n, f"held_out/recall@{k}")


def test_missing_rows_failed_benchmarks_and_too_few_items_fail(tmp_path):
    tb = _testbed()
    # relation-head expects recall@1, @3 and @5 at its boxes-only baseline: @5 is absent; @3 was scored on 12 items
    run = _run(tmp_path, "r", [("relation-head", "held_out", "recall@1", 60.0, 10.0, 50.0, 70.0, 280, "",
                                "recall@1[boxes-only]", -2.0, -6.0, 2.0),
                               _boxes_only(1, 62.0, 52.0, 72.0),
                               ("relation-head", "held_out", "recall@3", 80.0, 30.0, 60.0, 95.0, 12)],
               errors=["sugarcrepe: 0 of 40 items scorable"])
    out = tb.job_rows("relation-head", run, None, False)
    got = {r["row"]: (r["verdict"], r["ok"]) for r in out}
    assert got["relation-head/held_out/recall@1"] == ("at base (recall@1[boxes-only])", True)
    assert got["relation-head/held_out/recall@3"] == ("TOO FEW ITEMS (n 12 < 30)", False)
    assert got["relation-head/held_out/recall@5 (expected row absent)"] == ("MISSING", False)
    assert got["benchmark not scored: sugarcrepe: 0 of 40 items scorable"] == ("BENCHMARK FAILED", False)


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


def test_a_job_without_an_image_text_scorer_is_not_a_failed_benchmark(tmp_path):
    """relation-head has no score_pairs: the harness notes it in errors.json; that is no failure."""
    tb = _testbed()
    run = _run(tmp_path, "r", [("relation-head", "held_out", f"recall@{k}", 60.0, 10.0, 50.0, 70.0, 280, "",
                                f"recall@{k}[boxes-only]", 0.0, -4.0, 4.0) for k in (1, 3, 5)]
               + [_boxes_only(k, 60.0, 50.0, 70.0) for k in (1, 3, 5)],
               errors=["RelationHeadJob does not implement the scoring interface: benchmarks sugarcrepe not scored"])
    assert all(r["ok"] for r in tb.job_rows("relation-head", run, None, False))


def test_a_control_is_tested_against_the_frozen_term_only_where_the_job_declares_one(tmp_path):
    """A control learns nothing, so it sits at what needs no learning: chance, or, for a job whose score includes a
    frozen term (concept-ot's g, SCORE_INCLUDES_FROZEN), that term. c3 declares none: a control above chance but at
    its frozen score fails (issue 47: its type-1 control passed with a lower bound above 0.5)."""
    tb = _testbed()
    rows = [("c3_mcp", "type1", "auc", 0.70, 0.5, 0.66, 0.74, 900, "", "auc_global_cosine", 0.10, 0.06, 0.14),
            ("c3_mcp", "type1", "auc_global_cosine", 0.60, 0.5, 0.57, 0.63, 900, "type1/auc"),
            *C3_OTHER, ("c3_mcp", "type2_as_trained", "auc", 0.82, 0.5, 0.80, 0.83, 2000)]
    run = _run(tmp_path, "r", rows)
    at_frozen = _run(tmp_path, "c1", [("c3_mcp", "type1", "auc", 0.58, 0.5, 0.55, 0.61, 900, "", "auc_global_cosine",
                                       -0.02, -0.05, 0.01), *C3_CTL,
                                      ("c3_mcp", "type2_as_trained", "auc", 0.8, 0.5, 0.78, 0.82, 2000)])
    got = {r["row"]: (r["verdict"], r["ok"]) for r in tb.job_rows("c3", run, at_frozen, False)}
    assert got["c3_mcp/type1/auc"] == ("learned, CONTROL ABOVE chance (one-sided p 1.5e-07, Holm)", False)
    # concept-ot: its control keeps g; tested on its paired difference from g
    co = [("sugarcrepe", "swap_att", "accuracy", 70.0, 50.0, 66.0, 74.0, 600, "", "accuracy[frozen]", 8.0, 4.0, 12.0),
          ("sugarcrepe", "swap_att", "accuracy[frozen]", 62.0, 50.0, 58.0, 66.0, 600, "swap_att/accuracy")]
    ctl = [("sugarcrepe", "swap_att", "accuracy", 62.5, 50.0, 58.5, 66.5, 600, "", "accuracy[frozen]", 0.5, -1.5, 2.5)]
    got = {r["row"]: (r["verdict"], r["ok"]) for r in tb.job_rows("concept-ot", _run(tmp_path, "co", co),
                                                                    _run(tmp_path, "coc", ctl), False)}
    assert got["sugarcrepe/swap_att/accuracy"] == (
        "learned, control not above accuracy[frozen] (one-sided p 0.31, Holm)", True)
    up = [(*ctl[0][:10], 4.0, 2.0, 6.0)]
    got = {r["row"]: (r["verdict"], r["ok"]) for r in tb.job_rows("concept-ot", _run(tmp_path, "co2", co),
                                                                    _run(tmp_path, "coc2", up), False)}
    assert got["sugarcrepe/swap_att/accuracy"][0].startswith("learned, CONTROL ABOVE accuracy[frozen] (one-sided p ")


def test_holm_runs_over_the_whole_tables_control_rows(tmp_path):
    """Two controls each a little above chance (one-sided p 0.015): each alone is called above (p < 0.025); in one
    table together Holm calls neither (the smaller is held against 0.025 / 2)."""
    tb = _testbed()
    run = _run(tmp_path, "r", [("relation-head", "held_out", f"recall@{k}", 60.0, 10.0, 50.0, 70.0, 280, "",
                                f"recall@{k}[boxes-only]", 0.0, -4.0, 4.0) for k in (1, 3, 5)]
               + [_boxes_only(k, 60.0, 50.0, 70.0) for k in (1, 3, 5)])
    ctl = _run(tmp_path, "c", [("relation-head", "held_out", "recall@1", 12.9, 10.0, 10.4, 15.9, 280),
                               ("relation-head", "held_out", "recall@3", 30.0, 30.0, 25.0, 35.0, 280),
                               ("relation-head", "held_out", "recall@5", 50.0, 50.0, 45.0, 55.0, 280)])
    r1 = next(r for r in tb.job_rows("relation-head", run, ctl, False) if r["row"].endswith("recall@1"))
    assert 0.0125 < r1["ctest"].p < 0.025
    alone = tb.settle_controls([r1])[0]
    assert not alone["ok"] and "CONTROL ABOVE chance (one-sided p 0.015, Holm)" in alone["verdict"]
    r1b = next(r for r in tb.job_rows("relation-head", run, ctl, False) if r["row"].endswith("recall@1"))
    both = tb.settle_controls([r1, r1b])
    assert all(r["ok"] for r in both) and both[0]["verdict"] == "at base (recall@1[boxes-only]), control not above " \
        "chance (one-sided p 0.015, Holm)", [r["verdict"] for r in both]


def test_at_base_expectation_against_the_boxes_only_baseline(tmp_path):
    """relation-head is expected at its boxes-only baseline (the boxes alone carry `left of` / `over`): above
    chance and not above the baseline passes; above the baseline, or no baseline row at all, fails the expectation."""
    tb = _testbed()
    def head(diff):
        return [("relation-head", "held_out", f"recall@{k}", 60.0, 10.0, 55.0, 65.0, 280, "", f"recall@{k}[boxes-only]",
                 *diff) for k in (1, 3, 5)]

    at = _run(tmp_path, "at", head((1.0, -3.0, 5.0)) + [_boxes_only(k, 59.0, 54.0, 64.0) for k in (1, 3, 5)])
    assert all(r["ok"] and r["verdict"].startswith("at base") for r in tb.job_rows("relation-head", at, None, False))
    above = _run(tmp_path, "above", head((20.0, 14.0, 26.0)) + [_boxes_only(k, 40.0, 35.0, 45.0) for k in (1, 3, 5)])
    got = {r["row"]: (r["verdict"], r["ok"]) for r in tb.job_rows("relation-head", above, None, False)}
    assert got["relation-head/held_out/recall@1"] == ("ABOVE BASE recall@1[boxes-only], expected at base", False)
    unpaired = _run(tmp_path, "unpaired", head((1.0, float("nan"), float("nan")))
                    + [_boxes_only(k, 59.0, 54.0, 64.0) for k in (1, 3, 5)])
    got = {r["row"]: (r["verdict"], r["ok"]) for r in tb.job_rows("relation-head", unpaired, None, False)}
    assert got["relation-head/held_out/recall@1"] == ("NO PAIRED INTERVAL vs recall@1[boxes-only]", False)
    alone = _run(tmp_path, "alone", [r[:8] for r in head((0.0, 0.0, 0.0))])
    got = {r["row"]: (r["verdict"], r["ok"]) for r in tb.job_rows("relation-head", alone, None, False)}
    assert got["relation-head/held_out/recall@1"] == ("NO BASELINE ROW (expected at base)", False)


def test_expectations_files_are_read_and_checked(tmp_path):
    """Both committed expectations files load with a known expectation per entry (every job of the testbed named);
    a malformed entry is one line naming the file, the job and the entry."""
    from benchmarks.testbed_expectations import EXPECTS, FOLDER, ExpectationsError, load

    seeds = {}
    for name, jobs in (("testbed.yaml", 6), ("pixels.yaml", 9), ("pixels-gt.yaml", 9)):
        table, meta = load(FOLDER / name)
        assert len(table) == jobs and meta["min_n"] == 30 and isinstance(meta["confirm_seed"], int)
        assert all(e[3] in EXPECTS and e[4] == 30 for rows in table.values() for e in rows)
        seeds[name] = meta["confirm_seed"]
    # the no-ground-truth manifest's confirmation seed is one no run of the ground-truth variant has seen
    assert seeds["pixels.yaml"] != seeds["pixels-gt.yaml"]
    from benchmarks.testbed_expectations import default_file

    # a manifest's own file first (the two pixels manifests differ); any other: by whether it has encoder exports
    assert default_file(True, "manifests/pixels-gt.yaml") == FOLDER / "pixels-gt.yaml"
    assert default_file(True, "manifests/pixels.yaml") == FOLDER / "pixels.yaml"
    assert default_file(True, "my/own.yaml") == FOLDER / "pixels.yaml"
    assert default_file(False, "manifests/testbed.yaml") == default_file(False) == FOLDER / "testbed.yaml"
    assert _testbed().LEARNABLE == load(FOLDER / "testbed.yaml")[0]  # the module's table is the file's
    bad = tmp_path / "bad.yaml"
    bad.write_text("rows:\n  c3:\n    - {benchmark: c3_mcp, subset: type1, metric: auc, expect: learn}\n")
    import pytest

    with pytest.raises(ExpectationsError, match=r"bad.yaml: rows.c3\[0\]: expect 'learn' is not one of above base, "):
        load(bad)


def test_confirmation_run_needs_committed_expectations(tmp_path, monkeypatch, capsys):
    """--confirm records the expectations file's committed blob hash and refuses a file with uncommitted edits or
    outside the repository; its overrides are the fresh generator seed in its own output folder."""
    import subprocess

    import benchmarks.testbed_expectations as te

    repo = tmp_path / "repo"
    (repo / "benchmarks" / "expectations").mkdir(parents=True)
    f = repo / "benchmarks" / "expectations" / "x.yaml"
    f.write_text("rows: {}\n")
    git = ["git", "-C", str(repo), "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run([*git, "init", "-q"], check=True)
    monkeypatch.setattr(te, "REPO", repo)
    import pytest

    with pytest.raises(te.ExpectationsError, match="x.yaml: not committed; commit the expectations"):
        te.committed_blob(f)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "x"], check=True)
    blob = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD:benchmarks/expectations/x.yaml"],
                          capture_output=True, text=True, check=True).stdout.strip()
    assert te.committed_blob(f) == blob
    f.write_text("rows: {c3: []}\n")
    with pytest.raises(te.ExpectationsError, match=f"x.yaml: differs from its committed version \\(blob {blob[:12]}\\)"):
        te.committed_blob(f)
    assert te.confirm_sets("runs/testbed/", 7) == ["dataset.synthetic.seed=7", "output=runs/testbed-confirm-7"]
    # a file's confirm_set (the sizes its predictions were written for) comes first, so the seed and folder win
    assert te.confirm_sets("runs/p", 7, ["dataset.synthetic.n_images=2800"]) == [
        "dataset.synthetic.n_images=2800", "dataset.synthetic.seed=7", "output=runs/p-confirm-7"]
    f.write_text("confirm_set: [dataset.synthetic.heldout]\nrows: {}\n")
    with pytest.raises(te.ExpectationsError, match=r"x.yaml: confirm_set: expected a list of manifest overrides"):
        te.load(f)
    f.write_text("confirm_set: [a.b=1]\nrows: {}\n")
    assert te.load(f)[1]["confirm_set"] == ["a.b=1"]
    monkeypatch.undo()
    outside = tmp_path / "e.yaml"
    outside.write_text((REPO / "benchmarks" / "expectations" / "testbed.yaml").read_text())
    assert _testbed().main(["--confirm", "--expectations", str(outside), "--table-only"]) == 2
    assert "e.yaml: outside the repository" in capsys.readouterr().err


def test_encoders_from_links_another_runs_encoders_once(tmp_path, capsys, monkeypatch):
    """--encoders-from links <output>/encoders to another run's folder (relative paths, as the README runs it), keeps
    a link to the same folder, refuses anything else already there, and a folder that does not exist; the run then
    trains no encoder (--table-only here: nothing else runs)."""
    import pytest

    from benchmarks.testbed_encoders import link_encoders

    src = tmp_path / "runs" / "pixels" / "encoders"
    (src / "clip").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    out = Path("runs/pixels-confirm-1")
    assert "linked" in link_encoders(out, "runs/pixels/encoders")
    assert (out / "encoders").is_symlink() and (out / "encoders" / "clip").is_dir()
    assert "already links" in link_encoders(out, src)
    other = tmp_path / "elsewhere"
    other.mkdir()
    with pytest.raises(ValueError, match="already exists and is not a link to"):
        link_encoders(out, other)
    with pytest.raises(ValueError, match="no such folder"):
        link_encoders(tmp_path / "fresh", tmp_path / "missing")
    assert not (tmp_path / "fresh").exists()
    monkeypatch.chdir(REPO)
    assert _testbed().main(["--encoders-from", str(tmp_path / "missing"), "--table-only"]) == 2
    assert "--encoders-from" in capsys.readouterr().err


def test_table_only_keeps_the_runs_own_table(tmp_path, capsys):
    """--table-only writes <output>/testbed-table-only.md beside the table the run itself wrote (which has the stage
    and training times), not over it; a job with no finished run is one failed row naming its folder."""
    out = tmp_path / "tb"
    out.mkdir()
    (out / "testbed.md").write_text("the run's own table\n")
    rc = _testbed().main(["--manifest", "manifests/testbed.yaml", "--set", f"output={out}", "--jobs", "c3",
                          "--no-control", "--table-only"])
    assert rc == 1 and (out / "testbed.md").read_text() == "the run's own table\n"
    table = (out / "testbed-table-only.md").read_text()
    assert "table of earlier runs (--table-only): nothing was trained" in table
    assert "| c3 | run failed: " in table and "no finished run (train it first)" in table
