"""A flipped byte in a finished shard is never used silently (issue 30 item 2): readers check every
file against the sha256 its manifest records (a stat once verified), a consumer stage refuses a
changed input in one line, and the producer's rerun redoes the changed unit, saying so."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pyarrow as pa
import pytest

import pipeline.io.verified
from pipeline.io.artifacts import Artifact, ArtifactWriter, CorruptArtifact, release_lock
from pipeline.stage import RunContext, StageError, run_stage
from pipeline.status import artifact_state
from tests.conftest import make_manifest
from tests.test_rerun_cheap import SMALL, _in_process


def _flip(path) -> None:
    before = path.stat().st_mtime_ns
    b = bytearray(path.read_bytes())
    b[len(b) // 2] ^= 0x10
    path.write_bytes(bytes(b))
    if path.stat().st_mtime_ns == before:  # within the timestamp tick (ms) of the write; a user's flip comes later
        os.utime(path, ns=(before + 1_000_000, before + 1_000_000))


def _artifact(out) -> Artifact:
    """Two units, each a Parquet table and a shard of bytes."""
    w = ArtifactWriter(out, "things", "make-things", {"a": 1})
    for unit in ("00000", "00001"):
        u = w.unit_writer(unit, w.unit_fingerprint(unit, None))
        u.write_table("things", pa.table({"sample_id": pa.array(range(3), pa.int64())}))
        path = u.shard_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(bytes(range(256)) * 64)
        u.record_shard(path, 1)
        u.commit({"rows": 3})
    w.finalize(["00000", "00001"])
    release_lock()
    return Artifact(w.dir)


@pytest.fixture
def hashed(monkeypatch):
    """The files the stat cache could not vouch for (hashed by a reader or a rerun)."""
    seen = []
    real = pipeline.io.verified.sha256_file

    def counting(path, *a, **k):
        seen.append(str(path))
        return real(path, *a, **k)

    monkeypatch.setattr(pipeline.io.verified, "sha256_file", counting)
    return seen


def test_fresh_files_cost_a_stat_and_a_changed_one_is_refused_in_one_line(tmp_path, hashed):
    art = _artifact(tmp_path)
    assert len(art.files("things")) == 2
    files = art.files("shards")
    assert len(files) == 2 and hashed == []  # the writer hashed them: readers only stat
    _flip(files[1])
    assert len(Artifact(art.dir).files("things")) == 2  # another table: not read, not checked
    with pytest.raises(CorruptArtifact) as e:
        Artifact(art.dir).files("shards")
    msg = str(e.value)
    assert "\n" not in msg and str(files[1]) in msg and "sha256" in msg and "things" in msg
    assert "`make-things`" in msg and f"pipeline verify --fix {art.dir}" in msg and "pipeline run make-things" in msg
    assert hashed == [str(files[1])]
    with pytest.raises(CorruptArtifact, match="sha256"):
        Artifact(art.dir).local_file(str(files[1].relative_to(art.dir)))
    files[1].unlink()
    with pytest.raises(CorruptArtifact, match=r": missing since `make-things` wrote it"):
        Artifact(art.dir).files("shards")


def test_a_file_without_a_cache_entry_is_hashed_once(tmp_path, hashed):
    art = _artifact(tmp_path)
    (art.dir / "_cache.json").unlink()  # an artifact written before the cache existed
    assert len(Artifact(art.dir).files("shards")) == 2 and len(hashed) == 2
    assert len(Artifact(art.dir).files("shards")) == 2 and len(hashed) == 2  # remembered
    assert len(Artifact(art.dir).files("things")) == 2 and len(hashed) == 4
    cache = json.loads((art.dir / "_cache.json").read_text())
    assert sorted(cache) == sorted(s["path"] for s in art.manifest["shards"])


def test_a_rerun_redoes_the_unit_whose_file_changed_and_says_so(tmp_path, caplog, hashed):
    art = _artifact(tmp_path)
    w = ArtifactWriter(tmp_path, "things", "make-things", {"a": 1})
    assert all(w.is_done(u, w.unit_fingerprint(u, None)) for u in ("00000", "00001")) and hashed == []
    _flip(art.dir / "shards" / "00001.tar")
    with caplog.at_level(logging.INFO, logger="pipeline"):
        assert w.is_done("00000", w.unit_fingerprint("00000", None))
        assert not w.is_done("00001", w.unit_fingerprint("00001", None))
    assert "things: unit 00001: shards/00001.tar changed since written (sha256): redoing" in caplog.messages
    release_lock()


# --- the story on a small real run ------------------------------------------------------


@pytest.fixture
def clip_run(tmp_path, monkeypatch):
    import torch

    torch.set_num_threads(1)
    _in_process(monkeypatch, [])
    m = make_manifest(tmp_path, SMALL)
    for name in ("ingest", "extract-clip-tokens", "build-index"):
        run_stage(name, RunContext(m))
    return m, Path(m.output) / "clip_tokens"


def _fingerprint(folder) -> str:
    return json.loads((folder / "_manifest.json").read_text())["fingerprint"]


def test_flipped_clip_tokens_shard_is_refused_by_build_index_and_redone_by_its_stage(clip_run, caplog):
    m, clip = clip_run
    shard = clip / "shards" / "00001.tar"
    recorded = next(s for s in Artifact(clip).manifest["shards"] if s["path"] == "shards/00001.tar")
    before = _fingerprint(clip)
    _flip(shard)
    # a consumer (rerun or forced) refuses the changed input in one line instead of building from it
    for force in (False, True):
        with pytest.raises(StageError) as e:
            run_stage("build-index", RunContext(m, force=force))
        msg = str(e.value)
        assert "\n" not in msg and str(shard) in msg and "sha256" in msg and "clip_tokens" in msg
        assert "pipeline run extract-clip-tokens" in msg and "pipeline verify --fix" in msg
    # the producer's rerun notices the changed shard and redoes that unit alone
    with caplog.at_level(logging.INFO, logger="pipeline"):
        run_stage("extract-clip-tokens", RunContext(m))
    assert "clip_tokens: unit 00001: shards/00001.tar changed since written (sha256): redoing" in caplog.messages
    assert "clip_tokens: 1 shards to do, 1 already complete" in caplog.messages
    assert Artifact(clip).verify() == []
    redone = next(s for s in Artifact(clip).manifest["shards"] if s["path"] == "shards/00001.tar")
    # consumers are stale exactly when the redone bytes differ from the ones they recorded
    same = redone["sha256"] == recorded["sha256"]
    assert (_fingerprint(clip) == before) == same
    assert artifact_state(Path(m.output), "index").state == ("complete" if same else "stale")
    run_stage("build-index", RunContext(m))
    assert artifact_state(Path(m.output), "index").state == "complete"
    assert json.loads((Path(m.output) / "index" / "_manifest.json").read_text())["input_fingerprints"] == {"clip_tokens": _fingerprint(clip)}


def test_an_artifact_under_a_relative_output_reads(tmp_path, monkeypatch):
    """`output: runs/demo` (relative, as the demo manifest has it): files() gives paths under the
    relative folder, which read() must not join to the folder a second time."""
    import pyarrow as pa

    from pipeline.io.artifacts import Artifact, ArtifactWriter, unit_name

    monkeypatch.chdir(tmp_path)
    w = ArtifactWriter("runs/demo", "samples", "ingest", {"v": 1})
    u = w.unit_writer(unit_name(0), "fp")
    u.write_table("samples", pa.table({"sample_id": pa.array([1, 2], pa.int64())}))
    u.commit()
    w.finalize([unit_name(0)])
    art = Artifact("runs/demo/samples")
    assert not art.files("samples")[0].is_absolute()
    assert art.read("samples").column("sample_id").to_pylist() == [1, 2]
    assert art.scan("samples").collect().height == 2
    assert art.read_file("samples/" + art.files("samples")[0].name).num_rows == 2
