"""Each paper's ablation table (train/papers/<paper>.yaml), its sweep grid (grids/<paper>.yaml) and
``train compare --paper``: unit tests of the table logic on small run folders that the test writes
(config.json + eval/final/results.parquet), and of the grid's ``configurations:`` list."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(root: Path, name: str, options: dict, rows: list[tuple], seed: int = 0) -> Path:
    """A finished run folder: config.json and eval/final/results.parquet with ``rows`` =
    (benchmark, subset, metric, value, chance, ci_low, ci_high)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    run = root / name
    (run / "eval" / "final").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"lr": 1e-5, "max_steps": 50, "device": "cpu", "seed": seed, **options}))
    cols = ["benchmark", "subset", "metric", "value", "chance", "ci_low", "ci_high"]
    pq.write_table(pa.Table.from_pylist([dict(zip(cols, r)) for r in rows]), run / "eval" / "final" / "results.parquet")
    return run


def _pointing(v: float) -> list[tuple]:
    return [("grounding:testbed", "test", "pointing accuracy", v, 50.0, v - 10, v + 10),
            ("grounding:testbed", "test", "R@1", v / 2, 40.0, v / 2 - 5, v / 2 + 5)]


def _line(out: str, section: str, row: str) -> list[str]:
    part = out.split(f"### {section}:", 1)[1].split("###", 1)[0]
    hit = [[c.strip() for c in x.strip("|").split("|")] for x in part.splitlines() if x.startswith(f"| {row} |")]
    assert len(hit) == 1, out
    return hit[0]


def test_every_table_loads_and_its_grid_is_the_runnable_rows():
    from train.paper_tables import grid_of, load_table, papers
    from train.sweep import read_grid, trials

    assert papers() == ["c3", "concept-ot", "infoground", "text-groups", "visual-tokens"]
    for p in papers():
        t = load_table(p)
        runnable = [r for r in t.rows if r.options is not None]
        assert runnable and all(r.published for r in t.rows)
        grid = read_grid(ROOT / "grids" / f"{p}.yaml", t.job)
        assert grid == grid_of(t), p
        ts = trials(grid, 3, t.job)
        assert len(ts) == 3 * len(runnable)
        key = f"train.{t.job.replace('-', '_')}."
        assert [{k[len(key):]: v for k, v in tr.options.items()} for tr in ts[::3]] == [r.options for r in runnable]


def test_transcribed_numbers_spot_checks():
    """A few published numbers against the paper text (/work/shared/papers)."""
    from train.paper_tables import load_table

    cot = load_table("concept-ot")
    assert cot.row("conceptot").published["sugarcrepe"] == 80.5 and cot.row("dense-uot").published["replace_rel"] == 74.5
    assert cot.row("global-only").published["i2t_R@1"] == 52.5 and cot.row("filip").published["t2i_R@1"] == 37.8
    ig = load_table("infoground")
    assert [r.published["pointing_accuracy"] for r in ig.rows] == [57.37, 66.89, 66.92, 74.91, 76.74]
    assert [r.id for r in ig.rows if r.options is None] == ["none-random-lm", "contextual-no-exclusion"]
    tg = load_table("text-groups")
    assert tg.row("no-reconstruction").published["tIoU"] == 40.52 and tg.row("grouped-k16").published["svo"] == 72.4
    assert load_table("c3").row("pairwise").published == {"att": 61.44, "obj": 77.48, "rel": 58.23}
    assert load_table("visual-tokens").row("no-additive").published["wg_group"] == 9.25


def test_a_table_that_does_not_hold_together_is_refused(tmp_path):
    from train.paper_tables import PaperTableError, load_table

    bad = tmp_path / "bad.yaml"
    bad.write_text("paper: x\njob: infoground\nreference: a\ncolumns: [{id: c, benchmark: b, subset: s, metric: m}]\n"
                   "rows:\n - {id: a, options: {negatives: none}, published: {c: 1}}\n"
                   " - {id: b, options: {negatives: random, lr: 1}, published: {d: 2}}\n - {id: e, options: null}\n")
    with pytest.raises(PaperTableError) as e:
        load_table(bad)
    msg = str(e.value)
    assert "row a: sets ['negatives'], the table's rows set ['lr', 'negatives']" in msg and "unknown columns ['d']" in msg and "row e: options: null" in msg
    with pytest.raises(PaperTableError, match="papers: c3, concept-ot"):
        load_table("no-such-paper")


def test_grid_configurations_list_crossed_with_a_product(tmp_path):
    from train.sweep import GridError, read_grid, trials

    g = tmp_path / "g.yaml"
    g.write_text("configurations:\n - {train.infoground.negatives: none}\n"
                 " - {train.infoground.negatives: random, train.infoground.d: 8}\n"
                 "train.infoground.lr: [0.1, 0.2]\n")
    ts = trials(read_grid(g, "infoground"), 2, "infoground")
    assert [(t.options, t.seed) for t in ts[:3]] == [
        ({"train.infoground.negatives": "none", "train.infoground.lr": 0.1}, 0),
        ({"train.infoground.negatives": "none", "train.infoground.lr": 0.1}, 1),
        ({"train.infoground.negatives": "none", "train.infoground.lr": 0.2}, 0)]
    assert len(ts) == 8 and ts[-1].sets == ['train.infoground.negatives="random"', "train.infoground.d=8",
                                            "train.infoground.lr=0.2", "train.infoground.seed=1"]
    for text, msg in [("configurations: [{train.c3.itm: true}]\n", "configurations\\[0\\] is not an option"),
                      ("configurations: []\n", "non-empty list"),
                      ("configurations: [{train.infoground.lr: 1}]\ntrain.infoground.lr: [1, 2]\n",
                       "both in configurations and as a list")]:
        g.write_text(text)
        with pytest.raises(GridError, match=msg):
            read_grid(g, "infoground")


def test_compare_groups_runs_by_row_and_judges_the_ordering(tmp_path):
    from typer.testing import CliRunner

    from train.cli import app

    runs = [_run(tmp_path, "none-0", {"negatives": "none"}, _pointing(60.0), 0),
            _run(tmp_path, "none-1", {"negatives": "none"}, _pointing(64.0), 1),
            # random below none: the paper has random above none (66.92 > 66.89): disagrees
            _run(tmp_path, "random-0", {"negatives": "random"}, _pointing(50.0), 0),
            _run(tmp_path, "random-1", {"negatives": "random"}, _pointing(54.0), 1),
            _run(tmp_path, "ctx-0", {"negatives": "contextual"}, _pointing(70.0), 0),
            _run(tmp_path, "ctx-1", {"negatives": "contextual"}, _pointing(80.0), 1),
            # a control: its other options differ from the table's runs
            _run(tmp_path, "ctx-shuffled", {"negatives": "contextual", "control": "shuffled"}, _pointing(51.0)),
            _run(tmp_path, "vanilla", {"negatives": "sideways"}, _pointing(99.0))]
    (tmp_path / "sweeps").mkdir()  # Tune's experiment folder beside the runs: `train compare --paper ... <job>/*`
    runs.append(tmp_path / "sweeps")
    r = CliRunner().invoke(app, ["compare", "--paper", "infoground", *map(str, runs)])
    assert r.exit_code == 0, r.output
    out = r.stdout
    # none: mean 62, sample std 2.83, 2 seeds, chance 50; these runs keep no per-item outcomes (items.parquet),
    # so no interval and no verdict (tests/test_paper_orderings.py judges runs that have them)
    assert _line(out, "pointing_accuracy", "none-pretrained")[2:] == [
        "62.00 +- 2.83", "2", "50.00", "-", "66.89", "2/3", "-", "-", "reference"]
    rnd = _line(out, "pointing_accuracy", "random")
    assert rnd[2] == "52.00 +- 2.83" and rnd[7:9] == ["3/2", "-10.00 (no interval)"]
    assert rnd[-1].startswith("not resolved: no per-item estimates (random-0: no items.parquet")
    ctx = _line(out, "pointing_accuracy", "contextual")
    assert ctx[2] == "75.00 +- 7.07" and ctx[7:9] == ["1/1", "+13.00 (no interval)"]
    assert _line(out, "pointing_accuracy", "none-random-lm")[2:4] == ["-", "0"]
    assert _line(out, "pointing_accuracy", "none-random-lm")[-1] == "no job option"
    # R@1 has no published number: the testbed's values only
    assert _line(out, "R@1", "contextual")[2] == "37.50 +- 3.54" and _line(out, "R@1", "contextual")[-1] == \
        "no published number"
    summary = out.split("### ordering against the reference row, per row", 1)[1]
    assert "| random | 0 | 0 | 1 | 0 | - | pointing_accuracy |" in summary
    assert "| contextual-no-exclusion | - | - | - | - | no job option | |" in summary
    assert "**Tally: 2 comparisons with the reference row: 0 agree, 0 disagree, 2 not resolved, 0 not testable;" in out
    assert "control=shuffled" in out.split("runs whose options outside")[1] and str(runs[6]) in out
    assert f"runs matching no row of the table (not counted; rows set negatives): {runs[7]}" in out
    assert f"not run folders (no config.json), skipped: {runs[8]}" in out


def test_compare_within_seed_std_scale_and_subset_alternatives(tmp_path):
    from train.paper_pages import compare_paper
    from train.paper_tables import load_table

    tg = [_run(tmp_path, f"k4-{s}", {"variant": "grouped", "n_groups": 4},
               [("phrase-discovery/samples", "all", "tIoU", v, 0.4, v - 0.1, v + 0.1),
                ("svo-probes", "all", "accuracy", 70.0 + s, 50.0, 60.0, 80.0)], s) for s, v in ((0, 0.70), (1, 0.80))]
    tg += [_run(tmp_path, f"k1-{s}", {"variant": "grouped", "n_groups": 1},
                [("phrase-discovery/samples", "all", "tIoU", v, 0.4, v - 0.1, v + 0.1),
                 ("svo-probes", "all", "accuracy", 69.0 + 3 * s, 50.0, 60.0, 80.0)], s) for s, v in ((0, 0.5), (1, 0.55))]
    out = compare_paper("text-groups", tg)
    # tIoU x 100: 75 +- 7.07 beside the paper's 76.42 +- 2.28; chance 40
    assert _line(out, "tIoU", "grouped-k4")[2:7] == ["75.00 +- 7.07", "2", "40.00", "-", "76.42 +- 2.28"]
    assert _line(out, "tIoU", "grouped-k1")[8] == "-22.50 (no interval)"
    # SVO: K=1 70.5 +- 2.12 vs K=4 70.5 +- 0.71: difference 0 exactly
    assert _line(out, "svo", "grouped-k1")[8] == "+0.00 (no interval)"
    summary = out.split("### ordering against the reference row, per row", 1)[1]
    assert "| grouped-k1 | 0 | 0 | 2 | 0 | - | tIoU, svo |" in summary, summary
    assert _line(out, "svo", "no-contrastive")[-1] == "not run"

    # a list of subsets: the first one the run has
    t = load_table("concept-ot")
    from train.paper_tables import column_value

    col = next(c for c in t.columns if c.id == "i2t_R@1")
    rows = [{"benchmark": "retrieval", "subset": "global", "metric": "i2t_R@1", "value": 10.0, "chance": 1.0,
             "ci_low": 5.0, "ci_high": 15.0}]
    assert column_value(col, rows)["value"] == 10.0
    rows.append({**rows[0], "subset": "rerank", "value": 20.0})
    assert column_value(col, rows)["value"] == 20.0


def test_every_grid_row_is_a_valid_configuration_of_its_job_with_its_own_run_folder():
    """The rows' options validate against the job's Config on manifests/testbed.yaml (as `train sweep`
    builds them) and each configuration gets its own run folder."""
    from pipeline.config import load_manifest
    from train.cli import run_folder
    from train.paper_tables import load_table, papers
    from train.sweep import read_grid, trials

    manifest = ROOT / "manifests" / "testbed.yaml"
    m = load_manifest(manifest, [])
    for p in papers():
        t = load_table(p)
        key = t.job.replace("-", "_")
        ts = trials(read_grid(ROOT / "grids" / f"{p}.yaml", t.job), 2, t.job)
        cfgs = [getattr(load_manifest(manifest, tr.sets).train, key) for tr in ts]
        for tr, cfg in zip(ts, cfgs):
            assert all(getattr(cfg, k.rsplit(".", 1)[1]) == v for k, v in tr.options.items()), (p, tr.options)
        runs = [run_folder(t.job, m, c) for c in cfgs]
        assert len(set(runs)) == len(runs), p


def test_compare_keeps_per_row_defaults_and_lists_runs_set_otherwise(tmp_path):
    """concept-ot's epochs default per variant (8 for global-only, 3 for conceptot): both rows'
    runs count; a conceptot run trained 8 epochs is set otherwise and listed."""
    from train.paper_pages import compare_paper

    def res(v):
        return [("sugarcrepe", "all", "accuracy", v, 50.0, v - 3, v + 3)]

    runs = [_run(tmp_path, "g", {"variant": "global-only", "epochs": 8.0, "max_steps": 5}, res(60.0)),
            _run(tmp_path, "c", {"variant": "conceptot", "epochs": 3.0, "max_steps": 5}, res(65.0)),
            _run(tmp_path, "c8", {"variant": "conceptot", "epochs": 8.0, "max_steps": 5}, res(70.0))]
    out = compare_paper("concept-ot", runs)
    assert "runs per row: global-only 1, conceptot 1." in out and "set besides the rows': lr=1e-05, max_steps=5." in out
    assert _line(out, "sugarcrepe", "conceptot")[2:9] == ["65.00 +- 0.00", "1", "50.00", "-", "80.50", "1/1",
                                                          "+5.00 (no interval)"]
    assert f"{runs[2]} (epochs=8.0)" in out
