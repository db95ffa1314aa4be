"""Relations from pixels, reduced, through the real commands (issue 46, items 3 and 5): manifests/pixels.yaml at
30 testbed and 80 corpus images; `pipeline run ingest --corpus`, `pipeline run extract-visual-tokens --corpus`,
`train run relation-encoder` (exports <output>/encoders/relations), then the testbed's `extract-visual-tokens` with
``relations: learned`` loading that folder through ``models.relation_head: "{output}/encoders/relations"``, and
benchmarks/relation_graphs.py on what it wrote.

Expected before running (the CLIP pools of a tiny random CLIP under the ground-truth masks stand in for the trained
encoders, so no encoder is trained here; nothing is asserted about how well the head learns at this size):

* on the corpus, relations: learned is refused in one line; with relations=geometric the corpus's visual tokens are
  written under <output>/corpus and none under <output>;
* the relation encoder trains on the corpus's 64 training images only (80 at held-out 0.2), every mapped relation
  kept by the matching (the instances are the ground-truth masks: IoU 1), exports relation_head.pt and
  training.json saying "trained here on the corpus", and reports held-out recall@1/3/5 beside the boxes-only rows;
* the evaluator is exact where the answer is known: on the testbed's `relations: annotations` graphs precision and
  recall are 100; on its `relations: geometric` graphs the artifact's figures equal those of the evaluator's own
  geometric predictor on the same instances;
* the testbed's relations: learned stage loads the export and records its provenance, and writes triplets.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = [pytest.mark.slow, pytest.mark.heavy, pytest.mark.timeout(2400)]

REPO = Path(__file__).resolve().parents[1]


def _run(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True)


def _ok(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def _graphs(mp: Path) -> dict:
    return json.loads(_ok(_run("benchmarks/relation_graphs.py", "-m", str(mp), "--json")).strip().splitlines()[-1])


def test_relations_from_pixels_through_the_commands(tmp_path):
    m = yaml.safe_load((REPO / "manifests" / "pixels.yaml").read_text())
    out = tmp_path / "p"
    m["output"] = str(out)
    m["ray"] = {"address": None, "num_cpus": 2, "object_store_memory": 134217728}
    m["dataset"]["synthetic"]["n_images"] = 30
    m["corpus"]["n_images"] = 80
    # the manifest's clip_pool tokens on the annotations' masks (no SAM is loaded: the trained SAM is
    # tests/test_sam_segmenter_slow.py's), pooled from a random CLIP
    assert m["stages"]["extract_visual_tokens"]["embedding"] == "clip_pool"
    m["models"]["clip"] = "tiny-random"
    m["stages"]["extract_visual_tokens"]["segmenter"] = "annotations"
    m["models"]["predicate_encoder"] = "tiny-random"
    m["eval"] = {"benchmarks": []}
    m["stages"]["extract_visual_tokens"]["shard_size"] = 40
    m["train"]["relation_encoder"].update(epochs=4, boxes_only_steps=30, batch_size=16)
    mp = tmp_path / "nogt-small.yaml"
    mp.write_text(yaml.safe_dump(m, sort_keys=False))
    assert m["models"]["relation_head"] == "{output}/encoders/relations"
    pipe = ("-m", "pipeline.cli", "run")

    _ok(_run(*pipe, "ingest", "-m", str(mp)))
    _ok(_run(*pipe, "ingest", "-m", str(mp), "--corpus"))
    r = _run(*pipe, "extract-visual-tokens", "-m", str(mp), "--corpus")
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith(
        "error: --corpus: stages.extract_visual_tokens.relations is learned")
    _ok(_run(*pipe, "extract-visual-tokens", "-m", str(mp), "--corpus", "--set", "stages.extract_visual_tokens.relations=geometric"))
    assert (out / "corpus" / "visual_tokens" / "_manifest.json").is_file() and not (out / "visual_tokens").exists()

    res = json.loads(_ok(_run("-m", "train.cli", "run", "relation-encoder", "-m", str(mp), "--json", "--no-progress")
                         ).strip().splitlines()[-1])
    export = out / "encoders" / "relations"
    info = json.loads((export / "training.json").read_text())
    assert (export / "relation_head.pt").is_file() and info["trained"] == "trained here on the corpus"
    assert info["train_images"] == 64 and info["held_out_images"] == 16
    assert info["label_stats"]["train"]["relations_kept_fraction"] == 1.0
    assert info["label_stats"]["held_out"]["relations_kept_fraction"] == 1.0
    import pyarrow.parquet as pq

    table = [r for r in pq.read_table(Path(res["run_dir"]) / "eval" / "final" / "results.parquet").to_pylist()
             if r["benchmark"] == "relation-encoder"]
    rows = {r["metric"]: r for r in table if r["subset"] == "held_out"}
    for k in (1, 3, 5):
        assert rows[f"recall@{k}[boxes-only]"]["baseline_for"] == f"held_out/recall@{k}"
        assert rows[f"recall@{k}"]["n"] == rows[f"recall@{k}[boxes-only]"]["n"] > 0
        # mR@K is the mean of the per-predicate rows (subset predicate:<p>) of the same model
        per = [r["value"] for r in table if r["subset"].startswith("predicate:") and r["metric"] == f"recall@{k}"]
        assert per and rows[f"mean_recall@{k}"]["value"] == pytest.approx(sum(per) / len(per))
    for name in ("recall@{}", "recall@{}[boxes-only]"):  # the top 1 is in the top 3, the top 3 in the top 5
        assert rows[name.format(1)]["value"] <= rows[name.format(3)]["value"] <= rows[name.format(5)]["value"]

    # the evaluator where the answer is known: the ground truth's own graphs, then the stage's geometric predictor
    _ok(_run(*pipe, "extract-visual-tokens", "-m", str(mp), "--set", "stages.extract_visual_tokens.relations=annotations"))
    g = _graphs(mp)
    a = g["artifact"]
    assert a["correct"] == a["predicted"] > 0 and a["recovered"] == a["gt_triples"]
    assert a["precision"] == pytest.approx(100.0) and a["recall"] == pytest.approx(100.0)
    assert g["artifact"]["gt_triples"] == g["stats"]["gt_triples"] > 0
    _ok(_run(*pipe, "extract-visual-tokens", "-m", str(mp), "--set", "stages.extract_visual_tokens.relations=geometric"))
    g = _graphs(mp)
    for key in ("predicted", "correct", "recovered", "precision", "recall"):
        assert g["artifact"][key] == g["geometric"][key], key

    # the testbed's relations from the relation encoder's export, through {output}
    _ok(_run(*pipe, "extract-visual-tokens", "-m", str(mp)))
    man = json.loads((out / "visual_tokens" / "_manifest.json").read_text())
    assert man["parameters"]["relations"] == "learned"
    rec = man["models"]["relation_head"]
    assert rec["trained_on"]["trained"] == "trained here on the corpus" and rec["spec"].endswith("encoders/relations/relation_head.pt")
    g = _graphs(mp)
    assert g["artifact"]["predicted"] > 0 and g["stats"]["relations_on_predicted"] == "learned"
    table = _ok(_run("benchmarks/relation_graphs.py", "-m", str(mp)))
    assert "| relations: learned |" in table and "| geometric (same instances) |" in table
