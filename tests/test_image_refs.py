"""samples.image is stored relative to the dataset root (root in _manifest.json), so an output moves
between folders and machines: the image stages and the report find the images at their new place;
absolute references of older outputs keep working."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pipeline.io.artifacts import Artifact
from pipeline.loaders.samples import find_image_root, image_resolver, recorded_root, relative_ref, resolve_ref
from pipeline.stage import RunContext, run_stage
from tests.conftest import make_manifest
from tests.test_clip_tokens import make_image_folder
from tests.test_rerun_cheap import _in_process


def test_reference_round_trips(tmp_path):
    root = tmp_path / "data"
    assert relative_ref(str(root / "a" / "b.jpg"), root) == "a/b.jpg"
    assert relative_ref(f"{root / 'shards' / '0001.tar'}::k.jpg", root) == "shards/0001.tar::k.jpg"
    assert relative_ref("/elsewhere/c.jpg", root) == "/elsewhere/c.jpg"  # outside the root: kept absolute
    assert relative_ref("https://host/x.jpg", root) == "https://host/x.jpg"
    assert relative_ref(None, root) is None
    new = tmp_path / "moved"
    assert resolve_ref("a/b.jpg", new) == str(new / "a" / "b.jpg")
    assert resolve_ref("shards/0001.tar::k.jpg", new) == f"{new / 'shards' / '0001.tar'}::k.jpg"
    assert resolve_ref("/old/abs.jpg", new) == "/old/abs.jpg"  # outputs written before: unchanged
    assert resolve_ref("s3://bucket/x.jpg", new) == "s3://bucket/x.jpg"
    assert recorded_root(tmp_path / "out", tmp_path / "out" / "source" / "synthetic") == "source/synthetic"
    assert recorded_root(tmp_path / "out", root) == str(root)


SMALL = ["dataset.synthetic.n_images=5", "dataset.synthetic.captions_per_image=2", "stages.ingest.shard_size=3",
         "stages.extract_clip_tokens.shard_size=3"]


@pytest.fixture
def local(monkeypatch):
    _in_process(monkeypatch, [])


def _rows(art: Artifact) -> int:
    return art.manifest["tables"]["shards"]["rows"]


def test_moved_demo_output_resolves_its_images(tmp_path, local, monkeypatch):
    """The generated dataset lives inside the output: moving the output folder moves its root."""
    m = make_manifest(tmp_path / "a", SMALL)
    run_stage("ingest", RunContext(m))
    samples = Artifact(Path(m.output) / "samples")
    assert samples.manifest["image_root"] == "source/synthetic"
    refs = samples.read("samples", columns=["image"]).column("image").to_pylist()
    assert refs and all(not Path(r).is_absolute() for r in refs)
    moved = tmp_path / "b" / "run"
    shutil.copytree(m.output, moved)
    shutil.rmtree(m.output)  # nothing left at the old place
    m2 = make_manifest(tmp_path / "b", SMALL)
    assert Path(m2.output) == moved
    import pipeline.stage

    with monkeypatch.context() as mp:  # ingest of the moved output: every shard is still complete
        mp.setattr(pipeline.stage, "map_units", lambda *a, **k: pytest.fail("ingest redid shards of a moved output"))
        run_stage("ingest", RunContext(m2))
    assert Artifact(moved / "samples").manifest["fingerprint"] == samples.manifest["fingerprint"]
    run_stage("extract-clip-tokens", RunContext(m2))
    clip = Artifact(moved / "clip_tokens")
    errors = clip.errors().to_pylist()
    assert [e["reason"] for e in errors] == [], errors
    assert _rows(clip) == samples.manifest["tables"]["samples"]["rows"]
    # the report's image reader resolves through the same place
    from PIL import Image

    resolve = image_resolver(moved / "samples")
    Image.open(resolve(refs[0])).verify()


def test_dataset_outside_the_output_moves_with_the_manifest(tmp_path, local):
    """A dataset beside the output (absolute root in _manifest.json): on the new machine the
    manifest says where the dataset is now, and the image stage reads it there."""
    data = make_image_folder(tmp_path / "machine_a" / "data")
    ov = ["dataset.kind=folder", f"dataset.images={data}", "dataset.captions=" + str(data / "captions.tsv"),
          "stages.ingest.shard_size=3", "stages.extract_clip_tokens.shard_size=3", "models.clip=tiny-random"]
    m = make_manifest(tmp_path / "machine_a", ov)
    run_stage("ingest", RunContext(m))
    samples = Artifact(Path(m.output) / "samples")
    assert samples.manifest["image_root"] == str(data)
    good = samples.manifest["tables"]["samples"]["rows"]
    shutil.copytree(tmp_path / "machine_a", tmp_path / "machine_b")
    shutil.rmtree(tmp_path / "machine_a")
    new_data = tmp_path / "machine_b" / "data"
    ov_b = [o.replace("machine_a", "machine_b") for o in ov]
    m2 = make_manifest(tmp_path / "machine_b", ov_b)
    assert find_image_root(Path(m2.output) / "samples", m2) == new_data
    assert find_image_root(Path(m2.output) / "samples") == data  # without a manifest: the recorded root (gone)
    run_stage("extract-clip-tokens", RunContext(m2))
    clip = Artifact(Path(m2.output) / "clip_tokens")
    assert clip.errors().num_rows == 0, clip.errors().to_pylist()
    assert _rows(clip) == good


def test_absolute_references_of_older_outputs_still_work(tmp_path, local):
    m = make_manifest(tmp_path, SMALL)
    run_stage("ingest", RunContext(m))
    sdir = Path(m.output) / "samples"
    man = json.loads((sdir / "_manifest.json").read_text())
    root = Path(m.output) / man.pop("image_root")
    (sdir / "_manifest.json").write_text(json.dumps(man))
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline.io.atomic import sha256_file

    for f in Artifact(sdir).files("samples"):  # rewrite as an older version stored them: absolute
        t = pq.read_table(f)
        absolute = [str(root / r) if r else r for r in t.column("image").to_pylist()]
        pq.write_table(t.set_column(t.schema.get_field_index("image"), "image", pa.array(absolute, pa.string())), f)
        for e in man["shards"]:  # ... and recorded those bytes in its manifest
            if sdir / e["path"] == f:
                e.update(bytes=f.stat().st_size, sha256=sha256_file(f))
    (sdir / "_manifest.json").write_text(json.dumps(man))
    (sdir / "_cache.json").unlink(missing_ok=True)
    resolve = image_resolver(sdir)  # no recorded root, no manifest
    ref = Artifact(sdir).read("samples", columns=["image"]).column("image").to_pylist()[0]
    assert resolve(ref) == ref and Path(ref).is_file()
