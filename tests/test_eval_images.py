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


COCO_RUN = {"sample_id": [0, 1], "source_id": ["391895", "1"], "image": ["000000391895.jpg", "000000000001.jpg"]}
FOREIGN = {"vg/VG_100K/391895.jpg": "Visual Genome", "vg/VG_100K/391895": "Visual Genome",
           "VisualDialog_val2018_000000391895.jpg": "VisDial", "HICO_test2015_00000001.jpg": "HICO",
           "hake/hico_20160224_det/images/test2015/HICO_test2015_00000001.jpg": "HICO", "swig/1.jpg": "SWiG",
           "hake/hcvrd/1.jpg": "HAKE"}


@pytest.mark.parametrize("dataset", [None, "COCO"])
def test_a_number_matches_only_where_the_name_says_it_is_that_datasets_image(dataset):
    """A COCO-numbered run: COCO names and bare ids match; VG / VisDial / HICO / SWiG names with the
    same numbers are foreign (skipped, counted by dataset), not COCO images 391895 and 1."""
    m = ImageMatcher(pa.table(COCO_RUN), dataset=dataset)
    for key in ("COCO_val2014_000000391895.jpg", "val2017/000000391895.jpg", "391895", "000000391895.jpg",
                "hake/vcoco/val2014/COCO_val2014_000000391895.jpg"):  # HAKE's V-COCO images are COCO's
        assert m.match(key) == 0, key
    for key, ds in FOREIGN.items():
        assert m.match(key) is None and m.skip_reason(key) == f"foreign_dataset: {ds}", key
    assert m.skip_reason("COCO_val2014_000000000404.jpg") == "skipped_no_image: not in samples"
    s = m.summary([*FOREIGN, "1"])
    assert s.matched == 1 and s.foreign == {"HAKE": 1, "HICO": 2, "SWiG": 1, "VisDial": 1, "Visual Genome": 2}
    assert "foreign (the run holds none of their dataset): HAKE 1, HICO 2" in s.line()
    # an explicit image_map always wins
    mapped = ImageMatcher(pa.table(COCO_RUN), image_map={"vg/VG_100K/391895.jpg": "391895"}, dataset=dataset)
    assert mapped.match("vg/VG_100K/391895.jpg") == 0


def test_flickr_and_generated_runs_match_their_own_names():
    fl = ImageMatcher(pa.table({"sample_id": [0], "source_id": ["0"], "image": ["1000092795.jpg"]}), dataset="Flickr30k")
    assert fl.match("flickr30k-images/1000092795.jpg") == 0 and fl.match("1000092795") == 0
    assert fl.match("vg/VG_100K/1000092795.jpg") is None
    assert fl.skip_reason("COCO_val2014_000000000000.jpg") == "foreign_dataset: COCO"
    gen = ImageMatcher(pa.table({"sample_id": [0, 1], "source_id": ["1", "2"],
                                 "image": ["images/000000000001.jpg", "images/000000000002.jpg"]}), dataset="synthetic")
    for key in ("000000000001.jpg", "images/000000000001.jpg", "000000000001", "1"):
        assert gen.match(key) == 0, key
    assert gen.match("COCO_val2014_000000000001.jpg") is None and gen.match("vg/VG_100K/2.jpg") is None
    assert gen.skip_reason("vg/VG_100K/2.jpg") == "foreign_dataset: Visual Genome"
    # and the other way: SugarCrepe's COCO 2017 names do not reach a Visual Genome run's image 2; a bare id does
    vg = ImageMatcher(pa.table({"sample_id": [0], "source_id": ["2"], "image": ["VG_100K/2.jpg"]}))
    assert vg.match("000000000002.jpg") is None and vg.skip_reason("000000000002.jpg") == "foreign_dataset: COCO"
    assert vg.match("2.jpg") == 0 and vg.match("2") == 0


def test_the_samples_artifact_says_its_dataset(tmp_path):
    """ingest records dataset_kind (karpathy: by its captions file) in samples/_manifest.json."""
    from pipeline.io.artifacts import ArtifactWriter

    for kind, captions, want in (("coco", "a.json", "COCO"), ("karpathy", "dataset_flickr30k.json", "Flickr30k"),
                                 ("synthetic", None, "synthetic"), ("folder", None, None)):
        w = ArtifactWriter(tmp_path / kind, "samples", "ingest", {"dataset": {"kind": kind, "captions": captions}})
        uw = w.unit_writer("00000", "fp")
        uw.write_table("samples", pa.table({"sample_id": pa.array([0], pa.int64()), "source_id": ["7"],
                                            "image": ["imgs/7.jpg"]}))
        uw.commit({"rows": 1})
        w.finalize(["00000"], extra={"dataset_kind": kind})
        m = ImageMatcher(tmp_path / kind / "samples")
        assert m.dataset == want, kind
        assert m.match("7") == 0
        # a run of unknown dataset takes a named key only by its exact file name, never by number alone
        assert m.match("vg/VG_100K/7.jpg") == (0 if want is None else None)
        assert m.match("VisualDialog_val2018_000000000007.jpg") is None
