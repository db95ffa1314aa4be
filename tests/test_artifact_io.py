"""Atomic shard writing, WebDataset round trip, unit markers and resume bookkeeping."""

from __future__ import annotations

import json
import tarfile

import numpy as np
import pyarrow as pa
import pytest
import webdataset as wds

from pipeline.io.artifacts import Artifact, ArtifactMissing, ArtifactWriter
from pipeline.io.atomic import atomic_path, sha256_file
from pipeline.io.wds import ShardWriter, iter_shard, sample_key


def test_atomic_path_leaves_nothing_on_failure(tmp_path):
    target = tmp_path / "a" / "x.bin"
    with pytest.raises(RuntimeError):
        with atomic_path(target) as tmp:
            tmp.write_bytes(b"partial")
            raise RuntimeError("crash mid-write")
    assert not target.exists()
    assert list((tmp_path / "a").iterdir()) == []


def test_atomic_path_keeps_old_file_until_new_one_is_complete(tmp_path):
    target = tmp_path / "x.bin"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError):
        with atomic_path(target) as tmp:
            tmp.write_bytes(b"new but broken")
            raise RuntimeError
    assert target.read_bytes() == b"old"


def test_wds_round_trip_and_webdataset_compatibility(tmp_path):
    path = tmp_path / "s.tar"
    arrays = {i: np.random.default_rng(i).standard_normal((3, 4)).astype(np.float16) for i in range(3)}
    with ShardWriter(path) as w:
        for i, a in arrays.items():
            w.write(sample_key(i), {"tokens.npy": a, "meta.json": {"id": i}, "text.txt": f"cap {i}"})
    got = list(iter_shard(path))
    assert [g["__key__"] for g in got] == [sample_key(i) for i in range(3)]
    for i, g in enumerate(got):
        np.testing.assert_array_equal(g["tokens.npy"], arrays[i])
        assert g["tokens.npy"].dtype == np.float16
        assert g["meta.json"] == {"id": i} and g["text.txt"] == f"cap {i}"
    # The reference library reads the same shard.
    ds = wds.WebDataset(str(path), shardshuffle=False).decode()
    ref = list(ds)
    assert [r["__key__"] for r in ref] == [sample_key(i) for i in range(3)]
    np.testing.assert_array_equal(ref[1]["tokens.npy"], arrays[1])


def test_wds_bytes_are_deterministic(tmp_path):
    for name in ("a.tar", "b.tar"):
        with ShardWriter(tmp_path / name) as w:
            w.write("000000000001", {"x.npy": np.arange(5), "y.json": {"b": 1, "a": 2}})
    assert sha256_file(tmp_path / "a.tar") == sha256_file(tmp_path / "b.tar")
    with tarfile.open(tmp_path / "a.tar") as t:
        assert all(m.mtime == 0 for m in t.getmembers())


def _write_unit(writer: ArtifactWriter, unit: str, rows: int, errors: int = 0):
    fp = writer.unit_fingerprint(unit, {"rows": rows})
    uw = writer.unit_writer(unit, fp)
    uw.write_table("t", pa.table({"sample_id": pa.array(range(rows), pa.int64())}))
    for k in range(errors):
        uw.error("bad", f"row {k}", sample_id=k)
    uw.commit({"rows": rows})
    return fp


def test_writer_markers_resume_and_manifest(tmp_path):
    w = ArtifactWriter(tmp_path, "art", "stage-x", {"p": 1})
    fps = {u: _write_unit(w, u, rows, errors=1 if u == "00001" else 0) for u, rows in [("00000", 3), ("00001", 2)]}
    assert all(w.is_done(u, fp) for u, fp in fps.items())
    m = w.finalize(["00000", "00001"], extra={"note": "x"})
    assert m["tables"]["t"] == {"rows": 5, "files": 2}
    assert m["errors"]["rows"] == 1 and m["note"] == "x"
    assert all(s["sha256"] == sha256_file(tmp_path / "art" / s["path"]) for s in m["shards"])
    art = Artifact(tmp_path / "art")
    assert art.read("t").num_rows == 5
    assert art.errors().to_pylist()[0]["reason"] == "bad"
    # A deleted shard invalidates only its own unit.
    (tmp_path / "art" / m["shards"][0]["path"]).unlink()
    assert not w.is_done("00000", fps["00000"]) and w.is_done("00001", fps["00001"])
    # Changed parameters change every fingerprint.
    w2 = ArtifactWriter(tmp_path, "art", "stage-x", {"p": 2})
    assert not w2.is_done("00001", w2.unit_fingerprint("00001", {"rows": 2}))


def test_truncated_shard_is_not_done(tmp_path):
    w = ArtifactWriter(tmp_path, "art", "s", {})
    fp = _write_unit(w, "00000", 10)
    marker = json.loads((tmp_path / "art" / "_state" / "00000.json").read_text())
    shard = tmp_path / "art" / marker["files"][0]["path"]
    shard.write_bytes(shard.read_bytes()[:20])
    assert not w.is_done("00000", fp)


def test_prune_removes_units_of_an_older_layout(tmp_path):
    w = ArtifactWriter(tmp_path, "art", "s", {})
    for u in ("00000", "00001", "00002"):
        _write_unit(w, u, 1)
    w.prune({"00000"})
    assert sorted(p.stem for p in (tmp_path / "art" / "_state").glob("*.json")) == ["00000"]
    assert sorted(p.name for p in (tmp_path / "art" / "t").iterdir()) == ["t-00000.parquet"]


def test_force_discards_markers(tmp_path):
    w = ArtifactWriter(tmp_path, "art", "s", {})
    fp = _write_unit(w, "00000", 1)
    w2 = ArtifactWriter(tmp_path, "art", "s", {}, force=True)
    assert not w2.is_done("00000", fp)


def test_unfinished_artifact_is_reported(tmp_path):
    (tmp_path / "art").mkdir()
    with pytest.raises(ArtifactMissing, match="not a finished artifact"):
        Artifact(tmp_path / "art")


def test_execution_only_options_do_not_change_fingerprints(tmp_path):
    a = ArtifactWriter(tmp_path, "art", "s", {"k": 1, "num_gpus": 0, "num_cpus": 1, "enabled": True})
    b = ArtifactWriter(tmp_path, "art", "s", {"k": 1, "num_gpus": 1, "num_cpus": 4, "enabled": False})
    c = ArtifactWriter(tmp_path, "art", "s", {"k": 2, "num_gpus": 0, "num_cpus": 1, "enabled": True})
    assert a.base_fingerprint == b.base_fingerprint != c.base_fingerprint
