"""ImageMatcher: benchmark image keys -> samples sample_id, across naming schemes."""
from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pytest

from train.eval.images import ImageMatcher, numeric_id, read_image_map

SAMPLES = {
    "sample_id": [0, 1, 2, 3, 4, 5, 6],
    "source_id": ["391895", "2358789", "1000092795", "1", "ex_a", "77", "78"],
    "image": ["/data/coco/val2014/COCO_val2014_000000391895.jpg", "/data/vg/VG_100K/2358789.jpg",
              "/data/flickr/1000092795.jpg", "/runs/demo/source/synthetic/images/000000000001.jpg",
              "/data/tars/shard0.tar::inner/photo_a.png", "/x/dup.jpg", "/y/dup.jpg"],
}


@pytest.fixture()
def matcher():
    return ImageMatcher(pa.table(SAMPLES))


def test_numeric_id_only_where_the_id_is_the_identifier():
    assert numeric_id("COCO_val2014_000000391895.jpg") == 391895
    assert numeric_id("val2014/COCO_val2014_000000391895.jpg") == 391895
    assert numeric_id("000000391895.jpg") == 391895
    assert numeric_id("2358789") == 2358789
    assert numeric_id("ex_0_img_1") is None and numeric_id("photo_12.jpg") is None


def test_coco_names_across_schemes(matcher):
    # Karpathy, SugarCrepe, source id and a plain int all reach the same sample
    for key in ("COCO_val2014_000000391895.jpg", "val2014/COCO_val2014_000000391895.jpg", "000000391895.jpg",
                "391895", 391895, "COCO_train2014_000000391895"):
        assert matcher.match(key) == 0, key


def test_vg_flickr_synthetic_and_tar_members(matcher):
    assert matcher.match("vg/VG_100K/2358789.jpg") == 1 and matcher.match("2358789.jpg") == 1
    assert matcher.match("flickr30k-images/1000092795.jpg") == 2
    assert matcher.match("000000000001.jpg") == 3 and matcher.match("000000000001") == 3
    assert matcher.match("photo_a.png") == 4 and matcher.match("photo_a") == 4 and matcher.match("ex_a") == 4
    # an id inside a longer stem is not an id: Winoground's ex_12_img_1 must not reach image 1
    assert matcher.match("ex_12_img_1") is None
    assert matcher.match("nothing.jpg") is None


def test_ambiguous_keys_match_nothing_at_that_level(matcher):
    assert matcher.match("dup.jpg") is None
    s = matcher.summary(["dup.jpg", "391895", "2358789.jpg", "missing.png"])
    assert (s.total, s.matched, s.ambiguous) == (4, 2, 1)
    assert s.by_rule == {"source_id": 1, "file_name": 1}
    assert "2 of 4 images matched" in s.line() and "'dup.jpg'" in s.line()


def test_match_many_vectorised_and_minus_one(matcher):
    ids = matcher.match_many(["000000391895.jpg", "nope", "000000391895.jpg", "2358789"])
    assert ids.dtype == np.int64 and ids.tolist() == [0, -1, 0, 1]


def test_explicit_map_csv_and_json(tmp_path):
    csv_path = tmp_path / "map.csv"
    csv_path.write_text("key,source_id\nex_0_img_0,391895\nex_0_img_1,/anything/2358789.jpg\nbad,404\n")
    m = ImageMatcher(pa.table(SAMPLES), image_map=csv_path)
    assert m.match("ex_0_img_0") == 0 and m.match("images/ex_0_img_1") == 1
    assert m.match("bad") is None  # the map points at nothing: unresolved, not a guess
    s = m.summary(["ex_0_img_0", "bad"])
    assert s.by_rule == {"map": 1} and s.map_unresolved == 1
    js = tmp_path / "map.json"
    js.write_text(json.dumps({"w1": "1000092795"}))
    assert ImageMatcher(pa.table(SAMPLES), image_map=js).match("w1") == 2
    js.write_text(json.dumps([["w2", "photo_a.png"]]))
    assert ImageMatcher(SAMPLES, image_map=js).match("w2") == 4
    (tmp_path / "bad.csv").write_text("only_one_column\n")
    with pytest.raises(ValueError, match=r"bad.csv: row 1 has 1 column"):
        read_image_map(tmp_path / "bad.csv")


def test_reads_the_samples_artifact(tmp_path):
    """The matcher reads the ingest stage's samples artifact (a folder) directly."""
    from pipeline.io.artifacts import Artifact

    d = tmp_path / "samples"
    (d / "samples").mkdir(parents=True)
    import pyarrow.parquet as pq

    tab = pa.table({"sample_id": pa.array([0, 1], pa.int64()), "source_id": ["5", "6"],
                    "image": ["/i/000000000005.jpg", "/i/000000000006.jpg"], "split": ["train", "test"]})
    pq.write_table(tab, d / "samples" / "part-00000.parquet")
    (d / "_manifest.json").write_text(json.dumps({"artifact": "samples", "tables": {"samples": {"rows": 2}},
                                                  "shards": [{"table": "samples", "path": "samples/part-00000.parquet"}]}))
    assert Artifact(d).read("samples").num_rows == 2
    m = ImageMatcher(d)
    assert m.match("000000000006.jpg") == 1 and m.match("5") == 0
