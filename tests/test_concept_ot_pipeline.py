"""concept-ot on a real `clip_tokens` artifact: the generated dataset encoded by the stage's own
worker with tiny-random CLIP (no Ray), then `train run` + `train eval` through the CLI, with the
SugarCrepe-format files the generator writes (texts encoded by the CLIP text tower at eval)."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

from tests.test_clip_tokens import run_in_process


def test_concept_ot_on_generated_clip_tokens(tmp_path):
    from typer.testing import CliRunner

    from pipeline.io.artifacts import ArtifactWriter, unit_name
    from pipeline.synthetic.generate import generate, split_of
    from train.cli import app

    root = tmp_path / "synthetic"
    paths = generate(root, n_images=40, seed=1, image_size=64, captions_per_image=2, workers=1)
    coco = json.loads(paths["captions"].read_text())
    recs = []
    caps: dict[int, list] = {}
    for a in coco["annotations"]:
        caps.setdefault(a["image_id"], []).append([a["id"], a["caption"]])
    for k, im in enumerate(sorted(coco["images"], key=lambda x: x["id"])):
        recs.append({"sample_id": im["id"], "source_id": im["file_name"], "image": str(paths["images"] / im["file_name"]),
                     "captions": sorted(caps.get(im["id"], [])), "split": split_of(k)})
    out = tmp_path / "run"
    w = ArtifactWriter(out, "samples", "ingest", {})
    u = w.unit_writer(unit_name(0), "fp")
    u.write_table("samples", pa.table({"sample_id": pa.array([r["sample_id"] for r in recs], pa.int64()),
                                       "source_id": [r["source_id"] for r in recs], "image": [r["image"] for r in recs],
                                       "width": [64] * len(recs), "height": [64] * len(recs),
                                       "split": [r["split"] for r in recs]}))
    u.write_table("captions", pa.table({"caption_id": pa.array([c for r in recs for c, _ in r["captions"]], pa.int64()),
                                        "sample_id": pa.array([r["sample_id"] for r in recs for _ in r["captions"]], pa.int64()),
                                        "text": [t for r in recs for _, t in r["captions"]]}))
    # the annotation tables ingest writes for the generated dataset: instances (COCO boxes) and
    # phrases (caption spans linked to instances, from the scene-graph file)
    inst = json.loads(paths["instances"].read_text())["annotations"]
    u.write_table("instances", pa.table({
        "sample_id": pa.array([a["image_id"] for a in inst], pa.int64()), "instance_id": pa.array([a["id"] for a in inst], pa.int64()),
        "category": [str(a["category_id"]) for a in inst],
        "box": pa.array([[a["bbox"][0], a["bbox"][1], a["bbox"][0] + a["bbox"][2], a["bbox"][1] + a["bbox"][3]] for a in inst],
                        pa.list_(pa.float32(), 4)),
        "mask_rle": [""] * len(inst), "attributes": [""] * len(inst)}))
    graphs = json.loads(paths["scene_graphs"].read_text())
    graphs = graphs if isinstance(graphs, list) else graphs.get("images", graphs.get("graphs", []))
    ph = [(g["image_id"], p) for g in graphs for p in g.get("phrases", [])]
    u.write_table("phrases", pa.table({
        "caption_id": pa.array([p["caption_id"] for _, p in ph], pa.int64()), "sample_id": pa.array([s for s, _ in ph], pa.int64()),
        "start": pa.array([p["start"] for _, p in ph], pa.int32()), "end": pa.array([p["end"] for _, p in ph], pa.int32()),
        "text": [p["text"] for _, p in ph], "instance_ids": pa.array([p["instance_ids"] for _, p in ph], pa.list_(pa.int64()))}))
    u.commit()
    w.finalize([unit_name(0)])
    run_in_process(out, [{k: r[k] for k in ("sample_id", "source_id", "image", "captions")} for r in recs], shard_size=16)
    man = tmp_path / "m.yaml"
    man.write_text(f"name: t\noutput: {out}\ndataset: {{kind: synthetic, synthetic: {{root: {root}}}}}\n"
                   "models: {clip: tiny-random}\n")
    sets = ["--set", "train.concept_ot.max_steps=3", "--set", "train.concept_ot.batch_size=8",
            "--set", "train.concept_ot.eval_splits=[train,val,test]", "--set", "train.concept_ot.eval_max_images=16",
            "--set", "train.concept_ot.heatmaps=1", "--set", f"train.concept_ot.sugarcrepe_dirs=[{root / 'sugarcrepe'}]"]
    runner = CliRunner()
    r = runner.invoke(app, ["run", "concept-ot", "--manifest", str(man), "--no-progress", "--json", *sets])
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert "sugarcrepe/error" not in res, res
    assert res["sugarcrepe/triples"] > 0 and 0 <= res["sugarcrepe/overall"] <= 100
    assert res["eval_images"] == 16 and "rerank/t2i_R@5" in res
    run_dir = out / "train" / "concept-ot" / json.loads(r.stdout.strip().splitlines()[-1])["run_dir"].rsplit("/", 1)[-1]
    assert run_dir.name.startswith("conceptot-") and run_dir.is_dir()
    assert list((run_dir / "eval" / "final").glob("heatmap_*.png")) and (run_dir / "metrics.png").is_file()
    # Sec. 2.6 box prediction on the generated phrases (tiny-random CLIP: no claim beyond being scored)
    assert res["grounding/phrases"] > 20 and 0 <= res["grounding/acc@IoU0.5"] <= 100
    assert 0 <= res["grounding/mean_IoU"] <= 1 and 0 <= res["chance/grounding_mean_IoU"] <= 1
    # `train eval` takes the run's training options from the checkpoint (no --set needed) and writes
    # into the run folder; --job-eval reruns the job's own evaluation
    r = runner.invoke(app, ["eval", "concept-ot", "--checkpoint", str(run_dir / "checkpoints" / "final.pt"),
                            "--manifest", str(man), "--job-eval", "--set", f"train.concept_ot.sugarcrepe_dirs=[{root / 'sugarcrepe'}]",
                            "--set", "train.concept_ot.eval_splits=[train,val,test]", "--set", "train.concept_ot.eval_max_images=16"])
    assert r.exit_code == 0, r.output
    import polars as pl

    ev = sorted(run_dir.glob("eval/step*/results.parquet"))
    assert ev, r.output
    t = pl.read_parquet(ev[-1])
    g = t.filter(pl.col("benchmark") == "grounding")
    assert set(g["metric"].to_list()) == {"acc@IoU0.5", "mean_IoU"} and (g["n"] > 20).all()
    assert g["chance"].is_not_null().all()
    assert ((g["ci_low"] <= g["value"]) & (g["value"] <= g["ci_high"]) & (g["ci_low"] < g["ci_high"])).all()
    again = json.loads((ev[-1].parent / "metrics.json").read_text())
    assert again["sugarcrepe/overall"] == pytest.approx(res["sugarcrepe/overall"], abs=1e-3)  # the run line is rounded
