"""The pieces every job shares (train/job.py) and the in-job benchmark folders (train/eval/in_job.py):
the split rule read from a samples artifact, the default SugarCrepe folder (the generated dataset's,
never a folder outside the project), folders read with a per-kind cap."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vt_artifacts import write_vt_artifacts  # noqa: E402

from pipeline.io.artifacts import Artifact, ArtifactWriter, unit_name  # noqa: E402


def test_splits_read_the_samples_artifact_and_hash_the_rest(tmp_path):
    from train.job import Splits, hash_split

    w = ArtifactWriter(tmp_path, "samples", "ingest", {})
    u = w.unit_writer(unit_name(0), "fp")
    u.write_table("samples", pa.table({"sample_id": pa.array([5, 2, 38, 7], pa.int64()),
                                       "split": ["test", "val", "train", None]}))
    u.commit()
    w.finalize([unit_name(0)])
    sp = Splits(Artifact(tmp_path / "samples"))
    ids = [2, 5, 7, 38, 39, 40]
    assert sp.recorded(ids).tolist() == ["val", "test", None, "train", None, None]
    # no recorded split (7: null, 39 / 40: not in the table): sample_id % 20, 18 -> val, 19 -> test
    assert sp.of_many(ids).tolist() == ["val", "test", "train", "train", "test", "train"]
    assert sp(38) == "train" and hash_split([38]).tolist() == ["val"]
    assert sp.mask(ids, ["test"]).tolist() == [False, True, False, False, True, False]
    assert Splits.of_manifest(type("M", (), {"output": str(tmp_path / "nowhere")})()).of_many([18]).tolist() == ["val"]


def test_default_sugarcrepe_folder_is_the_generated_datasets_only(tmp_path):
    from pipeline.config import load_manifest
    from train.eval.in_job import generated_sugarcrepe_dirs

    m = load_manifest(None, [f"output={tmp_path / 'out'}", "dataset.kind=synthetic"])
    assert generated_sugarcrepe_dirs(m, None) == [tmp_path / "out" / "source" / "synthetic" / "sugarcrepe"]
    m = load_manifest(None, [f"output={tmp_path / 'out'}", "dataset.kind=synthetic", f"dataset.synthetic.root={tmp_path / 'g'}"])
    assert generated_sugarcrepe_dirs(m, None) == [tmp_path / "g" / "sugarcrepe"]
    assert generated_sugarcrepe_dirs(m, ["/a", "b"]) == [Path("/a"), Path("b")]
    assert generated_sugarcrepe_dirs(m, []) == []
    m = load_manifest(None, [f"output={tmp_path / 'out'}", "dataset.kind=coco", "dataset.captions=c.json"])
    assert generated_sugarcrepe_dirs(m, None) == []


def _write_kind(d: Path, kind: str, n: int, image=lambda k: f"{k:012d}.jpg") -> None:
    d.mkdir(parents=True, exist_ok=True)
    rows = {str(k): {"filename": image(k), "caption": f"{kind} pos {k}", "negative_caption": f"{kind} neg {k}"} for k in range(n)}
    (d / f"{kind}.json").write_text(json.dumps(rows))


def test_folders_merge_kinds_and_cap_each_kind_in_file_order(tmp_path):
    from train.eval.in_job import read_folders

    _write_kind(tmp_path / "a", "swap_att", 4)
    _write_kind(tmp_path / "a", "add_obj", 2)
    _write_kind(tmp_path / "b", "swap_att", 3, image=lambda k: f"b{k}.jpg")
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "notes.json").write_text("{}")  # no SugarCrepe kind: the folder is not read
    data, available = read_folders("sc", [tmp_path / "a", tmp_path / "missing", tmp_path / "c", tmp_path / "b"], 5)
    assert available == 9
    swap = [it for it in data.items if it.subset == "swap_att"]
    assert [it.pairs[0].image for it in swap] == [f"{k:012d}.jpg" for k in range(4)] + ["b0.jpg"]
    assert [it.pairs[1].text for it in swap][:2] == ["swap_att neg 0", "swap_att neg 1"]
    assert sum(it.subset == "add_obj" for it in data.items) == 2
    assert read_folders("sc", [tmp_path / "missing", tmp_path / "c"]) == (None, 0)


def test_in_job_swaps_are_the_harness_scores(tmp_path, monkeypatch):
    """visual-tokens' in-job generated_swaps rows equal the harness's own SugarCrepe rows of the same
    folder (train eval), kind by kind; a kind with no scorable image is NaN."""
    import torch

    import pipeline.models.clip
    from pipeline.config import load_manifest
    from train.eval.harness import run_harness
    from train.jobs.visual_tokens import make_job

    out = tmp_path / "out"
    write_vt_artifacts(out)
    d = tmp_path / "swaps"
    _write_kind(d, "swap_att", 12, image=lambda k: f"{k + 1:012d}.jpg")
    _write_kind(d, "replace_rel", 2, image=lambda k: f"{[3, 11][k]:012d}.jpg")  # images the job cannot score

    def fake(spec, man, texts, chunk=128):  # a frozen "text tower" of random 16-d tokens per text
        g = [np.random.default_rng(sum(t.encode())) for t in texts]
        tok = torch.stack([torch.from_numpy(x.normal(size=(4, 16)).astype(np.float32)) for x in g])
        return {"tokens": tok, "mask": torch.ones(len(texts), 4, dtype=torch.bool),
                "embed": torch.stack([torch.from_numpy(x.normal(size=8).astype(np.float32)) for x in g])}

    monkeypatch.setattr(pipeline.models.clip, "encode_texts_like_artifact", fake)
    sets = [f"output={out}", *[f"train.visual_tokens.{s}" for s in (
        "layers=1", "heads=2", "width=16", "ff_dim=32", "embed_dim=8", "image_mlp_hidden=16", "text_layers=1",
        "context_length=12", "eval_splits=[test]", f"swap_dirs=[{d}]")],
        f"eval.benchmarks=[{{name: sc, format: sugarcrepe, path: {d}}}]"]
    m = load_manifest(None, sets)
    job = make_job(m.train.visual_tokens, m, tmp_path / "run", torch.device("cpu"))
    torch.manual_seed(0)
    model = job.build_model().eval()
    with torch.no_grad():
        res = job.evaluate(model, tmp_path / "ev")
        table, errors = run_harness(job, model, m, tmp_path / "h", job_metrics=False)
    ref = {r["subset"]: r for r in table if r["benchmark"] == "sc" and not r["baseline_for"]}  # not [frozen] / [text-only]
    assert not errors and ref["swap_att"]["n"] == 12 - 3  # samples 3, 5, 11 skipped (8 has no captions: scorable)
    assert res["generated_swaps/swap_att/pairwise_acc"] == ref["swap_att"]["value"]
    assert np.isnan(res["generated_swaps/replace_rel/pairwise_acc"]) and "replace_rel" not in ref


def test_score_folders_counts_matched_and_available_items(tmp_path):
    """``matched``: items whose image is in the samples artifact, scored or not (the concept-ot
    ``sugarcrepe/triples`` figure); ``available``: every item read, before max_per_kind."""
    from types import SimpleNamespace

    from train.eval.in_job import score_folders

    out = tmp_path / "out"
    write_vt_artifacts(out)  # samples 1..40
    d = tmp_path / "sc"
    _write_kind(d, "swap_att", 6, image=lambda k: f"{[1, 2, 3, 4, 999, 6][k]:012d}.jpg")  # 999: not in samples
    _write_kind(d, "replace_obj", 3)  # images 0 (not in samples), 1, 2
    job = SimpleNamespace(scorable_sample_ids=lambda: [1, 2, 4, 6],  # 3: in samples, not scorable
                          score_pairs=lambda model, s, t, b=None: np.array([float("pos" in x) for x in t]))
    got = score_folders(job, None, "sc", [d], out / "samples")
    assert got.available == 9 and got.matched == 5 + 2 and got.kinds == ["replace_obj", "swap_att"]
    by = {r.subset: r for r in got.rows}
    assert by["swap_att"].n == 4 and by["swap_att"].value == 100.0 and by["replace_obj"].n == 2
    capped = score_folders(job, None, "sc", [d], out / "samples", max_per_kind=2)
    assert capped.available == 9 and capped.matched == 2 + 1
