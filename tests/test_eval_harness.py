"""The evaluation harness (train/eval/harness.py): exact chance levels, recall against the trainer's
own independent implementation, skip accounting, the zero-scorable error, results.parquet and
`train compare`."""

from __future__ import annotations

import itertools
import json
import math
from math import comb
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from train.eval import compare as C, harness as H
from train.eval.interface import RESULT_COLUMNS, BenchData, Item, NoScorableItems, Pair, Row


def test_retrieval_chance_exact_against_enumeration():
    # 1 - C(G-c, k)/C(G, k), checked by enumerating every k-subset of positions
    for G, c, k in [(6, 1, 1), (6, 2, 2), (7, 3, 2), (5, 5, 1), (8, 2, 5), (4, 1, 10)]:
        hits = sum(1 for top in itertools.combinations(range(G), min(k, G)) if any(t < c for t in top))
        want = 100 * hits / comb(G, min(k, G))
        assert H.retrieval_chance(np.array([c]), G, k) == pytest.approx(want, abs=1e-9), (G, c, k)


def test_retrieval_rows_agree_with_trainer_recall():
    from train.eval.retrieval import recall_at_k

    rng = np.random.default_rng(0)
    I, per = 12, 3
    img_of = np.repeat(np.arange(I), per)
    S = rng.normal(size=(I, I * per))
    S[img_of, np.arange(I * per)] += 1.0  # some signal
    rows = {r.metric: r for r in H.retrieval_rows("b", "p", S, img_of)}
    gt = torch.zeros(I, I * per, dtype=torch.bool)
    gt[torch.as_tensor(img_of), torch.arange(I * per)] = True
    ref_i2t = recall_at_k(torch.as_tensor(S), gt)
    ref_t2i = recall_at_k(torch.as_tensor(S.T), gt.t())
    for k in (1, 5, 10):
        assert rows[f"i2t_R@{k}"].value == pytest.approx(100 * ref_i2t[k])
        assert rows[f"t2i_R@{k}"].value == pytest.approx(100 * ref_t2i[k])
    assert rows["t2i_R@1"].chance == pytest.approx(100 / I)
    assert rows["i2t_R@1"].chance == pytest.approx(100 * per / (I * per))
    assert rows["i2t_R@1"].n == I and rows["t2i_R@1"].n == I * per


class FakeJob:
    """Scores are looked up in a table: (sample_id, text) -> score."""

    NAME = "fake"

    def __init__(self, table, scorable):
        self.table, self.scorable = table, scorable
        self.cfg = SimpleNamespace(variant="v1", seed=3)
        self.calls = 0
        self.crop_note = ""

    def scorable_sample_ids(self):
        return self.scorable

    def score_pairs(self, model, sids, texts, boxes=None):
        self.calls += 1
        return np.array([self.table.get((int(s), t), 0.0) for s, t in zip(sids, texts)])

    def retrieval_scores(self, model, sids, cids, texts):
        return {"score": np.array([[self.table.get((int(s), t), 0.0) for t in texts] for s in sids])}

    def job_metrics(self, model, out_dir):
        return [Row("fake-own", "all", "acc", 75.0, 4, 50.0)]


def _pairwise_score(items, scores):
    ok = [float(s[0] > s[1]) for s in scores]
    rows = [Row("toy", "all", "acc", 100 * float(np.mean(ok)), len(ok), 50.0)]
    for sub in sorted({it.subset for it in items}):
        o = [x for it, x in zip(items, ok) if it.subset == sub]
        rows.append(Row("toy", sub, "acc", 100 * float(np.mean(o)), len(o), 50.0))
    return rows


def _manifest(tmp_path, benchmarks):
    specs = [SimpleNamespace(name=b, format=f, path=str(tmp_path), images=None, image_map=None, split=s,
                             max_items=None, subsets=None, options={}) for b, f, s in benchmarks]
    return SimpleNamespace(output=str(tmp_path), eval=SimpleNamespace(benchmarks=specs, samples_artifact="samples",
                                                                      pairs_chunk=2))


def _toy_reader(spec, samples_dir):
    items = [
        Item([Pair("sample_id:1", "a red cube"), Pair("sample_id:1", "a cube red")], subset="swap"),
        Item([Pair("sample_id:2", "a blue ball"), Pair("sample_id:2", "a red ball")], subset="replace"),
        Item([Pair("sample_id:3", "x"), Pair("sample_id:3", "y")], subset="swap"),   # tie: strict -> wrong
        Item([Pair("sample_id:9", "x"), Pair("sample_id:9", "y")], subset="swap"),   # not in the artifacts
    ]
    return BenchData(spec.name, items, score=_pairwise_score, skipped={"malformed: no caption": 2}, total=6)


def test_harness_pairwise_skips_results_and_compare(tmp_path, monkeypatch):
    monkeypatch.setitem(H.BUILTIN, "toy", _toy_reader)
    table = {(1, "a red cube"): 0.9, (1, "a cube red"): 0.1, (2, "a blue ball"): 0.2, (2, "a red ball"): 0.7,
             (3, "x"): 0.5, (3, "y"): 0.5}
    job = FakeJob(table, scorable={1, 2, 3})
    m = _manifest(tmp_path, [("toy", "toy", None)])
    out = tmp_path / "run" / "eval" / "step000010"
    rows, errors = H.run_harness(job, torch.nn.Linear(1, 1), m, out, checkpoint="c.pt", step=10, log=lambda s: None)
    assert errors == []
    by = {(r["benchmark"], r["subset"]): r for r in rows}
    assert by[("toy", "all")]["value"] == pytest.approx(100 / 3)       # 1 right of 3 (the tie is wrong)
    assert by[("toy", "all")]["n"] == 3
    assert by[("toy", "all")]["skipped"] == 3                            # 1 without image + 2 malformed rows
    reasons = json.loads(by[("toy", "all")]["skip_reasons"])
    assert reasons == {"malformed: no caption": 2, "skipped_no_image: not in the job's artifacts": 1}
    assert by[("toy", "swap")]["skipped"] == 1 and by[("toy", "replace")]["skipped"] == 0
    assert by[("toy", "swap")]["value"] == pytest.approx(50.0)
    assert by[("fake-own", "all")]["value"] == 75.0
    t = pq.read_table(out / "results.parquet")
    assert tuple(t.column_names) == RESULT_COLUMNS
    assert set(t.column("job").to_pylist()) == {"fake"} and set(t.column("variant").to_pylist()) == {"v1"}
    assert set(t.column("step").to_pylist()) == {10}
    assert "| toy | all | acc | 33.3 % | 50.0 % | 3 | 3 |" in (out / "results.md").read_text()
    # unique pairs in chunks of 2: 6 pairs -> 3 calls
    assert job.calls == 3

    # a second run with other scores; compare puts both side by side with the chance column
    (tmp_path / "run" / "config.json").write_text(json.dumps({"seed": 3}))
    table2 = {**table, (3, "x"): 0.6}
    job2 = FakeJob(table2, scorable={1, 2, 3})
    job2.cfg.variant = "v2"
    out2 = tmp_path / "run2" / "eval" / "final"
    H.run_harness(job2, torch.nn.Linear(1, 1), m, out2, log=lambda s: None)
    txt = C.compare([tmp_path / "run", tmp_path / "run2"])
    line = next(x for x in txt.splitlines() if x.startswith("| toy | all | acc"))
    assert line == "| toy | all | acc | 50.0 % | 33.3 % (n=3; too few items) | 66.7 % (n=3; too few items) |"
    assert "fake/v1 s3" in txt.splitlines()[0] and "fake/v2" in txt.splitlines()[0]


def test_zero_scorable_is_an_error_naming_counts(tmp_path, monkeypatch):
    monkeypatch.setitem(H.BUILTIN, "toy", _toy_reader)
    job = FakeJob({}, scorable={100})
    m = _manifest(tmp_path, [("toy", "toy", None)])
    rows, errors = H.run_harness(job, torch.nn.Linear(1, 1), m, tmp_path / "o", job_metrics=False, log=lambda s: None)
    assert rows == []
    assert len(errors) == 1
    assert errors[0].startswith("toy: 0 of 4 items are scorable: 4 of 4 benchmark images are in")
    assert "0 in the job's artifacts" in errors[0]
    assert "run the stage(s) that make this job's artifacts" in errors[0]  # the images are ingested, not encoded
    # images not in the samples at all: what to ingest, by format, with the spec's image folder
    spec = SimpleNamespace(name="wg", format="winoground", path=str(tmp_path), images="data/winoground/images",
                           image_map=None, split=None, max_items=None, subsets=None, options={})
    monkeypatch.setitem(H.BUILTIN, "winoground", lambda sp, sd: BenchData(sp.name, [
        Item([Pair(f"ex_{k}_img_0", "a"), Pair(f"ex_{k}_img_1", "b")]) for k in range(3)], score=_pairwise_score))
    from pipeline.io.artifacts import ArtifactWriter

    w = ArtifactWriter(tmp_path / "s", "samples", "ingest", {"fake": True})
    uw = w.unit_writer("00000", "fp")
    uw.write_table("samples", pa.table({"sample_id": pa.array([0, 1], pa.int64()), "source_id": ["a", "b"],
                                        "image": ["/i/a.jpg", "/i/b.jpg"], "split": ["test", "test"]}))
    uw.commit({"rows": 2})
    w.finalize(["00000"])  # no Winoground image among these samples
    with pytest.raises(NoScorableItems, match=r"wg: 0 of 3 items are scorable: 0 of 6 benchmark images are in .*; ingest "
                       r"Winoground's images \(data/images.zip\) \(data/winoground/images\) into this run or give "
                       r"eval.benchmarks\[wg\].image_map"):
        H.evaluate_benchmark(FakeJob({}, scorable=set()), None, spec, tmp_path / "s" / "samples", set(), log=lambda s: None)
    with pytest.raises(NoScorableItems):
        H.evaluate_benchmark(job, None, m.eval.benchmarks[0], tmp_path, {100}, log=lambda s: None)
    # --bench with an unknown name is a one-line error
    with pytest.raises(ValueError, match="--bench nope: not in the manifest's eval.benchmarks"):
        H.run_harness(job, torch.nn.Linear(1, 1), m, tmp_path / "o", only=["nope"], log=lambda s: None)


def _samples_artifact(out: Path):
    from pipeline.io.artifacts import ArtifactWriter

    w = ArtifactWriter(out, "samples", "ingest", {"fake": True})
    uw = w.unit_writer("00000", "fp")
    uw.write_table("samples", pa.table({"sample_id": pa.array([0, 1, 2, 3], pa.int64()),
                                        "source_id": ["a", "b", "c", "d"],
                                        "split": ["train", "test", "test", "test"]}))
    uw.write_table("captions", pa.table({"caption_id": pa.array([0, 1, 2, 3, 4, 5], pa.int64()),
                                         "sample_id": pa.array([0, 1, 1, 2, 3, 3], pa.int64()),
                                         "text": ["t0", "t1", "t2", "t3", "t4", "t5"]}))
    uw.commit({"rows": 4})
    w.finalize(["00000"])


def test_split_retrieval_builtin(tmp_path):
    _samples_artifact(tmp_path)
    # image 1 ranks its captions first; image 2 ranks t0... wrong; image 3 right
    table = {(1, "t1"): 5, (1, "t2"): 4, (2, "t3"): 1, (2, "t4"): 2, (3, "t4"): 3, (3, "t5"): 3.5}
    job = FakeJob(table, scorable={1, 2, 3})
    m = _manifest(tmp_path, [("ret", "split_retrieval", "test")])
    rows, errors = H.run_harness(job, torch.nn.Linear(1, 1), m, tmp_path / "o", job_metrics=False, log=lambda s: None)
    assert errors == []
    by = {r["metric"]: r for r in rows}
    # i2t: image1 top t1 (hit), image2 top is t4 (miss), image3 top t5 (hit) -> 2/3
    assert by["i2t_R@1"]["value"] == pytest.approx(200 / 3) and by["i2t_R@1"]["n"] == 3
    assert by["t2i_R@1"]["n"] == 5 and by["t2i_R@1"]["chance"] == pytest.approx(100 / 3)
    # the train split is not part of it; a split that does not exist is a clear error
    m2 = _manifest(tmp_path, [("ret", "split_retrieval", "val")])
    _, errors = H.run_harness(job, torch.nn.Linear(1, 1), m2, tmp_path / "o2", job_metrics=False, log=lambda s: None)
    assert errors and "no samples of split 'val'" in errors[0]


def test_one_direction_protocols():
    """'<p>/i2t' and '<p>/t2i' matrices are read in their own direction only, reported as '<p>'."""
    rng = np.random.default_rng(1)
    img_of = np.repeat(np.arange(5), 2)
    S = rng.normal(size=(5, 10))
    full = {(r.subset, r.metric): r.value for r in H.retrieval_rows("b", "p", S, img_of)}
    i2t = H.retrieval_rows("b", "rerank/i2t", S, img_of)
    t2i = H.retrieval_rows("b", "rerank/t2i", S, img_of)
    assert {r.subset for r in i2t + t2i} == {"rerank"}
    assert {r.metric for r in i2t} == {"i2t_R@1", "i2t_R@5", "i2t_R@10"}
    assert {r.metric for r in t2i} == {"t2i_R@1", "t2i_R@5", "t2i_R@10"}
    for r in i2t + t2i:
        assert r.value == full[("p", r.metric)]


def test_compare_merges_evaluations_of_the_newest_step(tmp_path):
    def write(d, step, bench, value):
        H.write_results([{"job": "j", "variant": "v", "checkpoint": "c", "step": step, "benchmark": bench,
                          "subset": "all", "metric": "acc", "value": value, "n": 3, "chance": 50.0, "skipped": 0,
                          "skip_reasons": "{}", "unit": "%", "note": ""}], d)

    run = tmp_path / "run"
    write(run / "eval" / "step000005", 5, "old-step", 10.0)
    write(run / "eval" / "final", 9, "a", 60.0)
    write(run / "eval" / "step000009", 9, "b", 70.0)  # `train eval --bench b` of the final checkpoint
    txt = C.compare([run])
    assert "| a | all | acc | 50.0 % | 60.0 % (n=3; too few items) |" in txt and "| b | all | acc | 50.0 % | 70.0 % (n=3; too few items) |" in txt
    assert "old-step" not in txt
    # a fraction (IoU, AUC) carries no percent sign, beside percentages in the same table
    H.write_results([{"job": "j", "variant": "v", "checkpoint": "c", "step": 9, "benchmark": "grounding",
                      "subset": "all", "metric": "mean_IoU", "value": 0.0717, "n": 44, "chance": 0.07, "skipped": 0,
                      "skip_reasons": "{}", "unit": "fraction", "note": ""}], run / "eval" / "step000009-own")
    txt = C.compare([run])
    assert "| grounding | all | mean_IoU | 0.070 | 0.072 (n=44) |" in txt and "| a | all | acc | 50.0 % | 60.0 % (n=3; too few items) |" in txt
    # two runs of one job and variant (other options, e.g. conceptot and conceptot-34a1d0): each column
    # names its run folder (before: "j/v #1" and a bare "j/v")
    write(tmp_path / "j" / "v-34a1d0" / "eval" / "final", 9, "a", 61.0)
    (tmp_path / "j" / "v-34a1d0" / "config.json").write_text("{}")
    head = C.compare([run, tmp_path / "j" / "v-34a1d0"]).splitlines()[0]
    assert head == "| benchmark | subset | metric | chance | j/v (run) | j/v (v-34a1d0) |", head


def test_job_label_names_the_variant_as_the_run_folder_does():
    """infoground's variants are its ``negatives`` option: train eval / train compare label its runs
    contextual / random / none (they were all "default", told apart only by folder names)."""
    from train.jobs.infoground import Config as IG
    from train.jobs.visual_tokens import Config as VT

    for neg in ("contextual", "random", "none"):
        cfg = IG(negatives=neg)
        assert H._job_label(SimpleNamespace(NAME="infoground", cfg=cfg)) == ("infoground", neg)
        assert cfg.run_tag() == neg  # the run folder's name: the same word
    assert H._job_label(SimpleNamespace(NAME="visual-tokens", cfg=VT(variant="vit"))) == ("visual-tokens", "vit")
    assert H._job_label(SimpleNamespace(NAME="x", cfg=SimpleNamespace())) == ("x", "default")


def test_foreign_dataset_images_and_boxes_outside_their_image_are_counted(tmp_path, monkeypatch):
    """A COCO run (samples/_manifest.json: dataset_kind coco): a VL-CheckList VG key and a VisDial key
    with a COCO image's number are skipped as foreign_dataset (by dataset), not scored on image
    391895; a box wholly outside its image is skipped, not scored on the nearest patch."""
    from pipeline.io.artifacts import ArtifactWriter

    w = ArtifactWriter(tmp_path, "samples", "ingest", {"fake": True})
    uw = w.unit_writer("00000", "fp")
    uw.write_table("samples", pa.table({"sample_id": pa.array([0, 1], pa.int64()), "source_id": ["391895", "5"],
                                        "image": ["000000391895.jpg", "000000000005.jpg"],
                                        "width": pa.array([640, 640], pa.int32()), "height": pa.array([480, 480], pa.int32()),
                                        "split": ["test", "test"]}))
    uw.commit({"rows": 2})
    w.finalize(["00000"], extra={"dataset_kind": "coco"})

    def reader(spec, samples_dir):
        its = [Item([Pair("COCO_val2014_000000391895.jpg", "a"), Pair("COCO_val2014_000000391895.jpg", "b")], "coco"),
               Item([Pair("vg/VG_100K/391895.jpg", "a"), Pair("vg/VG_100K/391895.jpg", "b")], "vg"),
               Item([Pair("VisualDialog_val2018_000000000005.jpg", "a"), Pair("VisualDialog_val2018_000000000005.jpg", "b")], "vd"),
               Item([Pair("000000000005.jpg", "a", (700, 10, 800, 90)), Pair("000000000005.jpg", "b", (700, 10, 800, 90))], "box"),
               Item([Pair("000000000005.jpg", "a", (600, 10, 800, 90)), Pair("000000000005.jpg", "b", (600, 10, 800, 90))], "box")]
        return BenchData(spec.name, its, score=_pairwise_score, total=5)

    monkeypatch.setitem(H.BUILTIN, "toy", reader)
    job = FakeJob({(0, "a"): 1.0, (1, "a"): 1.0}, scorable={0, 1})
    spec = _manifest(tmp_path, [("toy", "toy", None)]).eval.benchmarks[0]
    rows = H.evaluate_benchmark(job, None, spec, tmp_path / "samples", {0, 1}, log=lambda s: None)
    by = {r.subset: r for r in rows}
    assert by["all"].n == 2 and by["all"].skipped == 3
    assert by["all"].skip_reasons == {"box outside its image": 1, "foreign_dataset: Visual Genome": 1,
                                      "foreign_dataset: VisDial": 1}
    # nothing scorable: the error says why, by reason
    with pytest.raises(NoScorableItems, match=r"toy: 0 of 5 items are scorable: .* \(skipped: foreign_dataset: VisDial 1, "
                       r"foreign_dataset: Visual Genome 1, skipped_no_image: not in the job's artifacts 3\); run the stage"):
        H.evaluate_benchmark(job, None, spec, tmp_path / "samples", set(), log=lambda s: None)


def test_harness_prints_one_line_for_its_benchmarks(tmp_path, monkeypatch):
    """The terminal gets one line per evaluation (the demo printed ~60 "N of M items scored" lines per
    `train run all`); the line per benchmark is in benchmarks.log beside the results, and with -v on the
    terminal too."""
    monkeypatch.setitem(H.BUILTIN, "toy", _toy_reader)
    table = {(1, "a red cube"): 0.9, (1, "a cube red"): 0.1, (2, "a blue ball"): 0.2, (2, "a red ball"): 0.7,
             (3, "x"): 0.5, (3, "y"): 0.5}
    m = _manifest(tmp_path, [("toy", "toy", None), ("toy2", "toy", None)])
    out = tmp_path / "run" / "eval" / "final"
    said: list[str] = []
    rows, errors = H.run_harness(FakeJob(table, scorable={1, 2, 3}), torch.nn.Linear(1, 1), m, out, log=said.append)
    assert errors == [] and len(said) == 1, said
    assert said[0] == (f"benchmarks: 2 of 2 scored, 6 items (6 skipped: malformed: no caption 4, skipped_no_image: "
                       f"not in the job's artifacts 2); {len(rows)} rows: {out / 'results.md'} (each benchmark: "
                       "benchmarks.log there)")
    per = (out / "benchmarks.log").read_text().splitlines()
    assert [x.rsplit(" in ", 1)[0] for x in per] == [
        f"  {b}: 3 of 4 items scored, 3 skipped (malformed: no caption 2, skipped_no_image: not in the job's "
        "artifacts 1)" for b in ("toy", "toy2")], per
    H.set_verbose(True)  # `train run -v`
    try:
        said.clear()
        H.run_harness(FakeJob(table, scorable={1, 2, 3}), torch.nn.Linear(1, 1), m, out, log=said.append)
    finally:
        H.set_verbose(False)
    assert len(said) == 3 and said[:2] == (out / "benchmarks.log").read_text().splitlines(), said


def test_a_row_below_chance_says_why_beside_its_verdict(tmp_path, monkeypatch):
    """A scorer that ties every item lands below chance under strict scoring (infoground on the demo's
    VG-Relation: "462 of 462 items tied"): results.md, `train compare` and `train run`'s tables give
    that reason beside the verdict, not a bare "below"."""
    from train.eval.benchmarks._common import correct_vector, item_images, pooled_row, tied_at_top
    from train.summary import runs_table

    def reader(spec, samples_dir):
        items = [Item([Pair(f"sample_id:{s}", "a"), Pair(f"sample_id:{s}", "b")]) for s in range(1, 13)]
        return BenchData(spec.name, items, total=12, score=lambda its, sc: [pooled_row(
            "tied", "all", correct_vector(its, sc), 0.5, images=item_images(its), ties=tied_at_top(sc))])

    monkeypatch.setitem(H.BUILTIN, "tied", reader)
    m = _manifest(tmp_path, [("tied", "tied", None)])
    run = tmp_path / "run"
    rows, _ = H.run_harness(FakeJob({}, scorable=set(range(1, 13))), torch.nn.Linear(1, 1), m, run / "eval" / "final",
                            job_metrics=False, log=lambda s: None)  # every pair scores 0.0: 12 ties, 0 % against 50 %
    assert rows[0]["note"] == "12 of 12 items tied at the top (scored wrong, as the original)"
    md = (run / "eval" / "final" / "results.md").read_text()
    assert "| tied | all | accuracy | 0.0 [0.0, 24.2] % | 50.0 % | 12 | 0 | below: 12 of 12 items tied |" in md, md
    assert "(n=12; below: 12 of 12 items tied) |" in C.compare([run])
    table = runs_table([("fake", run, {}, 3.0)], [])
    assert "below: 12 of 12 items tied" in table.splitlines()[1], table


def test_compare_filters_by_benchmark_subset_and_items(tmp_path):
    """`train compare --bench NAME --subset NAME --min-n N`: the demo's concept-ot table had 270 rows and
    no filter; the filters keep the rows asked for, and a filter that keeps none says what there is."""
    from typer.testing import CliRunner

    from train.cli import app

    def row(bench, subset, n, value=60.0):
        return {"job": "j", "variant": "v", "checkpoint": "c", "step": 9, "benchmark": bench, "subset": subset,
                "metric": "acc", "value": value, "n": n, "chance": 50.0, "skipped": 0, "skip_reasons": "{}",
                "unit": "%", "note": ""}

    run = tmp_path / "run"
    H.write_results([row("sugarcrepe", "all", 758), row("sugarcrepe", "swap_att", 40), row("sugarcrepe", "add", 8),
                     row("valse", "all", 812), row("valse", "counting", 180)], run / "eval" / "final")
    body = lambda txt: [x.split(" | ")[0:2] for x in txt.split("\n\n")[0].splitlines()[2:]]  # noqa: E731
    assert len(body(C.compare([run]))) == 5
    assert body(C.compare([run], bench=["sugarcrepe"])) == [["| sugarcrepe", "all"], ["| sugarcrepe", "swap_att"],
                                                             ["| sugarcrepe", "add"]]
    assert body(C.compare([run], subset=["all"])) == [["| sugarcrepe", "all"], ["| valse", "all"]]
    assert body(C.compare([run], bench=["sugarcrepe"], min_n=10)) == [["| sugarcrepe", "all"], ["| sugarcrepe", "swap_att"]]
    r = CliRunner().invoke(app, ["compare", str(run), "--bench", "valse", "--subset", "counting", "--min-n", "100"])
    assert r.exit_code == 0 and body(r.output) == [["| valse", "counting"]], r.output
    r = CliRunner().invoke(app, ["compare", str(run), "--bench", "valse", "--subset", "swap_att"])
    assert r.exit_code == 2 and r.output.strip() == ("error: no result row matches --bench valse --subset swap_att; "
                                                     "the runs' benchmarks: sugarcrepe, valse; subsets of valse: all, "
                                                     "counting"), r.output
    r = CliRunner().invoke(app, ["compare", str(run), "--over-seeds", "--min-n", "5"])
    assert r.exit_code == 2 and "not --paper or --over-seeds" in r.output


def test_image_splits_scores_held_out_items_only(tmp_path, monkeypatch):
    """eval.benchmarks[].image_splits: items whose image is a sample of another split are skipped and
    counted (no samples artifact here: the hash split, 18 -> val, 19 -> test, else train)."""
    def reader(spec, samples_dir):
        items = [Item([Pair(f"sample_id:{s}", "a"), Pair(f"sample_id:{s}", "b")], subset="all") for s in (18, 19, 1, 2)]
        return BenchData(spec.name, items, score=_pairwise_score, total=4)

    monkeypatch.setitem(H.BUILTIN, "toy", reader)
    table = {(s, "a"): 0.9 for s in (18, 19, 1, 2)}
    m = _manifest(tmp_path, [("toy", "toy", None)])
    m.eval.benchmarks[0].image_splits = ["val", "test"]
    rows, errors = H.run_harness(FakeJob(table, scorable={18, 19, 1, 2}), torch.nn.Linear(1, 1), m, tmp_path / "e",
                                 job_metrics=False, log=lambda s: None)
    r = next(r for r in rows if r["benchmark"] == "toy" and r["subset"] == "all")
    assert (r["n"], r["skipped"], r["value"]) == (2, 2, 100.0)
    assert json.loads(r["skip_reasons"]) == {"image outside image_splits ['val', 'test']": 2}
    m.eval.benchmarks[0].image_splits = ["val"]
    rows, _ = H.run_harness(FakeJob(table, scorable={18, 19, 1, 2}), torch.nn.Linear(1, 1), m, tmp_path / "e2",
                            job_metrics=False, log=lambda s: None)
    assert next(r for r in rows if r["benchmark"] == "toy")["n"] == 1


def test_a_jobs_frozen_score_is_reported_as_the_baseline_its_result_is_judged_against(tmp_path, monkeypatch):
    """A job with a frozen score (concept-ot's g) gets every pairwise row again as ``<metric>[frozen]``
    with ``baseline_for``; a baseline protocol's retrieval rows point at the learnt protocol; the
    verdict of a result is decided by its paired difference from its frozen score."""
    from pipeline.report.significance import verdicts

    monkeypatch.setitem(H.BUILTIN, "toy", _toy_reader)
    table = {(1, "a red cube"): 0.9, (1, "a cube red"): 0.1, (2, "a blue ball"): 0.2, (2, "a red ball"): 0.7,
             (3, "x"): 0.5, (3, "y"): 0.5}

    class Frozen(FakeJob):
        baseline_protocols = {"global": "score"}

        def has_frozen_baseline(self):
            return True

        def score_pairs_frozen(self, model, sids, texts, boxes=None):  # right on every item: a strong frozen score
            return np.array([1.0 if t in ("a red cube", "a blue ball", "x") else 0.0 for t in texts])

        def retrieval_scores(self, model, sids, cids, texts):
            s = super().retrieval_scores(model, sids, cids, texts)["score"]
            return {"score": s, "global": s}

    job = Frozen(table, scorable={1, 2, 3})
    m = _manifest(tmp_path, [("toy", "toy", None)])
    rows, _ = H.run_harness(job, torch.nn.Linear(1, 1), m, tmp_path / "o", job_metrics=False, log=lambda s: None)
    by = {(r["subset"], r["metric"]): r for r in rows}
    assert by[("all", "acc[frozen]")]["value"] == 100.0 and by[("all", "acc[frozen]")]["baseline_for"] == "all/acc"
    assert by[("all", "acc")]["baseline_for"] == ""
    # the toy scorer's rows carry no per-item estimate: the difference from the frozen score has no paired
    # interval, so no verdict (a baseline is never compared as a constant; tests/test_eval_paired.py pairs them)
    assert by[("all", "acc")]["diff_vs"] == "acc[frozen]" and math.isnan(by[("all", "acc")]["diff_low"])
    assert "no paired interval: the result has no per-item estimate" in by[("all", "acc")]["note"]
    rows = [{**by[("all", "acc")], "value": 70.0, "ci_low": 60.0, "ci_high": 80.0, "n": 100},
            {**by[("all", "acc[frozen]")], "value": 75.0, "n": 100}]
    assert verdicts(rows) == [None, "baseline"]
    rows[0].update(diff=-5.0, diff_low=-9.0, diff_high=-1.0)
    assert verdicts(rows)[0] == "below"
    rows[0].update(diff=5.0, diff_low=1.0, diff_high=9.0)
    assert verdicts(rows)[0] == "above"

    # retrieval: the frozen protocol's rows are the learnt protocol's baselines
    items = [Item([Pair(f"sample_id:{i}", t)], key=str(i)) for i, t in ((1, "a red cube"), (2, "a blue ball"))]
    data = BenchData("ret", items, score=lambda its, sc: [], kind="retrieval")
    got = H._score_retrieval(job, None, None, data, items, {"sample_id:1": 1, "sample_id:2": 2})
    assert {r.baseline_for for r in got if r.subset == "global"} == {f"score/{d}_R@{k}" for d in ("i2t", "t2i")
                                                                       for k in (1, 5, 10)}
    assert {r.baseline_for for r in got if r.subset == "score"} == {""}
