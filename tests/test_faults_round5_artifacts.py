"""Bad input and faults, round 5 (issue 49, part B): every file of an artifact is recorded and verified.

build-index writes its FAISS indexes and query matrices outside its search units: they are in
``_manifest.json``'s ``files`` with their size and sha256, `pipeline status` and `pipeline verify`
name one that is missing or changed and what to run, and a plain rerun of build-index builds them
again (it never searches from an altered file)."""

from __future__ import annotations

import hashlib
import logging

import numpy as np
import pytest
from typer.testing import CliRunner

from tests.test_build_index import _fake_clip_tokens, toy_pairs

FIX = "rerun `pipeline run build-index` (it writes the file again)"


@pytest.fixture
def index_out(tmp_path, ray_session):
    from pipeline.stage import RunContext, run_stage
    from tests.conftest import make_manifest

    xi, img_ids, xc, cap_ids, owner, _ = toy_pairs(n_img=60, seed=3)
    _fake_clip_tokens(tmp_path / "run", xi, img_ids, xc, cap_ids, owner)
    m = make_manifest(tmp_path, ["stages.build_index.index=flat", "stages.build_index.k=8"])
    run_stage("build-index", RunContext(m))
    return m, tmp_path / "run" / "index"


def _state(m):
    from pipeline.status import output_states

    return next(s for s in output_states(m) if s.name == "index")


def test_every_file_build_index_writes_is_recorded_with_its_sha256(index_out):
    from pipeline.io.artifacts import Artifact

    m, art_dir = index_out
    art = Artifact(art_dir)
    files = {f["path"]: f for f in art.recorded}
    bookkeeping = {"_manifest.json", "_cache.json", "_lock"}  # the record itself, the hash cache, the lock
    on_disk = sorted(rel for p in art_dir.rglob("*") if p.is_file()
                     for rel in [p.relative_to(art_dir).as_posix()]
                     if rel not in bookkeeping and not rel.startswith(("_state/", "_errors/")))
    assert sorted(files) == on_disk  # every file of the artifact: nothing left out
    assert {"faiss/images.faiss", "faiss/captions.faiss", "faiss/captions.npy", "faiss/_build.json",
            "errors/errors.parquet", "README.txt"} <= {f["path"] for f in art.manifest["files"]}
    for rel, f in files.items():  # against an independent hash of the bytes
        data = (art_dir / rel).read_bytes()
        assert (f["bytes"], f["sha256"]) == (len(data), hashlib.sha256(data).hexdigest()), rel
    assert _state(m).state == "complete"


def test_status_and_verify_name_a_changed_or_deleted_index_file_and_a_plain_rerun_mends_it(index_out, caplog):
    from pipeline.cli import app
    from pipeline.stage import RunContext, run_stage

    m, art_dir = index_out
    npy, faiss_file = art_dir / "faiss" / "captions.npy", art_dir / "faiss" / "images.faiss"
    good_npy, good_faiss = npy.read_bytes(), faiss_file.read_bytes()
    bad = bytearray(good_npy)
    bad[-4] ^= 0x01  # one bit of one embedding: same size, same header
    npy.write_bytes(bytes(bad))
    st = _state(m)
    assert (st.state, st.detail) == ("corrupt", f"faiss/captions.npy: sha256 differs from the one recorded (content "
                                                f"changed or corrupt): {FIX}")
    r = CliRunner().invoke(app, ["verify", str(art_dir)])
    assert r.exit_code == 1
    assert f"  {art_dir}/faiss/captions.npy: sha256 differs from the one recorded (content changed or corrupt): {FIX}" \
        in r.output.splitlines(), r.output
    faiss_file.unlink()
    st = _state(m)
    assert st.state == "corrupt" and st.detail == f"faiss/captions.npy: sha256 differs from the one recorded (content " \
                                                  f"changed or corrupt) (and 1 more files): {FIX}"
    with caplog.at_level(logging.WARNING, logger="pipeline"):
        run_stage("build-index", RunContext(m))  # no --force
    assert any("index: faiss/captions.npy: sha256 differs" in x and "building the indexes again" in x
               for x in caplog.messages), caplog.messages
    assert npy.read_bytes() == good_npy and faiss_file.read_bytes() == good_faiss
    assert _state(m).state == "complete"


def test_a_damaged_faiss_file_is_rebuilt_by_a_plain_rerun_never_searched(index_out, monkeypatch):
    import faiss

    import pipeline.stages.build_index as bi
    from pipeline.stage import RunContext, run_stage

    m, art_dir = index_out
    f = art_dir / "faiss" / "captions.faiss"
    good = f.read_bytes()
    bad = bytearray(good)
    bad[len(bad) // 2] ^= 0xFF
    f.write_bytes(bytes(bad))
    assert _state(m).detail.startswith("faiss/captions.faiss: sha256 differs")
    built = []
    real = bi._build
    monkeypatch.setattr(bi, "_build", lambda *a: built.append(1) or real(*a))
    run_stage("build-index", RunContext(m))
    assert built == [1] and f.read_bytes() == good
    index = faiss.read_index(str(f))
    assert index.ntotal == len(np.load(art_dir / "faiss" / "captions_ids.npy"))
    run_stage("build-index", RunContext(m))  # up to date now: not built again
    assert built == [1]


@pytest.mark.parametrize("rel", ["errors/errors.parquet", "README.txt"])
def test_the_errors_table_and_layout_note_of_any_artifact_are_recorded_and_checked(tmp_path, rel):
    from pipeline.cli import app
    from pipeline.status import artifact_state
    from tests.test_status import _chain

    _chain(tmp_path)
    f = tmp_path / "samples" / rel
    data = f.read_bytes()
    f.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # same size, one bit
    st = artifact_state(tmp_path, "samples")
    assert (st.state, st.detail) == ("corrupt", f"{rel}: sha256 differs from the one recorded (content changed or "
                                                "corrupt): rerun `pipeline run ingest` (it writes the file again)")
    f.unlink()
    r = CliRunner().invoke(app, ["verify", str(tmp_path / "samples")])
    assert r.exit_code == 1 and f"  {tmp_path / 'samples'}/{rel}: missing: rerun `pipeline run ingest` (it writes the " \
        "file again)" in r.output.splitlines(), r.output


def test_a_manifest_rewritten_as_an_empty_object_or_a_list_is_corrupt_in_status_not_a_keyerror(tmp_path):
    """`pipeline status` on an artifact whose _manifest.json is `{}` (or `[]`) printed a KeyError: 'shards'
    traceback; it is now that artifact's corrupt line naming what the file lacks and the stage to rerun."""
    import json

    from typer.testing import CliRunner

    from pipeline.cli import app
    from pipeline.io.artifact_reader import Artifact

    from pathlib import Path

    m = Path(__file__).resolve().parents[1] / "manifests" / "tiny.yaml"
    out = tmp_path / "o"
    r = CliRunner().invoke(app, ["run", "ingest", "-m", str(m), "--set", f"output={out}"])
    assert r.exit_code == 0, r.output
    for bad, why in (({}, "lacks tables, shards"), ([], "holds a list, not an object")):
        (out / "samples" / "_manifest.json").write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=why):
            Artifact(out / "samples").manifest
        r = CliRunner().invoke(app, ["status", "-m", str(m), "--set", f"output={out}"])
        assert "Traceback" not in r.output and "KeyError" not in r.output, r.output
        line = next(x for x in r.output.splitlines() if x.lstrip().startswith("samples"))
        assert "corrupt" in line and f"_manifest.json is malformed ({out / 'samples'}/_manifest.json {why})" in line, line
        assert "rerun `pipeline run ingest" in line, line
