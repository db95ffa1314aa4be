"""`pipeline run ingest`: a hand-written COCO file, bad records, resume and single-shard redo."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from PIL import Image

from pipeline.io.artifacts import Artifact
from pipeline.stage import RunContext, StageError, run_stage
from tests.conftest import REPO, make_manifest


def _coco(tmp_path):
    """Five images: three good, one truncated JPEG, one listed but absent; one blank caption."""
    img_dir = tmp_path / "images"
    img_dir.mkdir()
    for i, (w, h) in enumerate([(64, 48), (32, 32), (40, 80)], start=1):
        Image.new("RGB", (w, h), (i * 40, 100, 200)).save(img_dir / f"{i:012d}.jpg")
    good = (img_dir / f"{1:012d}.jpg").read_bytes()
    (img_dir / f"{4:012d}.jpg").write_bytes(good[: len(good) // 2])  # truncated: header ok, data not
    images = [{"id": i, "file_name": f"{i:012d}.jpg", "width": 1, "height": 1} for i in range(1, 6)]
    anns = [
        {"id": 10, "image_id": 1, "caption": "A red bus parked by the road."},
        {"id": 11, "image_id": 1, "caption": "   "},
        {"id": 12, "image_id": 2, "caption": "Two dogs play in the snow."},
        {"id": 13, "image_id": 3, "caption": "A man riding a horse."},
        {"id": 14, "image_id": 3, "caption": "A person on a brown horse."},
        {"id": 15, "image_id": 4, "caption": "A truncated picture."},
        {"id": 16, "image_id": 5, "caption": "An image that is not there."},
    ]
    cap = tmp_path / "captions.json"
    cap.write_text(json.dumps({"images": images, "annotations": anns}))
    return cap, img_dir


def _run(tmp_path, overrides):
    m = make_manifest(tmp_path, overrides)
    return run_stage("ingest", RunContext(m)), m


def test_ingest_hand_written_coco(tmp_path, ray_session):
    cap, img_dir = _coco(tmp_path)
    summary, m = _run(tmp_path, ["dataset.kind=coco", f"dataset.captions={cap}", f"dataset.images={img_dir}", "stages.ingest.shard_size=2"])
    art = Artifact(tmp_path / "run" / "samples")
    samples = art.read("samples").to_pylist()
    assert [(s["source_id"], s["width"], s["height"]) for s in samples] == [("1", 64, 48), ("2", 32, 32), ("3", 40, 80)]
    assert [s["sample_id"] for s in samples] == [0, 1, 2]
    caps = art.read("captions").to_pylist()
    assert [c["text"] for c in caps] == [
        "A red bus parked by the road.",
        "Two dogs play in the snow.",
        "A man riding a horse.",
        "A person on a brown horse.",
    ]
    # caption ids count rejected captions too, so they are stable when a bad caption is fixed
    assert [c["caption_id"] for c in caps] == [0, 2, 3, 4]
    errors = {(e["reason"], e["source_id"], e["caption_id"]) for e in art.errors().to_pylist()}
    assert ("empty_caption", "1", 1) in errors
    assert any(r == "unreadable_image" and s == "4" for r, s, _ in errors)
    assert any(r == "missing_image" and s == "5" for r, s, _ in errors)
    assert summary["samples"] == 3 and summary["errors"] == 3
    assert art.manifest["units"] == 3 and art.manifest["stage"] == "ingest"


def _mtimes(d):
    return {p.name: p.stat().st_mtime_ns for p in (d / "samples").glob("*.parquet")}


def test_rerun_skips_and_deleted_shard_is_redone_alone(tmp_path, ray_session):
    cap, img_dir = _coco(tmp_path)
    ov = ["dataset.kind=coco", f"dataset.captions={cap}", f"dataset.images={img_dir}", "stages.ingest.shard_size=2"]
    _run(tmp_path, ov)
    art_dir = tmp_path / "run" / "samples"
    before = _mtimes(art_dir)
    first = Artifact(art_dir).manifest
    _run(tmp_path, ov)
    assert _mtimes(art_dir) == before  # nothing rewritten
    victim = art_dir / "samples" / "samples-00001.parquet"
    victim.unlink()
    _run(tmp_path, ov)
    after = _mtimes(art_dir)
    assert victim.exists()
    assert {k: v for k, v in after.items() if k != victim.name} == {k: v for k, v in before.items() if k != victim.name}
    assert after[victim.name] != before[victim.name]
    again = Artifact(art_dir).manifest
    assert [s["sha256"] for s in again["shards"]] == [s["sha256"] for s in first["shards"]]
    # --force rewrites everything
    m = make_manifest(tmp_path, ov)
    run_stage("ingest", RunContext(m, force=True))
    assert all(after[k] != v for k, v in _mtimes(art_dir).items())


def test_changed_caption_redoes_only_its_shard(tmp_path, ray_session):
    cap, img_dir = _coco(tmp_path)
    ov = ["dataset.kind=coco", f"dataset.captions={cap}", f"dataset.images={img_dir}", "stages.ingest.shard_size=2"]
    _run(tmp_path, ov)
    before = _mtimes(tmp_path / "run" / "samples")
    data = json.loads(cap.read_text())
    data["annotations"][-1]["caption"] = "Edited."
    cap.write_text(json.dumps(data))
    _run(tmp_path, ov)
    after = _mtimes(tmp_path / "run" / "samples")
    changed = {k for k in before if before[k] != after[k]}
    assert changed == {"samples-00002.parquet"}


def test_missing_captions_file_is_a_clear_error(tmp_path, ray_session):
    with pytest.raises(StageError, match="nope.json"):
        _run(tmp_path, ["dataset.kind=coco", f"dataset.captions={tmp_path / 'nope.json'}", f"dataset.images={tmp_path}"])


def test_demo_ingest_via_cli(tmp_path):
    """The user's command on the demo manifest, in a fresh process with its own embedded Ray."""
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    cmd = [sys.executable, "-m", "pipeline.cli", "run", "ingest", "-m", str(REPO / "manifests" / "tiny.yaml"),
           "--set", f"output={tmp_path / 'demo'}", "--set", "ray.num_cpus=2"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    art = Artifact(tmp_path / "demo" / "samples")
    n = art.manifest["tables"]["samples"]["rows"]
    reasons = {e["reason"] for e in art.errors().to_pylist()}
    assert n == 63  # 64 generated, one deliberately corrupt
    assert {"unreadable_image", "empty_caption"} <= reasons
    assert {"instances", "relations", "phrases"} <= set(art.tables())
    # the stage's summary once on the terminal (stdout, JSON); its log line only in the run's log file
    assert [ln for ln in out.stdout.splitlines() if ln.strip()] == [next(ln for ln in out.stdout.splitlines()
                                                                        if ln.startswith("ingest: {"))], out.stdout
    assert json.loads(out.stdout.strip().split(": ", 1)[1])["samples"] == 63
    assert "stage ingest: done in" not in out.stderr, out.stderr[-2000:]
    assert "stage ingest: done in" in (tmp_path / "demo" / "_logs" / "run-ingest.log").read_text()
    again = subprocess.run(cmd + ["-v"], capture_output=True, text=True, env=env, timeout=300)  # nothing to do
    assert again.returncode == 0 and "stage ingest: done in" in again.stderr, again.stderr[-2000:]  # -v: shown
    assert len([ln for ln in again.stdout.splitlines() if ln.startswith("ingest: {")]) == 1
    shown = subprocess.run([sys.executable, "-m", "pipeline.cli", "inspect", str(tmp_path / "demo" / "samples")],
                           capture_output=True, text=True, env=env, timeout=120)
    assert shown.returncode == 0 and "table samples: 63 rows" in shown.stdout
