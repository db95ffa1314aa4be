"""manifests/own-{webdataset,cc3m,folder}.yaml on the generated example in each layout
(pipeline/synthetic/own_formats.py): ingest records the hashed held-out split of every image
(dataset.splits, also in the samples' _manifest.json); then the caption stage (mine-concepts), CLIP
tokens and a concept-ot run whose evaluation holds exactly the test split's images."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pipeline.io.artifacts import Artifact
from pipeline.readers.splits import split_of
from pipeline.stage import RunContext, run_stage
from tests.conftest import REPO, make_manifest

FORMATS = {
    "webdataset": lambda d: [f"dataset.path={d / 'webdataset'}"],
    "cc3m": lambda d: [f"dataset.captions={d / 'cc3m' / 'captions.tsv'}"],
    "folder": lambda d: [f"dataset.images={d / 'folder' / 'images'}", f"dataset.captions={d / 'folder' / 'captions.tsv'}"],
}


@pytest.fixture(scope="module")
def own(tmp_path_factory):
    from pipeline.synthetic.own_formats import write_layouts

    root = tmp_path_factory.mktemp("own")
    write_layouts(root, n_images=80, seed=2, image_size=64)
    return root


def _manifest(fmt, own, tmp_path):
    return make_manifest(tmp_path, [*FORMATS[fmt](own), "ray.num_cpus=1"], path=REPO / "manifests" / f"own-{fmt}.yaml")


def _ingest(fmt, own, tmp_path):
    m = _manifest(fmt, own, tmp_path)
    run_stage("ingest", RunContext(m))
    art = Artifact(Path(m.output) / "samples")
    t = art.read("samples", ["sample_id", "source_id", "image", "split"]).to_pylist()
    return m, art, t


def _key(fmt, row, own):
    """The split key each layout documents, found independently of the reader: the folder's relative
    path, the TSV's path as written, the url img2dataset recorded for the sample (its shard's parquet)."""
    import pyarrow.parquet as pq

    if fmt == "folder":
        return row["source_id"]
    if fmt == "cc3m":
        return "images/" + Path(row["image"]).name
    tar, member = row["image"].split("::", 1)
    key = member.split(".", 1)[0]
    urls = {r["key"]: r["url"] for r in pq.read_table(own / "webdataset" / (Path(tar).stem + ".parquet")).to_pylist()}
    return urls[key]


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_own_manifest_ingest_records_hashed_splits(fmt, own, tmp_path, ray_session):
    m, art, rows = _ingest(fmt, own, tmp_path)
    assert len(rows) == 80
    for r in rows:
        assert r["split"] == split_of(_key(fmt, r, own), 0.1, 0.1, 0), r
    assert {r["split"] for r in rows} == {"train", "val", "test"}
    params = json.loads((art.dir / "_manifest.json").read_text())["parameters"]["dataset"]
    assert params["kind"] == m.dataset.kind and params["splits"] == {"by": "key_hash", "val": 0.1, "test": 0.1, "seed": 0}


@pytest.mark.slow
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_own_manifest_caption_stage_and_held_out_eval(fmt, own, tmp_path, ray_session):
    from typer.testing import CliRunner

    from train.cli import app

    m, art, rows = _ingest(fmt, own, tmp_path)
    ctx = RunContext(m)
    concepts = run_stage("mine-concepts", ctx)
    assert concepts["samples"] == 80 and concepts["concept_rows"] > 0
    assert run_stage("extract-clip-tokens", ctx)["units_run"] >= 1
    man = tmp_path / "m.yaml"
    man.write_text((REPO / "manifests" / f"own-{fmt}.yaml").read_text())
    args = ["run", "concept-ot", "--manifest", str(man), "--no-progress", "--json", "--set", f"output={m.output}",
            "--set", "train.concept_ot.max_steps=2", "--set", "train.concept_ot.threads=1",
            "--set", "train.concept_ot.heatmaps=0"]
    for s in FORMATS[fmt](own):
        args += ["--set", s]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    run_dir = Path(json.loads(r.stdout.strip().splitlines()[-1])["run_dir"])
    metrics = json.loads((run_dir / "eval" / "final" / "metrics.json").read_text())
    test = {x["sample_id"] for x in rows if x["split"] == "test"}
    caps = art.read("captions", ["sample_id"]).column("sample_id").to_pylist()
    assert metrics["eval_images"] == len(test) and metrics["eval_captions"] == sum(c in test for c in caps)
    assert np.isclose(metrics["chance/i2t_R@1"], 100 / len(test))
