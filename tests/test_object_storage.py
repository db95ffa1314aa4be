"""`output:` and dataset paths on object storage, against a real S3 API: moto's server mode on
loopback (127.0.0.1, a free port), reached through s3fs exactly as AWS, MinIO or GCS would be.

End to end: the demo's ingest and extract-clip-tokens (tiny-random CLIP, small generated dataset,
embedded Ray) to ``s3://bucket/run``; the objects and their completion markers are there; a rerun
redoes nothing, and neither does one with the local cache deleted (a fresh machine); a unit whose
marker is missing on the store is redone (marker last); ``pipeline inspect s3://...`` and a
trainer-side loader read it; every shard's bytes equal a local run's. Plus: the lock object, and
datasets (WebDataset tars, Karpathy JSON + images) read from ``s3://`` URLs.
"""

from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path

import pytest

from tests.conftest import make_manifest

pytest.importorskip("s3fs")
moto_server = pytest.importorskip("moto.server")

pytestmark = pytest.mark.slow

KEY = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
SMALL = [
    "dataset.synthetic.n_images=10",
    "dataset.synthetic.captions_per_image=2",
    "dataset.synthetic.corrupt_images=0",
    "stages.ingest.shard_size=4",
    "stages.extract_clip_tokens.shard_size=4",
]
STAGES = ["ingest", "extract-clip-tokens"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3():
    """A moto S3 server on loopback with one bucket; yields its endpoint URL."""
    import logging

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=_free_port(), verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{server._port}"
    import boto3

    boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
                 region_name="us-east-1").create_bucket(Bucket="bucket")
    yield endpoint
    server.stop()
    from pipeline.io import storage

    storage.configure()


def _fs(endpoint):
    import s3fs

    return s3fs.S3FileSystem(key="testing", secret="testing", endpoint_url=endpoint, use_listings_cache=False)


def _storage_overrides(endpoint: str, cache: Path) -> list[str]:
    # the endpoint and (dummy) credentials through the manifest: they reach the Ray workers in
    # their payloads, whatever environment the session's Ray was started with
    return [f"storage.endpoint_url={endpoint}", f"storage.cache_dir={cache}",
            "storage.options={key: testing, secret: testing}"]


class Recorder:
    """pipeline.stage.map_units, recording the units it is given (what a run redoes)."""

    def __init__(self, monkeypatch):
        import pipeline.stage as S

        self.units: list[tuple[str, str]] = []
        real = S.map_units

        def recording(units, fn, **kw):
            units = list(units)
            self.units.extend((u["stage"], u["unit"]) for u in units)
            return real(units, fn, **kw)

        monkeypatch.setattr(S, "map_units", recording)


def _run(m, stages=STAGES):
    from pipeline.stage import RunContext, run_stage

    ctx = RunContext(m)
    for s in stages:
        run_stage(s, ctx)


@pytest.fixture(scope="module")
def runs(s3, tmp_path_factory, ray_session):
    """A local run and an S3 run of the same stages on the same generated dataset."""
    import torch

    torch.set_num_threads(1)
    base = tmp_path_factory.mktemp("objstore")
    data = [f"dataset.synthetic.root={base / 'data'}"]
    local = make_manifest(base / "local", SMALL + data)
    _run(local)
    cache = base / "cache"
    remote = make_manifest(base, SMALL + data + ["output=s3://bucket/run"] + _storage_overrides(s3, cache))
    assert remote.output == "s3://bucket/run"
    _run(remote)
    return local, remote, cache, base


def _objects(fs, prefix: str) -> dict[str, int]:
    return {k[len(prefix) + 1:]: v["size"] for k, v in fs.find(prefix, detail=True).items()}


def test_run_to_s3_writes_objects_markers_and_the_local_runs_bytes(runs, s3):
    local, remote, cache, _ = runs
    fs = _fs(s3)
    for art in ("samples", "clip_tokens"):
        objs = _objects(fs, f"bucket/run/{art}")
        assert "_manifest.json" in objs and "errors/errors.parquet" in objs
        assert "_lock" not in objs, "the lock object is removed when the stage ends"
        manifest = json.loads(fs.cat_file(f"bucket/run/{art}/_manifest.json"))
        markers = sorted(k for k in objs if k.startswith("_state/"))
        assert len(markers) == manifest["units"] >= 2
        for key in markers:
            for f in json.loads(fs.cat_file(f"bucket/run/{art}/{key}"))["files"]:
                assert objs[f["path"]] == f["bytes"]
        # the same bytes as a local run, shard for shard
        local_manifest = json.loads((Path(local.output) / art / "_manifest.json").read_text())
        assert [(s["path"], s["sha256"]) for s in manifest["shards"]] == [(s["path"], s["sha256"]) for s in local_manifest["shards"]]
        for s in local_manifest["shards"]:
            assert fs.cat_file(f"bucket/run/{art}/{s['path']}") == (Path(local.output) / art / s["path"]).read_bytes()
    # written through the local mirror of the configured cache
    assert (cache / "s3" / "bucket" / "run" / "samples" / "_manifest.json").is_file()


def test_resume_redoes_nothing_even_with_an_empty_cache(runs, monkeypatch, s3):
    _, remote, cache, _ = runs
    fs = _fs(s3)
    before = {k: v["LastModified"] for k, v in fs.find("bucket/run", detail=True).items() if "/_state/" in k}
    rec = Recorder(monkeypatch)
    _run(remote)
    assert rec.units == []
    shutil.rmtree(cache)  # a fresh machine: nothing local, everything from the store
    _run(remote)
    assert rec.units == [], "a unit complete on the store was redone"
    after = {k: v["LastModified"] for k, v in fs.find("bucket/run", detail=True).items() if "/_state/" in k}
    assert after == before


def test_a_unit_without_its_marker_on_the_store_is_redone(runs, monkeypatch, s3):
    _, remote, cache, _ = runs
    fs = _fs(s3)
    data = fs.cat_file("bucket/run/samples/samples/samples-00001.parquet")
    fs.rm_file("bucket/run/samples/_state/00001.json")  # a crash between the files and the marker
    rec = Recorder(monkeypatch)
    _run(remote, ["ingest"])  # the cache still holds the marker: the store decides
    assert rec.units == [("ingest", "00001")]
    assert fs.exists("bucket/run/samples/_state/00001.json")
    assert fs.cat_file("bucket/run/samples/samples/samples-00001.parquet") == data
    rec.units.clear()
    _run(remote, ["ingest"])
    assert rec.units == []


def test_the_marker_is_the_last_object_a_unit_puts(runs, monkeypatch, s3):
    """Crash a unit's upload after its files: no marker on the store, so the unit is not complete."""
    _, remote, cache, _ = runs
    from pipeline.io import storage

    fs = _fs(s3)
    fs.rm_file("bucket/run/samples/_state/00002.json")
    puts = []
    real = storage.Remote.put

    def failing_put(self, rel, local=None):
        if rel.startswith("_state/"):
            raise OSError("connection reset")
        puts.append(rel)
        return real(self, rel, local)

    monkeypatch.setattr(storage.Remote, "put", failing_put)
    from pipeline.io.artifacts import ArtifactWriter

    from pipeline.stage import RunContext

    RunContext(remote)  # applies the manifest's storage section
    w = ArtifactWriter("s3://bucket/run", "samples", "ingest", {"x": 1})
    assert not w.is_done("00002", "any")
    u = w.unit_writer("00002", "fp")
    import pyarrow as pa

    u.write_table("samples", pa.table({"sample_id": [1]}))
    with pytest.raises(OSError):
        u.commit()
    assert puts == ["samples/samples-00002.parquet"]
    assert not fs.exists("bucket/run/samples/_state/00002.json")
    from pipeline.io.artifacts import release_lock

    release_lock()
    monkeypatch.undo()
    rec = Recorder(monkeypatch)
    _run(remote, ["ingest"])
    assert rec.units == [("ingest", "00002")]


def test_inspect_and_a_loader_read_the_s3_artifacts(runs, monkeypatch, s3, tmp_path):
    local, remote, cache, _ = runs
    from typer.testing import CliRunner

    from pipeline.cli import app
    from pipeline.io import storage

    # the standard environment variables this time, and another (empty) cache
    storage.configure()
    for k, v in {**KEY, "AWS_ENDPOINT_URL": s3, "VLPIPE_CACHE_DIR": str(tmp_path / "cache2")}.items():
        monkeypatch.setenv(k, v)
    res = CliRunner().invoke(app, ["inspect", "s3://bucket/run/samples", "-n", "2"])
    assert res.exit_code == 0, res.output
    assert "artifact   samples" in res.output and "folder     s3://bucket/run/samples" in res.output
    assert "table samples: 10 rows" in res.output
    res = CliRunner().invoke(app, ["inspect", "s3://bucket/run"])
    assert res.exit_code == 2 and "run folder" in res.output
    res = CliRunner().invoke(app, ["verify", "s3://bucket/run"])
    assert res.exit_code == 0, res.output
    assert "s3://bucket/run/clip_tokens: ok" in res.output

    from pipeline.io.shards import ShardStream
    from pipeline.loaders.clip_tokens import collate, shard_paths, shard_reader

    def batches(artifact):
        shards = shard_paths(artifact)  # fetched into the cache and checked against the manifest
        return list(ShardStream(shards, shard_reader(shards), lambda s, rng: collate(s, "all", rng), 3,
                                shuffle=False, drop_last=False))

    got = batches("s3://bucket/run/clip_tokens")
    want = batches(Path(local.output) / "clip_tokens")
    assert len(got) == len(want) > 1
    for a, b in zip(got, want):
        assert a.keys() == b.keys()
        for k in a:
            assert (a[k] == b[k]).all(), k
    assert (tmp_path / "cache2" / "s3" / "bucket" / "run" / "clip_tokens" / "shards").is_dir()
    # a corrupted object is caught against the manifest's sha256 when fetched
    fs = _fs(s3)
    path = "bucket/run/clip_tokens/" + json.loads(fs.cat_file("bucket/run/clip_tokens/_manifest.json"))["shards"][0]["path"]
    good = fs.cat_file(path)
    shutil.rmtree(tmp_path / "cache2")
    fs.pipe_file(path, bytes(len(good)))
    try:
        with pytest.raises(OSError, match="not the one _manifest.json records"):
            shard_paths("s3://bucket/run/clip_tokens")
        res = CliRunner().invoke(app, ["verify", "s3://bucket/run/clip_tokens"])
        assert res.exit_code == 1 and "sha256 differs" in res.output
    finally:
        fs.pipe_file(path, good)


def test_the_lock_object(s3, tmp_path, monkeypatch):
    from pipeline.io import storage
    from pipeline.io.artifacts import ArtifactBusy, ArtifactWriter, release_lock

    storage.configure(cache_dir=str(tmp_path / "c"), endpoint_url=s3, options={"key": "testing", "secret": "testing"})
    fs = _fs(s3)
    fs.pipe_file("bucket/locks/things/_lock", json.dumps({"pid": 1, "host": "elsewhere", "since": "then"}).encode())
    with pytest.raises(ArtifactBusy, match="pid 1 on elsewhere.*delete s3://bucket/locks/things/_lock"):
        ArtifactWriter("s3://bucket/locks", "things", "test", {})
    # one left by a killed run on this host is taken over
    fs.pipe_file("bucket/locks/things/_lock", json.dumps({"pid": 2**22 + 12345, "host": socket.gethostname()}).encode())
    w = ArtifactWriter("s3://bucket/locks", "things", "test", {})
    holder = json.loads(fs.cat_file("bucket/locks/things/_lock"))
    import os

    assert holder["pid"] == os.getpid()
    w.finalize([])
    assert not fs.exists("bucket/locks/things/_lock")
    release_lock()


def test_datasets_read_from_s3_urls(s3, tmp_path, monkeypatch):
    """A WebDataset folder, and Karpathy and COCO caption JSONs with their images, uploaded to the
    bucket and ingested from their URLs: the same captions and image sizes as from the local copies."""
    import io
    import tarfile

    from PIL import Image

    from pipeline.io.artifacts import Artifact
    from pipeline.stage import RunContext, run_stage
    from tests.test_rerun_cheap import _in_process

    _in_process(monkeypatch, [])
    fs = _fs(s3)
    src = tmp_path / "src"
    (src / "wds").mkdir(parents=True)
    (src / "imgs").mkdir()
    images = []
    for shard in range(2):
        with tarfile.open(src / "wds" / f"{shard:05d}.tar", "w") as tf:
            for i in range(3):
                key = f"{shard}{i:03d}"
                buf = io.BytesIO()
                Image.new("RGB", (8 + i, 6), (i * 40, 0, 0)).save(buf, "PNG")
                for name, data in ((f"{key}.png", buf.getvalue()), (f"{key}.txt", f"a red square number {key}".encode())):
                    ti = tarfile.TarInfo(name)
                    ti.size = len(data)
                    tf.addfile(ti, io.BytesIO(data))
                (src / "imgs" / f"{key}.png").write_bytes(buf.getvalue())
                images.append({"filename": f"{key}.png", "split": "train", "imgid": len(images),
                               "sentences": [{"raw": f"a red square number {key}"}]})
    (src / "karpathy.json").write_text(json.dumps({"images": images}))
    (src / "coco.json").write_text(json.dumps({
        "images": [{"id": im["imgid"], "file_name": im["filename"]} for im in images],
        "annotations": [{"id": im["imgid"], "image_id": im["imgid"], "caption": im["sentences"][0]["raw"]} for im in images]}))
    fs.put(str(src), "bucket/datasets", recursive=True)
    assert fs.exists("bucket/datasets/wds/00001.tar")
    cache = _storage_overrides(s3, tmp_path / "cache")
    for kind, url_keys, local_keys in [
        ("webdataset", ["dataset.path=s3://bucket/datasets/wds"], [f"dataset.path={src / 'wds'}"]),
        ("karpathy", ["dataset.captions=s3://bucket/datasets/karpathy.json", "dataset.images=s3://bucket/datasets/imgs"],
         [f"dataset.captions={src / 'karpathy.json'}", f"dataset.images={src / 'imgs'}"]),
        ("coco", ["dataset.captions=s3://bucket/datasets/coco.json", "dataset.images=s3://bucket/datasets/imgs"],
         [f"dataset.captions={src / 'coco.json'}", f"dataset.images={src / 'imgs'}"]),
    ]:
        out = {}
        for where, keys in (("url", url_keys), ("local", local_keys)):
            m = make_manifest(tmp_path / f"{kind}-{where}", [f"dataset.kind={kind}", *keys, "stages.ingest.shard_size=4", *cache])
            run_stage("ingest", RunContext(m))
            art = Artifact(Path(m.output) / "samples")
            assert art.errors().num_rows == 0, art.errors().to_pylist()
            out[where] = (art.read("captions"), art.read("samples"))
        assert out["url"][0].equals(out["local"][0]), kind
        url_s, loc_s = out["url"][1].to_pydict(), out["local"][1].to_pydict()
        assert url_s["width"] == loc_s["width"] and url_s["height"] == loc_s["height"]
        assert all(ref.startswith("s3://bucket/datasets/") for ref in url_s["image"])
        # the stored URL reference opens
        from pipeline.readers.images import open_image

        assert open_image(url_s["image"][0]).size == (url_s["width"][0], url_s["height"][0])
