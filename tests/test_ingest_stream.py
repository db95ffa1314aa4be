"""Streaming ingest: the reader is consumed wave by wave (never the whole dataset in the driver),
the output equals the reader's records in order, COCO polygons are rasterised in the workers,
a bad polygon is a counted sample error, and a rerun with nothing to do runs nothing."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from pipeline.io.artifacts import Artifact
from pipeline.stage import RunContext, run_stage
from tests.conftest import make_manifest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_ingest_stream import generate  # noqa: E402  (the benchmark's WebDataset generator)


@pytest.fixture
def waves(monkeypatch):
    """map_units in process; records, per call, the units handed over and how many records the
    reader had yielded by then."""
    import pipeline.readers
    import pipeline.runtime
    import pipeline.stage

    log = {"read": 0, "calls": [], "payloads": []}
    real = pipeline.readers.read_dataset

    def counting(*a, **k):
        for r in real(*a, **k):
            log["read"] += 1
            yield r

    def local_map(units, fn, *, ray_cfg=None, actor=False, **kw):
        log["calls"].append((len(units), log["read"]))
        log["payloads"].extend(units)
        for u in units:
            yield json.loads(json.dumps(fn(json.loads(json.dumps(u)))))

    monkeypatch.setattr(pipeline.readers, "read_dataset", counting)
    monkeypatch.setattr(pipeline.stage, "map_units", local_map)
    monkeypatch.setattr(pipeline.runtime, "map_units", local_map)
    return log


def test_webdataset_streams_in_bounded_waves(tmp_path, waves):
    root = tmp_path / "wds"
    generate(root, 230)
    ov = ["dataset.kind=webdataset", f"dataset.path={root}", "stages.ingest.shard_size=10", "stages.ingest.verify_images=decode"]
    m = make_manifest(tmp_path, ov)  # ray.num_cpus=2: waves of 4 x 2 = 8 units = 80 records
    run_stage("ingest", RunContext(m))
    sizes = [n for n, _ in waves["calls"]]
    assert sizes == [8, 8, 7]  # 23 units in three waves
    for k, (_, read) in enumerate(waves["calls"]):
        # when wave k is handed over, the reader has produced that wave's records (+1 look-ahead), not the dataset
        assert read <= (k + 1) * 80 + 1, (k, read)
    art = Artifact(Path(m.output) / "samples")
    t = art.read("samples", columns=["sample_id", "source_id", "image", "width"]).sort_by("sample_id")
    assert t.column("sample_id").to_pylist() == list(range(230))
    assert t.column("source_id").to_pylist() == [f"{i:09d}" for i in range(230)]
    assert t.column("image").to_pylist()[0] == "00000.tar::000000000.jpg"  # relative to the WebDataset folder
    assert set(t.column("width").to_pylist()) == {8}  # decoded in the workers
    caps = art.read("captions", columns=["caption_id", "sample_id"]).sort_by("caption_id")
    assert caps.column("caption_id").to_pylist() == list(range(230))
    # rerun: every unit complete, nothing handed to workers
    waves["calls"].clear()
    run_stage("ingest", RunContext(m))
    assert waves["calls"] == []


def synth(m):
    """The manifest's generated dataset, exactly as ingest generates it."""
    from pipeline.synthetic.generate import generate

    s = m.dataset.synthetic
    return generate(Path(m.output) / "source" / "synthetic", n_images=s.n_images, seed=s.seed, image_size=s.image_size,
                    captions_per_image=s.captions_per_image, min_objects=s.min_objects, max_objects=s.max_objects,
                    corrupt_images=s.corrupt_images, empty_captions=s.empty_captions)


def test_coco_polygons_rasterised_in_the_workers(tmp_path, waves):
    from pipeline.masks import rle_decode
    from pipeline.readers.coco import read_coco

    m = make_manifest(tmp_path, ["dataset.synthetic.n_images=5", "stages.ingest.shard_size=3"])
    run_stage("ingest", RunContext(m))
    handed = [inst["mask_rle"] for p in waves["payloads"] for r in p["records"] for inst in r["instances"]]
    assert handed and all(isinstance(h, dict) and "segmentation" in h for h in handed)  # raw polygons, not RLE
    art = Artifact(Path(m.output) / "samples")
    inst = art.read("instances", columns=["sample_id", "instance_id", "mask_rle"]).to_pylist()
    p = synth(m)
    ref = {i.id: i.mask_rle for r in read_coco(p["captions"], p["images"], p["instances"]) for i in r.instances}
    assert inst and {r["instance_id"] for r in inst} <= set(ref)  # (the corrupt image's sample is rejected)
    for row in inst:
        np.testing.assert_array_equal(rle_decode(json.loads(row["mask_rle"])), rle_decode(ref[row["instance_id"]]))


def test_bad_polygon_is_a_sample_error(tmp_path, waves):
    m = make_manifest(tmp_path, ["dataset.synthetic.n_images=4", "stages.ingest.shard_size=4",
                                 "dataset.synthetic.corrupt_images=0", "dataset.synthetic.empty_captions=0"])
    p = synth(m)
    data = json.loads(Path(p["instances"]).read_text())
    data["annotations"][0]["segmentation"] = [[1.0, 2.0, "x", 4.0, 5.0, 6.0]]  # a polygon with a non-number
    data["annotations"][1]["segmentation"] = [[1.0, 1.0, 60.0, 1.0, 60.0, 60.0]]  # a good polygon: rasterised
    good_id = data["annotations"][1]["id"]
    Path(p["instances"]).write_text(json.dumps(data))
    run_stage("ingest", RunContext(m))
    art = Artifact(Path(m.output) / "samples")
    errs = art.errors().to_pylist()
    assert [e["reason"] for e in errs if e["reason"] == "bad_mask"] == ["bad_mask"]
    from pipeline.masks import rle_decode

    rows = {r["instance_id"]: r for r in art.read("instances", columns=["instance_id", "mask_rle"]).to_pylist()}
    if good_id in rows:  # (unless its sample is the one rejected)
        assert rle_decode(json.loads(rows[good_id]["mask_rle"])).sum() > 1000
