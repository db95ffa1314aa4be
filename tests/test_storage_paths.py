"""pipeline/io/storage.py without a store: locations, the cache mirror, URLs that went through
pathlib, and the manifest's storage section (the S3 behaviour itself: tests/test_object_storage.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.io import storage


@pytest.fixture(autouse=True)
def _defaults():
    storage.configure()
    yield
    storage.configure()


def test_locations_and_the_cache_mirror(tmp_path, monkeypatch):
    monkeypatch.setenv("VLPIPE_CACHE_DIR", str(tmp_path / "env-cache"))
    assert storage.is_remote("s3://b/run") and storage.is_remote("gs://b/run")
    assert not storage.is_remote("runs/demo") and not storage.is_remote("/abs") and not storage.is_remote("file:///x")
    assert storage.join("s3://b/run/", "samples", "/_state/") == "s3://b/run/samples/_state"
    assert storage.join("runs/demo", "samples") == str(Path("runs/demo/samples"))
    assert storage.local_path("s3://b/run/samples") == tmp_path / "env-cache" / "s3" / "b" / "run" / "samples"
    assert storage.local_path("runs/demo") == Path("runs/demo") and storage.local_path("file:///x/y") == Path("/x/y")
    assert storage.url_of_local(tmp_path / "env-cache" / "gs" / "b" / "k") == "gs://b/k"
    assert storage.url_of_local(tmp_path / "elsewhere") is None
    storage.configure(cache_dir=str(tmp_path / "manifest-cache"))  # the manifest's storage.cache_dir wins
    assert storage.local_path("s3://b/k") == tmp_path / "manifest-cache" / "s3" / "b" / "k"


def test_urls_survive_pathlib_and_resolve_under_the_output():
    assert storage.normalize(Path("s3://bucket/run/samples")) == "s3://bucket/run/samples"
    assert storage.location(Path("s3://bucket/run")) == "s3://bucket/run"
    assert storage.resolve_under("s3://b/run", "samples") == "s3://b/run/samples"
    assert storage.resolve_under("s3://b/run", "gs://other/x") == "gs://other/x"
    assert storage.resolve_under("runs/demo", "samples") == Path("runs/demo/samples")
    assert storage.resolve_under("s3://b/run", "/abs/samples") == Path("/abs/samples")


def test_url_path_joins_like_a_path():
    p = storage.UrlPath("s3://b/data/") / "imgs" / "a.jpg"
    assert str(p) == "s3://b/data/imgs/a.jpg" and p.name == "a.jpg" and p.stem == "a" and p.suffix == ".jpg"
    assert str(p.parent) == "s3://b/data/imgs" and p.resolve() is p
    from pipeline.readers.base import abspath
    from pipeline.readers.images import tar_ref

    assert isinstance(abspath("s3://b/x.json"), storage.UrlPath)
    assert tar_ref(storage.UrlPath("s3://b/s/0.tar"), "k.jpg") == "s3://b/s/0.tar::k.jpg"


def test_the_manifest_storage_section(tmp_path):
    from pipeline.config import ManifestError, load_manifest
    from pipeline.stage import RunContext

    m = load_manifest(None, ["output=s3://b/run", f"storage.cache_dir={tmp_path}", "storage.endpoint_url=http://127.0.0.1:9",
                             "storage.options={region_name: eu-west-1}"])
    ctx = RunContext(m)
    assert ctx.location == "s3://b/run" and ctx.output == tmp_path / "s3" / "b" / "run"
    assert storage.config() == {"cache_dir": str(tmp_path), "endpoint_url": "http://127.0.0.1:9",
                                "options": {"region_name": "eu-west-1"}}
    with pytest.raises(ManifestError, match="storage.cache_dirr"):
        load_manifest(None, ["storage.cache_dirr=x"])


def test_image_roots_of_datasets_on_object_storage():
    from types import SimpleNamespace

    from pipeline.loaders.samples import dataset_image_root, recorded_root, relative_ref, resolve_ref

    wds = SimpleNamespace(kind="webdataset", path="s3://b/shards/*.tar", images=None)
    assert dataset_image_root(wds, "runs/x") == "s3://b/shards"
    assert dataset_image_root(SimpleNamespace(kind="webdataset", path="s3://b/shards/0.tar", images=None), "o") == "s3://b/shards"
    coco = SimpleNamespace(kind="coco", path=None, images="s3://b/imgs/")
    assert dataset_image_root(coco, "runs/x") == "s3://b/imgs"
    assert recorded_root("runs/x", "s3://b/imgs") == "s3://b/imgs"
    assert relative_ref("s3://b/imgs/a.jpg", "s3://b/imgs") == "s3://b/imgs/a.jpg"  # stored as the full URL
    assert resolve_ref("s3://b/imgs/a.jpg", "s3://b/imgs") == "s3://b/imgs/a.jpg"
    assert resolve_ref("a.jpg", "s3://b/imgs") == "s3://b/imgs/a.jpg"
