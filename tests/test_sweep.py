"""`train sweep`: a seeded grid of ordinary runs as Ray Tune trials, each in its own run folder with
its log; a crashed trial is reported without stopping the rest; a rerun skips finished trials; the
table is mean +- std over seeds per configuration (`train compare --over-seeds`)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.usefixtures("one_thread")


def _seeds_line(table: str, config: str, metric: str) -> list[str]:
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines() if line.startswith("| ")]
    hit = [r for r in rows if r[0] == config and r[3] == metric]
    assert len(hit) == 1, table
    return hit[0]


def test_sweep_runs_the_grid_reports_a_crash_and_skips_finished_trials(tmp_path, testbed_copy, ray_session):
    import shutil

    from typer.testing import CliRunner

    from train.cli import app

    out, _ = testbed_copy  # the small oracle testbed (tests/conftest.py)
    shutil.rmtree(out / "index")  # hard_negatives: index without an `index` artifact: those trials crash at start
    man = tmp_path / "m.yaml"
    man.write_text("name: t\n")
    grid = tmp_path / "grid.yaml"
    grid.write_text("train.concept_ot.lr: [0.001, 0.002]\ntrain.concept_ot.hard_negatives: [batch, index]\n")
    sets = [f"output={out}", "train.concept_ot.max_steps=2", "train.concept_ot.batch_size=8",
            "train.concept_ot.d_c=16", "train.concept_ot.rank=8", "train.concept_ot.sugarcrepe_dirs=[]",
            "train.concept_ot.heatmaps=0", "train.concept_ot.threads=1", "train.concept_ot.eval_splits=[test]"]
    args = ["sweep", "concept-ot", "--manifest", str(man), "--grid", str(grid), "--seeds", "2", "--max-concurrent", "2"]
    for s in sets:
        args += ["--set", s]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 1, r.output
    runs = sorted(p for p in (out / "train" / "concept-ot").iterdir() if p.name != "sweeps")
    assert len(runs) == 8 and all((p / "train.log").is_file() for p in runs)
    ok = [p for p in runs if (p / "checkpoints" / "final.pt").is_file() and (p / "eval" / "final").is_dir()]
    assert len(ok) == 4
    failed = [x for x in r.stderr.splitlines() if "failed (" in x]
    listed = [x for x in r.stderr.splitlines() if x.startswith("run folders: ")]  # for `train compare` (grids/*.yaml)
    assert len(listed) == 1 and sorted(listed[0].split()[2:]) == sorted(map(str, runs)), r.stderr[-2000:]
    assert len(failed) == 4 and all("hard_negatives=index" in x and "index" in x.split("failed (")[1] for x in failed)
    line = _seeds_line(r.stdout, "lr=0.001", "global/avg_R@1")
    assert line[5] == "2"  # seeds
    # the same table through `train compare --over-seeds`
    r2 = CliRunner().invoke(app, ["compare", "--over-seeds", *map(str, ok)])
    assert r2.exit_code == 0 and _seeds_line(r2.stdout, "lr=0.001", "global/avg_R@1")[4] == line[4]
    stamps = {p: (p / "checkpoints" / "final.pt").stat().st_mtime_ns for p in ok}
    r3 = CliRunner().invoke(app, args)
    assert r3.exit_code == 1 and r3.stdout == r.stdout and r.stdout.startswith("| configuration |")
    assert {p: (p / "checkpoints" / "final.pt").stat().st_mtime_ns for p in ok} == stamps  # finished: skipped


@pytest.mark.parametrize("text, words", [("train.c3.lr: [1, 2]\n", "train.c3.lr"), ("train.concept_ot.lr: 0.1\n", "list"),
                                         ("[1, 2]\n", "mapping"), ("a: [\n", "cannot be read")])
def test_bad_grid_is_one_line_naming_the_key(tmp_path, text, words):
    from train.sweep import GridError, read_grid

    grid = tmp_path / "g.yaml"
    grid.write_text(text)
    with pytest.raises(GridError) as e:
        read_grid(grid, "concept-ot")
    assert words in str(e.value) and str(grid) in str(e.value) and "\n" not in str(e.value)


def test_trials_are_the_grid_times_the_seeds():
    from train.sweep import trials

    ts = trials({"train.concept_ot.lr": [0.1, 0.2], "train.concept_ot.variant": ["filip"]}, 3, "concept-ot")
    assert [(t.options["train.concept_ot.lr"], t.seed) for t in ts] == [(a, s) for a in (0.1, 0.2) for s in range(3)]
    assert ts[4].sets == ["train.concept_ot.lr=0.2", 'train.concept_ot.variant="filip"', "train.concept_ot.seed=1"]


def test_a_trial_killed_while_scoring_its_final_benchmarks_is_not_finished(tmp_path):
    """The loop writes eval/final/metrics.json after the final benchmarks: until then a run folder with
    its final checkpoint and an eval/final folder (created before scoring) is rerun, not skipped."""
    from train.sweep import finished

    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "final.pt").write_bytes(b"x")
    (tmp_path / "eval" / "final").mkdir(parents=True)
    (tmp_path / "eval" / "final" / "results.parquet.tmp").write_bytes(b"")  # scoring under way
    assert not finished(tmp_path)
    (tmp_path / "eval" / "final" / "metrics.json").write_text("{}")
    assert finished(tmp_path)


def test_progress_lines_tell_waiting_starting_running_and_done(tmp_path, capsys):
    """One line per trial: not started by Tune yet (no run folder), started (no metrics yet),
    its latest step and loss, done (eval/final/metrics.json)."""
    import json

    from train.sweep import Trial, _ProgressLines

    ts = [Trial({"train.c3.lr": v}, 0, str(tmp_path / f"r{v}")) for v in (1, 2, 3, 4)]
    (tmp_path / "r2").mkdir()
    (tmp_path / "r3").mkdir()
    (tmp_path / "r3" / "metrics.jsonl").write_text(json.dumps({"kind": "train", "step": 7, "loss": 0.25}) + "\n")
    (tmp_path / "r4" / "eval" / "final").mkdir(parents=True)
    (tmp_path / "r4" / "checkpoints").mkdir()
    (tmp_path / "r4" / "checkpoints" / "final.pt").write_bytes(b"x")
    (tmp_path / "r4" / "eval" / "final" / "metrics.json").write_text("{}")
    _ProgressLines(ts).print()
    assert capsys.readouterr().err.splitlines() == [
        "trial lr=1, seed=0: waiting for a CPU", "trial lr=2, seed=0: starting",
        "trial lr=3, seed=0: step 7, train loss 0.25", "trial lr=4, seed=0: done"]
