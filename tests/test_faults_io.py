"""Faults around the stages (issue 18): locks, leftovers, output paths, error tables, corrupt
shards, caption-only datasets, wrong model ids, strict manifest numbers, 16-bit and huge images,
small concept vocabularies."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest
from PIL import Image

from pipeline.config import ManifestError, load_manifest
from pipeline.io.artifacts import (
    ERROR_SCHEMA,
    Artifact,
    ArtifactBusy,
    ArtifactWriter,
    OutputPathError,
    forget_units_of,
    release_lock,
)
from pipeline.stage import RunContext, StageError, run_stage
from tests.conftest import REPO, make_manifest


def _tiny_artifact(out, errors=0, rows=3):
    w = ArtifactWriter(out, "things", "test", {"a": 1})
    u = w.unit_writer("00000", w.unit_fingerprint("00000", None))
    u.write_table("things", pa.table({"sample_id": pa.array(range(rows), pa.int64())}))
    for i in range(errors):
        u.error("bad", f"object at {hex(id(object()) + i)}", sample_id=100 + i)  # an address, as PIL prints them
    u.commit({"rows": rows})
    w.finalize(["00000"])
    return Artifact(w.dir)


# --- hard negatives with fewer concepts than k -------------------------------------------------


@pytest.mark.parametrize("U", [2, 3, 9])
def test_hard_negatives_with_fewer_concepts_than_k(U):
    from pipeline.concepts.hard_negatives import mine_hard_negatives, token_matrix

    rng = np.random.default_rng(U)
    emb = rng.normal(size=(U, 8)).astype(np.float32)
    emb /= np.linalg.norm(emb, axis=1, keepdims=True)
    texts = [f"word{i}" for i in range(U)]
    nb, sc, kind = mine_hard_negatives(emb, token_matrix(texts, 3), k=10)
    assert nb.shape == (U, 10) and sc.shape == (U, 10)
    for i in range(U):
        got = nb[i][nb[i] >= 0]
        assert sorted(got) == sorted(set(range(U)) - {i})  # every other concept, best first
        assert np.all(nb[i, U - 1 :] == -1)
        np.testing.assert_allclose(sc[i, : U - 1], emb[got] @ emb[i], rtol=1e-5)


# --- locks ---------------------------------------------------------------------------------------

_HOLD = """
import sys, time
from pipeline.io.artifacts import ArtifactWriter
ArtifactWriter(sys.argv[1], "things", "test", {})
print("locked", flush=True)
time.sleep(60)
"""


def test_second_run_is_refused_with_the_holder_and_kill9_leaves_no_stale_lock(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert proc.stdout.readline().strip() == "locked"
        with pytest.raises(ArtifactBusy) as e:
            ArtifactWriter(tmp_path, "things", "test", {})
        assert f"pid {proc.pid}" in str(e.value) and "\n" not in str(e.value)
        os.kill(proc.pid, signal.SIGKILL)  # kill -9: the kernel drops the flock
        proc.wait(10)
        ArtifactWriter(tmp_path, "things", "test", {})  # taken again, no stale lock
        assert f"pid {os.getpid()}" in (tmp_path / "things" / "_lock").read_text()
    finally:
        proc.kill()
        release_lock()


def test_lock_is_reentrant_in_one_process_and_released_by_finalize(tmp_path):
    _tiny_artifact(tmp_path)
    proc = subprocess.run([sys.executable, "-c", _HOLD.replace("time.sleep(60)", ""), str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr  # finalize released it: another process may take it


# --- leftovers, error tables, verify ---------------------------------------------------------------


def test_stale_tmp_files_are_removed_on_the_next_run(tmp_path):
    d = tmp_path / "things" / "things"
    d.mkdir(parents=True)
    (d / ".things-00000.parquet.1a2b3c4d.tmp").write_bytes(b"half")
    (tmp_path / "things" / "_state").mkdir()
    (tmp_path / "things" / "_state" / ".00000.json.deadbeef.tmp").write_text("{")
    _tiny_artifact(tmp_path)
    release_lock()
    assert not list((tmp_path / "things").rglob("*.tmp"))


def test_errors_table_in_its_own_folder_zero_rows_without_row_groups(tmp_path):
    art = _tiny_artifact(tmp_path / "a")
    root = art.dir
    assert not list(root.glob("*.parquet"))  # nothing a reader of the root folder could merge
    path = root / "errors" / "errors.parquet"
    meta = pq.ParquetFile(path).metadata
    assert meta.num_rows == 0 and meta.num_row_groups == 0  # HF datasets sizes batches by row group 0
    assert pq.read_schema(path).equals(ERROR_SCHEMA)
    assert pads.dataset(root / "errors").to_table().num_rows == 0
    assert pads.dataset(root / "things").to_table().column_names == ["sample_id"]
    # the root folder: a dataset reader walks the sub-folders and stacked errors/errors.parquet
    # under the table (3 + 2 rows, the errors' columns); the layout note there makes it fail naming it
    art_e = _tiny_artifact(tmp_path / "e", errors=2)
    with pytest.raises(pa.ArrowInvalid, match="README.txt"):
        pads.dataset(art_e.dir).to_table()
    with pytest.raises(pa.ArrowInvalid, match="README.txt"):
        pq.read_table(art_e.dir)
    assert "things/" in (art_e.dir / "README.txt").read_text() and pq.read_table(art_e.dir / "things").num_rows == 3
    before = (art_e.dir / "README.txt").stat().st_mtime_ns
    _tiny_artifact(tmp_path / "e", errors=2)  # a rerun: the same note is not rewritten
    assert (art_e.dir / "README.txt").stat().st_mtime_ns == before
    art2 = _tiny_artifact(tmp_path / "b", errors=2)
    for rg in range(pq.ParquetFile(art2.dir / "errors" / "errors.parquet").metadata.num_row_groups):
        assert pq.ParquetFile(art2.dir / "errors" / "errors.parquet").metadata.row_group(rg).num_rows > 0
    assert [e["detail"] for e in art2.errors().to_pylist()] == ["object", "object"]  # no addresses
    import datasets  # the test extra installs it

    # Hugging Face datasets: the zero-row table loads as a Dataset with the errors' columns (a
    # file with one empty row group made it fail on "BatchSize must be greater than 0"). Its
    # builders (load_dataset / Dataset.from_parquet, even from_generator) refuse *every* empty
    # split in datasets 5.2 ("corresponds to no data"), whatever the file: README says so.
    ds = datasets.Dataset(pq.read_table(path))
    assert len(ds) == 0 and ds.column_names == ERROR_SCHEMA.names
    ds2 = datasets.Dataset.from_parquet(str(art2.dir / "errors" / "errors.parquet"), cache_dir=str(tmp_path / "hf"))
    assert len(ds2) == 2 and ds2.column_names == ERROR_SCHEMA.names


def test_verify_finds_a_flipped_byte_of_unchanged_size(tmp_path):
    art = _tiny_artifact(tmp_path)
    release_lock()
    assert art.verify() == []
    f = art.files("things")[0]
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))
    problems = art.verify()
    assert len(problems) == 1 and "sha256" in problems[0] and str(f) in problems[0]
    r = subprocess.run([sys.executable, "-m", "pipeline.cli", "verify", str(art.dir)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "1 bad files" in r.stdout
    assert forget_units_of(art) == 1 and not (art.dir / "_manifest.json").exists()
    assert not (art.dir / "_state" / "00000.json").exists()


# --- output paths -----------------------------------------------------------------------------


def test_output_path_is_a_file_is_one_line_exit_2(tmp_path):
    out = tmp_path / "out"
    out.write_text("not a folder")
    r = subprocess.run([sys.executable, "-m", "pipeline.cli", "run", "ingest", "-m", str(REPO / "manifests" / "tiny.yaml"),
                        "--set", f"output={out}"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [f"error: output path {out} is a file, not a folder"]


def test_artifact_folder_is_a_file_is_one_line(tmp_path):
    (tmp_path / "things").write_text("x")
    with pytest.raises(OutputPathError, match=r"artifact path .*things is a file"):
        ArtifactWriter(tmp_path, "things", "test", {})


def _unwritable(tmp_path) -> Path:
    """A folder this process cannot write in: a read-only one, or for root (which permission bits
    do not stop; CI runs as root) a path under sysfs, where nobody may create anything."""
    if os.geteuid() != 0:
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        return ro
    ro = Path("/sys/vlpipe-test-unwritable")
    try:
        ro.mkdir()
    except OSError:
        return ro
    ro.rmdir()
    pytest.skip("sysfs is writable here")


def test_output_not_writable(tmp_path):
    ro = _unwritable(tmp_path)
    with pytest.raises(OutputPathError, match="not writable|cannot create") as e:
        ArtifactWriter(ro / "out", "things", "test", {})
    assert str(ro / "out") in str(e.value) and "\n" not in str(e.value)
    # the CLI: one line naming the path, exit code 2
    r = subprocess.run([sys.executable, "-m", "pipeline.cli", "run", "ingest", "-m", str(REPO / "manifests" / "tiny.yaml"),
                        "--set", f"output={ro / 'out'}"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and str(ro / "out") in lines[0], r.stderr[-2000:]


# --- manifests ----------------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["stages.ingest.shard_size", "ray.num_cpus", "stages.ingest.max_error_rate"])
def test_manifest_numbers_are_strict(key):
    with pytest.raises(ManifestError, match=f"key '{key}'.*not true/false"):
        load_manifest(None, [f"{key}=true"])
    load_manifest(None, ["stages.ingest.enabled=false"])  # bools stay bools


# --- images -----------------------------------------------------------------------------------------


def test_16bit_png_is_scaled_not_clipped(tmp_path):
    from pipeline.readers.images import open_image

    a = (np.arange(32 * 32, dtype=np.uint32).reshape(32, 32) * 64).astype(np.uint16)  # 0..65472
    Image.fromarray(a).save(tmp_path / "g16.png")
    assert Image.open(tmp_path / "g16.png").mode.startswith("I")
    rgb = np.asarray(open_image(str(tmp_path / "g16.png")))
    assert rgb.shape == (32, 32, 3) and (rgb[..., 0] == rgb[..., 1]).all()
    np.testing.assert_array_equal(rgb[..., 0], np.rint(a / 257.0).astype(np.uint8))
    assert 0.3 < (rgb[..., 0] == 255).mean() or rgb[..., 0].mean() < 200  # not all white
    assert rgb[..., 0].mean() == pytest.approx(127.0, abs=2)


def test_huge_image_is_rejected_from_its_header(tmp_path):
    from pipeline.readers.images import ImageTooLarge, image_header_size, open_image

    Image.new("1", (11000, 11000)).save(tmp_path / "big.png")  # 121 MP, tiny file
    t0 = time.perf_counter()
    with pytest.raises(ImageTooLarge, match="121,000,000 pixels > max_pixels"):
        open_image(str(tmp_path / "big.png"))
    with pytest.raises(ImageTooLarge):
        image_header_size(str(tmp_path / "big.png"), max_pixels=50_000_000)
    assert time.perf_counter() - t0 < 2  # never decoded
    garbage = tmp_path / "g.jpg"
    garbage.write_bytes(b"not an image")
    with pytest.raises(Exception) as e:
        open_image(str(garbage))
    assert "0x" not in str(e.value)


# --- stages on Ray: error rate, caption-only, wrong model ids, huge image -----------------------


def _coco(tmp_path, with_images_key=True, n=6):
    img_dir = tmp_path / "images"
    img_dir.mkdir(exist_ok=True)
    for i in range(n):
        Image.new("RGB", (32, 24), (i * 30, 100, 200)).save(img_dir / f"{i:03d}.jpg")
    data = {"annotations": [{"id": 10 + i, "image_id": i, "caption": f"picture number {i}"} for i in range(n)]}
    if with_images_key:
        data["images"] = [{"id": i, "file_name": f"{i:03d}.jpg"} for i in range(n)]
    cap = tmp_path / "captions.json"
    cap.write_text(json.dumps(data))
    return cap, img_dir


@pytest.mark.slow
def test_ingest_rejecting_every_sample_fails_with_top_reasons(tmp_path, ray_session):
    cap, img_dir = _coco(tmp_path, with_images_key=False)
    m = make_manifest(tmp_path, ["dataset.kind=coco", f"dataset.captions={cap}", f"dataset.images={img_dir}"])
    with pytest.raises(StageError) as e:
        run_stage("ingest", RunContext(m))
    msg = str(e.value)
    assert "\n" not in msg and "rejected 6 of 6 samples (100.0% > max_error_rate 50%)" in msg and "missing_image x6" in msg
    assert (tmp_path / "run" / "samples" / "errors" / "errors.parquet").is_file()
    assert not (tmp_path / "run" / "samples" / "_manifest.json").exists()  # nothing downstream can use


@pytest.mark.slow
def test_caption_only_dataset_runs_caption_stages_and_refuses_image_stages(tmp_path, ray_session, caplog):
    cap, _ = _coco(tmp_path, with_images_key=False)
    m = make_manifest(tmp_path, ["dataset.kind=coco", f"dataset.captions={cap}"])
    with caplog.at_level(logging.INFO, logger="pipeline"):
        summary = run_stage("ingest", RunContext(m))
    assert summary["samples"] == 6 and summary["errors"] == 0
    assert any("caption-only dataset, image checks off" in r.getMessage() for r in caplog.records)
    assert Artifact(tmp_path / "run" / "samples").manifest["caption_only"] is True
    with pytest.raises(StageError, match="caption-only .* this image stage cannot run"):
        run_stage("extract-clip-tokens", RunContext(m))


@pytest.mark.slow
def test_caption_only_dataset_mines_concepts(tmp_path, ray_session):
    """The caption stage after ingest runs on a caption-only dataset (no `images:`): mine-concepts
    mines its (few: 2-9 concepts, fewer neighbours than k) concepts and finishes."""
    texts = ["a red cat on a mat", "a dog in the park", "a red cat in the park", "a dog on a mat",
             "a bird on a tree", "a cat and a dog"]
    cap = tmp_path / "captions.json"
    cap.write_text(json.dumps({"annotations": [{"id": 10 + i, "image_id": i, "caption": t} for i, t in enumerate(texts)]}))
    m = make_manifest(tmp_path, ["dataset.kind=coco", f"dataset.captions={cap}", "models.text_encoder=tiny-random"])
    run_stage("ingest", RunContext(m))
    run_stage("mine-concepts", RunContext(m))
    art = Artifact(tmp_path / "run" / "concepts")
    n = art.manifest["stats"]["vocab"]
    assert 2 <= n <= 9 and art.errors().num_rows == 0, art.manifest["stats"]
    assert art.manifest["tables"]["hard_negatives"]["rows"] > 0


@pytest.mark.slow
def test_wrong_model_id_is_one_line_naming_the_manifest_key(tmp_path, ray_session):
    cap, img_dir = _coco(tmp_path)
    base = ["dataset.kind=coco", f"dataset.captions={cap}", f"dataset.images={img_dir}", "stages.extract_regions.backend=detector"]
    run_stage("ingest", RunContext(make_manifest(tmp_path, base)))
    for stage, key in [("extract-clip-tokens", "clip"), ("extract-regions", "detector"), ("extract-image-groups", "groupvit")]:
        m = make_manifest(tmp_path, base + [f"models.{key}=no-such-org/no-such-model"])
        with pytest.raises(StageError) as e:
            run_stage(stage, RunContext(m))
        msg = str(e.value)
        assert msg.startswith(f"models.{key}: 'no-such-org/no-such-model' not found or not loadable (") and "\n" not in msg


@pytest.mark.slow
def test_ingest_rejects_images_over_max_pixels_and_counts_them(tmp_path, ray_session):
    cap, img_dir = _coco(tmp_path)
    Image.new("1", (9000, 9000)).save(img_dir / "002.jpg".replace(".jpg", ".png"))
    data = json.loads(cap.read_text())
    data["images"][2]["file_name"] = "002.png"
    cap.write_text(json.dumps(data))
    m = make_manifest(tmp_path, ["dataset.kind=coco", f"dataset.captions={cap}", f"dataset.images={img_dir}",
                                 "stages.ingest.max_pixels=50000000"])
    summary = run_stage("ingest", RunContext(m))
    assert summary["samples"] == 5
    errs = Artifact(tmp_path / "run" / "samples").errors().to_pylist()
    assert [(e["reason"], e["sample_id"]) for e in errs] == [("image_too_large", 2)]
    assert "81,000,000 pixels > max_pixels 50,000,000" in errs[0]["detail"]


# --- webdataset tars from users -------------------------------------------------------------------


def test_webdataset_tar_members_never_reach_disk_and_size_is_limited(tmp_path):
    import io
    import tarfile

    from pipeline.readers.wds import read_webdataset

    def add(tf, name, data=b"", **kw):
        info = tarfile.TarInfo(name)
        info.size = len(data)
        for k, v in kw.items():
            setattr(info, k, v)
        tf.addfile(info, io.BytesIO(data))

    buf = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buf, "JPEG")
    jpg = buf.getvalue()
    shards = tmp_path / "shards"
    shards.mkdir()
    with tarfile.open(shards / "000.tar", "w") as tf:
        add(tf, "../../escape.jpg", jpg)
        add(tf, "../../escape.txt", b"a caption that tries to escape")
        add(tf, "/abs/evil.jpg", jpg)
        add(tf, "/abs/evil.txt", b"absolute name")
        add(tf, "link.jpg", type=tarfile.SYMTYPE, linkname="/etc/passwd")
        add(tf, "link.txt", b"a link")
        add(tf, "big.jpg", jpg)
        add(tf, "big.txt", b"x" * 5000)
        add(tf, "ok.jpg", jpg)
        add(tf, "ok.txt", b"fine")
    before = sorted(p for p in tmp_path.parent.rglob("*"))
    recs = {r.source_id: r for r in read_webdataset(shards, max_member_bytes=4096)}
    assert sorted(p for p in tmp_path.parent.rglob("*")) == before  # nothing written anywhere
    assert recs["ok"].captions == ["fine"] and not recs["ok"].problems
    assert recs["../../escape"].image.endswith("::../../escape.jpg")  # a key inside the tar, nothing more
    assert recs["link"].image is None  # the symlink member is ignored
    assert recs["big"].problems[0] == (None, "member 'big.txt' is 5,000 bytes > dataset.max_member_bytes 4,096")
    from pipeline.stages.ingest import _reason

    assert _reason(recs["big"].problems[0][1], "bad_record") == "member_too_large"


@pytest.mark.slow
def test_stage_log_is_clean(tmp_path):
    """An actor stage's log: no ANSI codes, no Ray actor-restart line, no per-worker copies of driver
    warnings, no bars. (The samples artifact is written in-process: one CLI run, one Ray start.)"""
    from pipeline.stages.ingest import CAPTIONS_SCHEMA, SAMPLES_SCHEMA

    out = tmp_path / "run"
    w = ArtifactWriter(out, "samples", "ingest", {"test": True})
    uw = w.unit_writer("00000", w.unit_fingerprint("00000", None))
    rows = []
    for i in range(3):
        Image.new("RGB", (40, 30), (i * 60, 90, 200)).save(tmp_path / f"{i}.png")
        rows.append({"sample_id": i, "source_id": str(i), "image": str(tmp_path / f"{i}.png"), "width": 40, "height": 30, "split": "train"})
    uw.write_table("samples", pa.Table.from_pylist(rows, schema=SAMPLES_SCHEMA))
    uw.write_table("captions", pa.Table.from_pylist([{"caption_id": i, "sample_id": i, "text": "a picture"} for i in range(3)], schema=CAPTIONS_SCHEMA))
    uw.commit({"rows": 3})
    w.finalize(["00000"])
    cmd = [sys.executable, "-m", "pipeline.cli", "run", "extract-image-groups", "-m", str(REPO / "manifests" / "tiny.yaml"),
           "--set", f"output={out}", "--set", "ray.num_cpus=2", "--set", "ray.actors=1"]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert r.returncode == 0, r.stderr[-2000:]
    err = r.stderr
    assert "\x1b[" not in err and "\r" not in err
    assert "constructor arguments in the object store" not in err
    assert "MapWorker" not in err and "pid=" not in err
    assert err.count("RANDOM WEIGHTS") <= 1


def test_orphan_unit_files_of_another_shard_size_are_removed(tmp_path):
    d = tmp_path / "things" / "things"
    d.mkdir(parents=True)
    (d / "things-00099.parquet").write_bytes(b"left by a killed run with another shard size")
    art = _tiny_artifact(tmp_path)
    release_lock()
    assert sorted(p.name for p in d.iterdir()) == ["things-00000.parquet"]
    assert art.verify() == []


def test_ray_that_cannot_start_is_one_line(monkeypatch):
    import pipeline.runtime as rt
    from pipeline.config import RayConfig

    class FakeRay:
        @staticmethod
        def is_initialized():
            return False

        @staticmethod
        def init(**kw):
            raise Exception("The current node timed out during startup. This could happen because\nsome raylet failed")

    monkeypatch.setitem(sys.modules, "ray", FakeRay)
    with pytest.raises(rt.RayStartError) as e:
        rt.ensure_ray(RayConfig(address="ray://nowhere:10001"))
    assert str(e.value) == "ray (ray://nowhere:10001) could not start: Exception: The current node timed out during startup. This could happen because"


def test_unforeseen_stage_failure_is_one_line_on_the_cli(tmp_path):
    """A stage failing in a way nothing anticipated (here: the mine-concepts text encoder id does not
    exist) still ends in one line and exit 2; the traceback is shown with -v."""
    code = (
        "import sys, pipeline.stage as st\n"
        "def boom(name, ctx):\n"
        "    raise OSError(\"We couldn't connect to 'https://huggingface.co' to load the files\\nmore\")\n"
        "st.run_stage = boom\n"
        "from pipeline.cli import app\n"
        "app(sys.argv[1:])\n"
    )
    args = ["run", "ingest", "-m", str(REPO / "manifests" / "tiny.yaml"), "--set", f"output={tmp_path / 'run'}"]
    r = subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "error: stage ingest failed: OSError: We couldn't connect to 'https://huggingface.co' to load the files "
        "(rerun with -v for the traceback)"
    ]
    r = subprocess.run([sys.executable, "-c", code, *args, "-v"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" in r.stderr


def test_model_probe_failure_names_the_manifest_key(tmp_path):
    from pipeline.models.provenance import cached_info
    from pipeline.models.text_encoder import TextEncoder

    with pytest.raises(StageError) as e:
        cached_info(tmp_path, "text_encoder", {"text_encoder": "no-such-org/enc"}, lambda: TextEncoder("no-such-org/enc").record)
    assert str(e.value).startswith("models.text_encoder: 'no-such-org/enc' not found or not loadable (") and "\n" not in str(e.value)


def test_identical_runs_give_identical_error_bytes(tmp_path):
    a = _tiny_artifact(tmp_path / "a", errors=3)
    b = _tiny_artifact(tmp_path / "b", errors=3)
    release_lock()
    assert (a.dir / "errors" / "errors.parquet").read_bytes() == (b.dir / "errors" / "errors.parquet").read_bytes()


@pytest.mark.parametrize("role", ["mlm", "word_encoder"])
def test_mlm_probe_failure_names_the_manifest_key(tmp_path, role):
    """negative-captions probes its MLM / word encoder in the driver: a wrong id is one line naming
    the key, before any actor starts (it used to surface as a worker that could not start)."""
    from pipeline.models.mlm import provenance
    from pipeline.models.provenance import cached_info

    with pytest.raises(StageError) as e:
        cached_info(tmp_path, role, {role: "no-such-org/mlm"}, lambda: provenance("no-such-org/mlm", role))
    msg = str(e.value)
    assert msg.startswith(f"models.{role}: 'no-such-org/mlm' not found or not loadable (") and "\n" not in msg


def test_predicate_encoder_probe_failure_names_the_manifest_key():
    from types import SimpleNamespace

    from pipeline.stages.extract_visual_tokens import model_records

    cfg = SimpleNamespace(feature_layers=None, width=64, seed=0, relations="geometric", embedding="decoder_token", segmenter="sam")
    with pytest.raises(StageError) as e:
        model_records(cfg, {"sam": "tiny-random", "predicate_encoder": "no-such-org/clip", "relation_head": None})
    assert str(e.value).startswith("models.predicate_encoder: 'no-such-org/clip' not found or not loadable (")
