"""pipeline.loaders.regions (mapped reader, random access, region counts, padding) and
train.data.ParquetMultiJoin (every row of a sample_id, across files, missing keys)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from pipeline.io.artifacts import ArtifactWriter, unit_name
from pipeline.io.wds import ShardWriter, iter_shard, sample_key


def _regions(out: Path, counts: dict[int, int], D=6, shard_size=3):
    rw = ArtifactWriter(out, "regions", "extract-regions", {})
    ids = sorted(counts)
    units = []
    for u, s0 in enumerate(range(0, len(ids), shard_size)):
        name = unit_name(u)
        units.append(name)
        uw = rw.unit_writer(name, "fp")
        with ShardWriter(uw.shard_path()) as sw:
            for sid in ids[s0:s0 + shard_size]:
                n = counts[sid]
                sw.write(sample_key(sid), {"boxes.npy": np.arange(4 * n, dtype=np.float32).reshape(n, 4) + sid,
                                           "features.npy": np.full((n, D), sid, np.float16),
                                           "scores.npy": np.linspace(1, 0.5, n).astype(np.float32),
                                           "labels.npy": np.zeros(n, np.int64), "image_size.npy": np.array([64, 48], np.int32)})
        uw.record_shard(uw.shard_path(), sw.count)
        uw.commit()
    rw.finalize(units, extra={"dims": {"feature_dim": D, "max_boxes": 30}, "backend": "detector"})
    return out / "regions"


def test_regions_reader(tmp_path):
    from pipeline.loaders.regions import RegionsReader, collate_regions, iter_shard_mapped

    counts = {3: 2, 5: 0, 9: 4, 12: 1, 40: 3}
    r = RegionsReader(_regions(tmp_path, counts))
    assert r.feature_dim == 6 and r.max_boxes == 30 and r.backend == "detector"
    assert r.sample_ids().tolist() == sorted(counts)
    assert {s: r.n_regions(s) for s in counts} == counts and r.n_regions(7) is None
    s = r.get(9)
    assert s["boxes"].shape == (4, 4) and s["features"].shape == (4, 6) and s["image_size"].tolist() == [64, 48]
    assert float(s["boxes"][0, 0]) == 9 and float(s["features"][0, 0]) == 9
    assert r.get(5)["boxes"].shape == (0, 4) and r.get(7) is None
    # the mapped iteration reads what tarfile reads
    for shard in r.shards:
        a = list(iter_shard(shard))
        b = list(iter_shard_mapped(shard))
        assert [x["__key__"] for x in a] == [x["__key__"] for x in b]
        for x, y in zip(a, b):
            for k in x:
                if k != "__key__":
                    assert np.array_equal(x[k], y[k])
    assert [x["sample_id"] for x in r] == sorted(counts)
    b = collate_regions([r.get(3), r.get(9), r.get(5)])
    assert b["features"].shape == (3, 4, 6) and b["mask"].sum(1).tolist() == [2, 4, 0]
    assert b["features"][0, 2:].sum() == 0 and b["sample_id"].tolist() == [3, 9, 5]
    assert collate_regions([r.get(9)], max_regions=2)["mask"].shape == (1, 2)
    # the fields a reader asks for: the boxes alone (the segmenter's measurement) come without the features
    only = r.get(9, ("boxes.npy",))
    assert np.array_equal(only["boxes"], s["boxes"]) and "features" not in only
    assert r.get(5, ("boxes.npy",))["boxes"].shape == (0, 4)


def test_regions_reader_names_a_sample_missing_a_field_it_was_asked_for(tmp_path):
    from pipeline.loaders.regions import _to_sample

    with pytest.raises(ValueError, match="regions sample 4: missing boxes.npy or features.npy"):
        _to_sample(4, {"boxes.npy": np.zeros((1, 4), np.float32)})
    assert _to_sample(4, {"boxes.npy": np.zeros((1, 4), np.float32)}, ("boxes.npy",))["boxes"].shape == (1, 4)


def test_regions_reader_rejects_other_artifacts(tmp_path):
    from pipeline.io.artifacts import ArtifactMissing
    from pipeline.loaders.regions import RegionsReader

    with pytest.raises(ArtifactMissing):
        RegionsReader(tmp_path / "nothing")
    w = ArtifactWriter(tmp_path, "samples", "ingest", {})
    w.finalize([])
    with pytest.raises(ValueError, match="not a regions artifact"):
        RegionsReader(tmp_path / "samples")


def test_parquet_multi_join(tmp_path):
    from train.data import ParquetMultiJoin

    w = ArtifactWriter(tmp_path, "samples", "ingest", {})
    units = []
    # two files; sample 4 has rows in both (in file order), 2 has none; rows out of key order
    parts = [([4, 1, 4, 3, 1], ["a", "b", "c", "d", "e"]), ([4, 6, 6], ["f", "g", "h"])]
    for u, (sids, texts) in enumerate(parts):
        name = unit_name(u)
        units.append(name)
        uw = w.unit_writer(name, "fp")
        uw.write_table("phrases", pa.table({"sample_id": pa.array(sids, pa.int64()), "text": texts,
                                            "instance_ids": pa.array([[i] for i in range(len(sids))], pa.list_(pa.int64()))}))
        uw.commit()
    w.finalize(units)
    j = ParquetMultiJoin(tmp_path / "samples", "phrases", ["text", "instance_ids"], cache_files=1)
    assert j.lookup(1) == {"text": ["b", "e"], "instance_ids": [[1], [4]]}
    assert j.lookup(4)["text"] == ["a", "c", "f"]
    assert j.lookup(6)["text"] == ["g", "h"] and j.lookup(3)["text"] == ["d"]
    assert j.lookup(2) is None and j.lookup(99) is None
    s = j({"sample_id": 2})
    assert s["text"] == [] and s["instance_ids"] == []
    jp = ParquetMultiJoin(tmp_path / "samples", "phrases", ["text"], prefix="p_")
    assert jp({"sample_id": 3}) == {"sample_id": 3, "p_text": ["d"]}
